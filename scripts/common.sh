# Launch steps shared by scripts/run-*.sh. Source it, then call `slime_spec_launch <train flags>`.
#
#   1. `python -m slime_spec.doctor <flags>`: stop with exit code 2 and the doctor's message on an error.
#      DOCTOR_ONLY=1 stops here (exit 0 when the configuration is clean).
#   2. `ray start --head` only when no Ray cluster answers at $RAY_ADDRESS; remembered, so the exit trap
#      runs `ray stop` only for a head this script started. (`ray stop` stops every Ray process on this
#      node, so it is never run when the script found a cluster already there.)
#   3. `ray job submit ... -- python3 -m slime_spec.train <flags>`; if the script is interrupted while the
#      job runs, the trap stops that job (by its submission id) and nothing else.
#
# Environment (all optional):
#   PYTHON          interpreter for the doctor (default python3)
#   MASTER_ADDR     head node address (default 127.0.0.1)
#   RAY_ADDRESS     Ray GCS address host:port to look for (default $MASTER_ADDR:6379)
#   RAY_DASHBOARD   job submission address (default http://$MASTER_ADDR:8265)
#   NUM_GPUS_PER_NODE  GPUs the head offers when this script starts it (default 8)
#   NCCL_NVLS_ENABLE   forwarded to the job (default 0: NVLink multicast off)

SLIME_SPEC_STARTED_RAY_HEAD=0
SLIME_SPEC_JOB_RUNNING=0
SLIME_SPEC_SUBMISSION_ID=""

slime_spec_cleanup() {
   local rc=$?
   if [ "$SLIME_SPEC_JOB_RUNNING" = 1 ]; then
      echo "[slime-spec] stopping job $SLIME_SPEC_SUBMISSION_ID (started by this script)" >&2
      RAY_API_SERVER_ADDRESS="$RAY_DASHBOARD" ray job stop --address "$RAY_DASHBOARD" "$SLIME_SPEC_SUBMISSION_ID" \
         || echo "[slime-spec] could not stop job $SLIME_SPEC_SUBMISSION_ID; check 'ray job list'" >&2
   fi
   if [ "$SLIME_SPEC_STARTED_RAY_HEAD" = 1 ]; then
      echo "[slime-spec] stopping the Ray head this script started" >&2
      ray stop || echo "[slime-spec] 'ray stop' failed; check 'ray status'" >&2
   fi
   return $rc
}

# A cluster is there when its GCS port accepts connections. (`ray status` would wait ~45 s on a closed
# port, and fails on a token-authenticated cluster unless RAY_AUTH_MODE is set.)
slime_spec_ray_reachable() {
   local host="${1%:*}" port="${1##*:}"
   timeout 5 bash -c "exec 3<>/dev/tcp/${host}/${port}" 2>/dev/null
}

slime_spec_launch() {
   local -a train_args=("$@")
   local script_name
   script_name="$(basename -- "${BASH_SOURCE[1]:-slime-spec}" .sh)"

   echo "[slime-spec] checking the configuration: ${PYTHON:-python3} -m slime_spec.doctor"
   local rc=0
   "${PYTHON:-python3}" -m slime_spec.doctor "${train_args[@]}" || rc=$?
   if [ "$rc" = 2 ]; then
      echo "[slime-spec] doctor found errors (above): fix them before launching; nothing was started" >&2
      exit 2
   elif [ "$rc" != 0 ]; then
      echo "[slime-spec] the doctor itself failed (exit code $rc); nothing was started" >&2
      exit "$rc"
   fi
   if [ "${DOCTOR_ONLY:-0}" = 1 ]; then
      echo "[slime-spec] DOCTOR_ONLY=1: configuration is clean; not launching"
      exit 0
   fi

   MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
   RAY_ADDRESS="${RAY_ADDRESS:-${MASTER_ADDR}:6379}"
   RAY_DASHBOARD="${RAY_DASHBOARD:-http://${MASTER_ADDR}:8265}"
   trap slime_spec_cleanup EXIT
   trap 'exit 130' INT
   trap 'exit 143' TERM

   if slime_spec_ray_reachable "$RAY_ADDRESS"; then
      echo "[slime-spec] using the Ray cluster at $RAY_ADDRESS (this script will not stop it)"
   else
      echo "[slime-spec] no Ray cluster at $RAY_ADDRESS: starting a head node"
      ray start --head --node-ip-address "$MASTER_ADDR" --port "${RAY_ADDRESS##*:}" \
         --num-gpus "${NUM_GPUS_PER_NODE:-8}" --disable-usage-stats \
         --dashboard-host "$MASTER_ADDR" --dashboard-port "${RAY_DASHBOARD##*:}"
      SLIME_SPEC_STARTED_RAY_HEAD=1
   fi

   local runtime_env
   runtime_env=$(printf '{"env_vars": {"PYTHONUNBUFFERED": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_NVLS_ENABLE": "%s", "MASTER_ADDR": "%s"}}' \
      "${NCCL_NVLS_ENABLE:-0}" "$MASTER_ADDR")
   SLIME_SPEC_SUBMISSION_ID="${script_name}-$(date +%Y%m%d-%H%M%S)-$$"
   SLIME_SPEC_JOB_RUNNING=1
   rc=0
   # RAY_API_SERVER_ADDRESS: `ray job` prefers the RAY_ADDRESS environment variable over --address.
   RAY_API_SERVER_ADDRESS="$RAY_DASHBOARD" ray job submit --address "$RAY_DASHBOARD" \
      --submission-id "$SLIME_SPEC_SUBMISSION_ID" \
      --runtime-env-json "$runtime_env" \
      -- python3 -m slime_spec.train "${train_args[@]}" || rc=$?
   SLIME_SPEC_JOB_RUNNING=0
   return "$rc"
}
