# Launch steps shared by scripts/run-*.sh. Source it, then call `slime_spec_launch <train flags>`.
#
#   1. The environment overrides below are applied to the script's flags (then EXTRA_ARGS, last wins).
#   2. `$PYTHON -m slime_spec.doctor.diagnose <flags>`: stop with exit code 2 and the doctor's message on an error.
#      DOCTOR_ONLY=1 stops here (exit 0 when the configuration is clean).
#   3. With RAY_ADDRESS set: the job goes to that cluster (started by you; this script never stops it).
#      Without it: `ray start --head --block` in the background, in its own process group and temp dir, every
#      Ray service on a port chosen free (GCS, dashboard, dashboard agent HTTP and gRPC, metrics export, client
#      server, node manager, object manager, runtime env agent), so another Ray on the same machine (on
#      Ray's default ports) is neither used nor in the way; the exit trap stops that process group and
#      nothing else (never `ray stop`, which stops every Ray process on the node, other people's clusters too).
#      Whether some cluster already answers on a port is never asked: an open port may be anyone's.
#   4. `ray job submit ... -- $PYTHON -m slime_spec.train <flags>` to that cluster's job server; if the script
#      is interrupted while the job runs, the trap stops that job (by its submission id) and nothing else.
#
# Environment (all optional):
#   PYTHON             interpreter for the doctor AND the job (default python3); it must import slime_spec,
#                      torch and ray: e.g. PYTHON=.venv/bin/python after `make venv`
#   SMALL_MACHINE=1    run the script on one machine without GPUs, two small GRPO steps: the defaults
#                      NUM_GPUS_PER_NODE=0 ROLLOUT_BACKEND=embedded TP=1 NUM_ROLLOUT=2, small batches and
#                      short responses. Point HF_CHECKPOINT and PROMPT_DATA at a small model and data set.
#   HF_CHECKPOINT      the model (--hf-checkpoint); when set, the script's MODEL_ARGS (the shape of its own
#                      model) are left out: the trainer and the doctor read the shape from its config.json
#   DRAFT_CHECKPOINT   an external draft model (--sglang-speculative-draft-model-path), EAGLE3 scripts
#   PROMPT_DATA        training prompts (--prompt-data)
#   EVAL_PROMPT_DATA   held-out prompts (--eval-prompt-data eval <file>); set to "" for no evaluation
#   CKPT_DIR           --load and --save directory
#   OUTPUT_DIR         --output-dir (metrics.jsonl, summary.json, plot.png, engine command lines)
#   ROLLOUT_BACKEND    sglang | embedded (--rollout-backend)
#   NUM_GPUS_PER_NODE  GPUs per node (script default 8). 0: a CPU machine: one train process, CPU engines,
#                      and the GPU-only flags (CUDA graphs, attention kernels, memory saver, recompute, ...)
#                      left out
#   TP                 trainer tensor parallel size (--tensor-model-parallel-size)
#   NUM_ROLLOUT        --num-rollout
#   EXTRA_ARGS         more flags, appended last (last one wins)
#   MASTER_ADDR        address of a head this script starts (default 127.0.0.1)
#   RAY_ADDRESS        a Ray cluster you started: its GCS host:port, or its job server http://host:port (as
#                      `ray job submit` reads RAY_ADDRESS). Unset: this script starts a head of its own
#   RAY_DASHBOARD      job server of the RAY_ADDRESS cluster (default http://<RAY_ADDRESS host>:8265)
#   RAY_TEMP_DIR       temp dir of a head this script starts (default: a new /tmp/slime-spec-ray.XXXXXX)
#   RAY_HEAD_EXTRA_ARGS  more `ray start --head` flags (after the chosen ports: a port given here wins)
#   RAY_AUTH_MODE      Ray 2.60 token authentication. A head this script starts uses `token` unless this says
#                      `disabled`; a token is made with `ray get-auth-token --generate` when there is none
#                      (~/.ray/auth_token, or RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH). For a cluster you started
#                      yourself, set RAY_AUTH_MODE (and the token) as that cluster needs.
#   NCCL_NVLS_ENABLE   forwarded to the job (default 0: NVLink multicast off)

SLIME_SPEC_ROOT="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." &>/dev/null && pwd)"

if [ "${SMALL_MACHINE:-0}" = 1 ]; then
   NUM_GPUS_PER_NODE="${NUM_GPUS_PER_NODE:-0}"
   ROLLOUT_BACKEND="${ROLLOUT_BACKEND:-embedded}"
   TP="${TP:-1}"
   NUM_ROLLOUT="${NUM_ROLLOUT:-2}"
fi

# Flags (with their values) that only mean something on GPUs: left out when NUM_GPUS_PER_NODE=0.
SLIME_SPEC_GPU_ONLY_FLAGS=(
   --sglang-attention-backend --sglang-cuda-graph-bs-decode --sglang-cuda-graph-max-bs-decode
   --sglang-enable-memory-saver --sglang-enable-draft-weights-cpu-backup --sglang-mem-fraction-static
   --sglang-max-running-requests --sglang-enable-dp-attention --sglang-dp-size --sglang-ep-size
   --sequence-parallel --recompute-granularity --recompute-method --recompute-num-layers
   --use-dynamic-batch-size --max-tokens-per-gpu --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32 --optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d
   --use-precision-aware-optimizer --decoder-last-pipeline-num-layers --decoder-first-pipeline-num-layers
)
SLIME_SPEC_EVAL_FLAGS=(--eval-interval --eval-prompt-data --n-samples-per-eval-prompt --eval-max-response-len
                       --eval-temperature --eval-top-p --eval-top-k)

SLIME_SPEC_RAY=(ray)
SLIME_SPEC_HEAD_PID=""
SLIME_SPEC_JOB_RUNNING=0
SLIME_SPEC_SUBMISSION_ID=""

# Prints "$@" less every flag named in the array SLIME_SPEC_DROP (each with the values that follow it), as
# NUL-separated words, so values with spaces survive.
slime_spec_drop_flags() {
   local arg drop=0 d
   for arg in "$@"; do
      if [[ $arg == --* ]]; then
         drop=0
         for d in "${SLIME_SPEC_DROP[@]}"; do
            if [ "$arg" = "$d" ]; then drop=1; break; fi
         done
      fi
      if [ "$drop" = 0 ]; then printf '%s\0' "$arg"; fi
   done
}

# The script's flags with the environment overrides applied; the result is in SLIME_SPEC_ARGS.
slime_spec_apply_env() {
   SLIME_SPEC_DROP=()
   if [ "${NUM_GPUS_PER_NODE:-8}" = 0 ]; then SLIME_SPEC_DROP+=("${SLIME_SPEC_GPU_ONLY_FLAGS[@]}"); fi
   if [ "${EVAL_PROMPT_DATA-unset}" = "" ]; then SLIME_SPEC_DROP+=("${SLIME_SPEC_EVAL_FLAGS[@]}"); fi
   local -a env_args=()
   if [ "${NUM_GPUS_PER_NODE:-8}" = 0 ]; then
      env_args+=(--actor-num-nodes 1 --actor-num-gpus-per-node 1 --rollout-num-gpus 0
                 --rollout-num-gpus-per-engine 1 --pipeline-model-parallel-size 1 --context-parallel-size 1
                 --expert-model-parallel-size 1 --expert-tensor-parallel-size 1)
   fi
   if [ "${SMALL_MACHINE:-0}" = 1 ]; then
      env_args+=(--rollout-batch-size 2 --n-samples-per-prompt 2 --global-batch-size 4 --micro-batch-size 2
                 --rollout-max-response-len 8 --eval-max-response-len 8 --n-samples-per-eval-prompt 1)
   fi
   [ -n "${HF_CHECKPOINT:-}" ] && env_args+=(--hf-checkpoint "$HF_CHECKPOINT")
   [ -n "${DRAFT_CHECKPOINT:-}" ] && env_args+=(--sglang-speculative-draft-model-path "$DRAFT_CHECKPOINT")
   [ -n "${PROMPT_DATA:-}" ] && env_args+=(--prompt-data "$PROMPT_DATA")
   [ -n "${EVAL_PROMPT_DATA:-}" ] && env_args+=(--eval-prompt-data eval "$EVAL_PROMPT_DATA")
   [ -n "${CKPT_DIR:-}" ] && env_args+=(--load "$CKPT_DIR" --save "$CKPT_DIR")
   [ -n "${OUTPUT_DIR:-}" ] && env_args+=(--output-dir "$OUTPUT_DIR")
   [ -n "${ROLLOUT_BACKEND:-}" ] && env_args+=(--rollout-backend "$ROLLOUT_BACKEND")
   [ -n "${TP:-}" ] && env_args+=(--tensor-model-parallel-size "$TP")
   [ -n "${NUM_ROLLOUT:-}" ] && env_args+=(--num-rollout "$NUM_ROLLOUT")
   SLIME_SPEC_ARGS=()
   local arg
   while IFS= read -r -d '' arg; do SLIME_SPEC_ARGS+=("$arg"); done < <(slime_spec_drop_flags "$@" "${env_args[@]}")
   local -a extra=()
   read -r -a extra <<< "${EXTRA_ARGS:-}"
   SLIME_SPEC_ARGS+=("${extra[@]}")
}

# The interpreter must exist and import what the doctor and the job need; say so plainly if not.
slime_spec_check_python() {
   local py="$1"  # $2: the PYTHONPATH the doctor and the job get
   if ! command -v "$py" >/dev/null 2>&1; then
      echo "[slime-spec] PYTHON=$py: no such interpreter. Set PYTHON to the python of your slime-spec" \
           "environment, e.g. PYTHON=.venv/bin/python (after 'make venv')" >&2
      exit 2
   fi
   local missing
   missing=$(PYTHONPATH="$2" "$py" -c 'import importlib.util as u
print(" ".join(m for m in ("slime_spec", "torch", "ray") if u.find_spec(m) is None))' 2>&1) || missing="(python failed: $missing)"
   if [ -n "$missing" ]; then
      echo "[slime-spec] PYTHON=$py cannot import: $missing. Set PYTHON to the python of your slime-spec" \
           "environment, e.g. PYTHON=.venv/bin/python (after 'make venv'), or install it there" \
           "('pip install -r requirements.txt && pip install --no-deps -e .')" >&2
      exit 2
   fi
}

# The --output-dir the job will use (the last one given; the flag's default is `outputs`).
slime_spec_output_dir() {
   local out="outputs" prev="" arg
   for arg in "$@"; do
      if [ "$prev" = --output-dir ]; then out="$arg"; fi
      prev="$arg"
   done
   echo "$out"
}

# The doctor's report, with its engine command lines (hundreds of characters each, one per engine) cut to
# their start: the full lines stay in the report file.
slime_spec_short_doctor_report() {
   awk -v file="$1" '
      /^  engine [0-9]+ / {
         n++
         if (n == 1) { line = $0; if (length(line) > 110) line = substr(line, 1, 110) " ..."; print line }
         next
      }
      { if (n > 1 && !noted) { print "  ... " n - 1 " more engine command line(s)"; noted = 1 } print }
      END { if (n > 1 && !noted) print "  ... " n - 1 " more engine command line(s)"
            if (n) print "  (full engine command lines: " file ")" }' "$1"
}

# Whether a process group still has a live (not zombie) member. A killed head's children can stay zombies
# in its group until the init process reaps them; they hold nothing.
slime_spec_group_running() {
   ps -eo pgid=,stat= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ { found = 1 } END { exit !found }'
}

# Poll (every 0.2 s, up to $2 seconds) until process group $1 has no live member; never fails.
slime_spec_wait_group_gone() {
   local i
   for i in $(seq 1 $(( $2 * 5 ))); do
      slime_spec_group_running "$1" || return 0
      sleep 0.2
   done
   return 0
}

# The EXIT trap; the scripts run under `set -e`, so nothing here may fail.
slime_spec_cleanup() {
   local rc=$?
   if [ "$SLIME_SPEC_JOB_RUNNING" = 1 ]; then
      echo "[slime-spec] stopping job $SLIME_SPEC_SUBMISSION_ID (started by this script)" >&2
      RAY_API_SERVER_ADDRESS="$RAY_DASHBOARD" "${SLIME_SPEC_RAY[@]}" job stop --address "$RAY_DASHBOARD" \
         "$SLIME_SPEC_SUBMISSION_ID" || echo "[slime-spec] could not stop job $SLIME_SPEC_SUBMISSION_ID; check 'ray job list'" >&2
   fi
   if [ -n "$SLIME_SPEC_HEAD_PID" ]; then
      echo "[slime-spec] stopping the Ray head this script started (process group $SLIME_SPEC_HEAD_PID)" >&2
      kill -TERM -- "-$SLIME_SPEC_HEAD_PID" 2>/dev/null || true
      slime_spec_wait_group_gone "$SLIME_SPEC_HEAD_PID" 10
      kill -KILL -- "-$SLIME_SPEC_HEAD_PID" 2>/dev/null || true  # what SIGTERM left in the head's group
      wait "$SLIME_SPEC_HEAD_PID" 2>/dev/null || true
      # A killed process lives on while the kernel tears it down (unmapping a large heap takes a moment):
      # return only once the group has no live member, so nothing of the head outlives the script.
      slime_spec_wait_group_gone "$SLIME_SPEC_HEAD_PID" 10
      if slime_spec_group_running "$SLIME_SPEC_HEAD_PID"; then
         echo "[slime-spec] the Ray head's process group $SLIME_SPEC_HEAD_PID still has live processes; see ps -g $SLIME_SPEC_HEAD_PID" >&2
      fi
   fi
   return $rc
}

# A listener is there when its port accepts connections: only asked of the ports of the head this script
# started, while it comes up. (`ray status` would wait ~45 s on a closed port, and fails on a
# token-authenticated cluster unless RAY_AUTH_MODE is set.)
slime_spec_port_open() {
   local host="${1%:*}" port="${1##*:}"
   timeout 5 bash -c "exec 3<>/dev/tcp/${host}/${port}" 2>/dev/null
}

# `ray start --head --block` in the background, in a process group of its own: stopping that group stops
# exactly the head this script started. Every service it starts gets a port free now, under the kernel's
# ephemeral range so no outgoing connection takes it before Ray binds it (Ray's defaults, e.g. the
# dashboard agent's 52365, may belong to another Ray on this machine: its job submissions would then fail
# with "No available agent to submit job"). Sets RAY_ADDRESS and RAY_DASHBOARD to this head's; waits until
# its GCS, its job server and its dashboard agent answer.
slime_spec_start_head() {
   local -a ports
   read -r -a ports < <(PYTHONPATH="$1" "$2" -c 'import sys
from slime_spec.common.net import free_ports
print(*free_ports(9, sys.argv[1]))' "$MASTER_ADDR")
   if [ "${#ports[@]}" != 9 ]; then
      echo "[slime-spec] could not choose free ports for the Ray head on $MASTER_ADDR (PYTHON=$2)" >&2
      exit 1
   fi
   RAY_ADDRESS="$MASTER_ADDR:${ports[0]}"
   RAY_DASHBOARD="http://$MASTER_ADDR:${ports[1]}"
   local dash="${RAY_DASHBOARD#*://}" agent="$MASTER_ADDR:${ports[2]}"
   # Ray's unix sockets live under it: keep it short (~107 characters for a socket path)
   SLIME_SPEC_RAY_TMP="${RAY_TEMP_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/slime-spec-ray.XXXXXX")}"
   mkdir -p "$SLIME_SPEC_RAY_TMP"
   if [ "${RAY_AUTH_MODE:-token}" = token ]; then
      export RAY_AUTH_MODE=token
      if [ -z "${RAY_AUTH_TOKEN:-}" ] && [ -z "${RAY_AUTH_TOKEN_PATH:-}" ]; then
         "${SLIME_SPEC_RAY[@]}" get-auth-token --generate >/dev/null
      fi
   fi
   echo "[slime-spec] RAY_ADDRESS is not set: starting a head node at $RAY_ADDRESS, jobs to $RAY_DASHBOARD" \
        "(RAY_AUTH_MODE=$RAY_AUTH_MODE, temp dir $SLIME_SPEC_RAY_TMP, log $SLIME_SPEC_RAY_TMP/head.log)"
   setsid "${SLIME_SPEC_RAY[@]}" start --head --block --node-ip-address "$MASTER_ADDR" --port "${ports[0]}" \
      --num-gpus "${NUM_GPUS_PER_NODE:-8}" --disable-usage-stats --temp-dir "$SLIME_SPEC_RAY_TMP" \
      --include-dashboard true --dashboard-host "$MASTER_ADDR" --dashboard-port "${ports[1]}" \
      --dashboard-agent-listen-port "${ports[2]}" --dashboard-agent-grpc-port "${ports[3]}" \
      --metrics-export-port "${ports[4]}" --ray-client-server-port "${ports[5]}" \
      --node-manager-port "${ports[6]}" --object-manager-port "${ports[7]}" --runtime-env-agent-port "${ports[8]}" \
      ${RAY_HEAD_EXTRA_ARGS:-} > "$SLIME_SPEC_RAY_TMP/head.log" 2>&1 &
   SLIME_SPEC_HEAD_PID=$!
   local i
   for i in $(seq 1 "${RAY_HEAD_START_TIMEOUT:-120}"); do
      if ! kill -0 "$SLIME_SPEC_HEAD_PID" 2>/dev/null; then
         SLIME_SPEC_HEAD_PID=""
         echo "[slime-spec] 'ray start --head' exited; its log ($SLIME_SPEC_RAY_TMP/head.log):" >&2
         tail -n 30 "$SLIME_SPEC_RAY_TMP/head.log" >&2
         exit 1
      fi
      if slime_spec_port_open "$RAY_ADDRESS" && slime_spec_port_open "$dash" && slime_spec_port_open "$agent"; then
         return 0
      fi
      sleep 1
   done
   echo "[slime-spec] the Ray head did not answer at $RAY_ADDRESS and $dash in ${RAY_HEAD_START_TIMEOUT:-120} s" \
        "(RAY_HEAD_START_TIMEOUT); log: $SLIME_SPEC_RAY_TMP/head.log" >&2
   exit 1
}

slime_spec_launch() {
   local script_name
   script_name="$(basename -- "${BASH_SOURCE[1]:-slime-spec}" .sh)"
   slime_spec_apply_env "$@"
   local -a train_args=("${SLIME_SPEC_ARGS[@]}")

   # this checkout first on the path, for the doctor here and for the job and its workers
   local pythonpath="${SLIME_SPEC_ROOT}${PYTHONPATH:+:$PYTHONPATH}"
   local py="${PYTHON:-python3}"
   slime_spec_check_python "$py" "$pythonpath"
   py="$(command -v "$py")"
   # the `ray` of the interpreter's environment: its console script, else its module
   SLIME_SPEC_RAY=("$(dirname -- "$py")/ray")
   [ -x "${SLIME_SPEC_RAY[0]}" ] || SLIME_SPEC_RAY=("$py" -m ray.scripts.scripts)

   echo "[slime-spec] checking the configuration: $py -m slime_spec.doctor.diagnose"
   local rc=0 doctor_log
   doctor_log="$(slime_spec_output_dir "${train_args[@]}")/doctor.txt"
   mkdir -p "$(dirname -- "$doctor_log")"
   PYTHONPATH="$pythonpath" "$py" -m slime_spec.doctor.diagnose "${train_args[@]}" > "$doctor_log" 2>&1 || rc=$?
   slime_spec_short_doctor_report "$doctor_log"
   if [ "$rc" = 2 ]; then
      echo "[slime-spec] doctor found errors (above): fix them before launching; nothing was started" >&2
      exit 2
   elif [ "$rc" != 0 ]; then
      echo "[slime-spec] the doctor itself failed (exit code $rc, PYTHON=$py); nothing was started" >&2
      exit "$rc"
   fi
   if [ "${DOCTOR_ONLY:-0}" = 1 ]; then
      echo "[slime-spec] DOCTOR_ONLY=1: configuration is clean; not launching"
      exit 0
   fi

   MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
   trap slime_spec_cleanup EXIT
   trap 'exit 130' INT
   trap 'exit 143' TERM

   if [ -n "${RAY_ADDRESS:-}" ]; then
      case "$RAY_ADDRESS" in
         http://*|https://*) RAY_DASHBOARD="${RAY_DASHBOARD:-$RAY_ADDRESS}" ;;
         *) local host="${RAY_ADDRESS#ray://}"; host="${host%:*}"
            RAY_DASHBOARD="${RAY_DASHBOARD:-http://${host}:8265}" ;;
      esac
      echo "[slime-spec] using the Ray cluster you gave, RAY_ADDRESS=$RAY_ADDRESS: jobs to $RAY_DASHBOARD" \
           "(this script will not stop it)"
   else
      slime_spec_start_head "$pythonpath" "$py"
   fi

   local runtime_env
   runtime_env=$(printf '{"env_vars": {"PYTHONUNBUFFERED": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_NVLS_ENABLE": "%s", "MASTER_ADDR": "%s", "PYTHONPATH": "%s"}}' \
      "${NCCL_NVLS_ENABLE:-0}" "$MASTER_ADDR" "$pythonpath")
   SLIME_SPEC_SUBMISSION_ID="${script_name}-$(date +%Y%m%d-%H%M%S)-$$"
   SLIME_SPEC_JOB_RUNNING=1
   rc=0
   # RAY_API_SERVER_ADDRESS: `ray job` prefers the RAY_ADDRESS environment variable over --address.
   RAY_API_SERVER_ADDRESS="$RAY_DASHBOARD" "${SLIME_SPEC_RAY[@]}" job submit --address "$RAY_DASHBOARD" \
      --submission-id "$SLIME_SPEC_SUBMISSION_ID" \
      --runtime-env-json "$runtime_env" \
      -- "$py" -m slime_spec.train "${train_args[@]}" || rc=$?
   SLIME_SPEC_JOB_RUNNING=0
   return "$rc"
}
