"""The cluster scripts: their flags pass `slime-spec doctor` against stand-in config.json files with the
real models' shapes, a broken setting stops them with the doctor's message, and the launch steps start
(and stop) only what they own.

A doctor process costs ~9 s of CPU (SGLang's ServerArgs import), so each script's doctor flags are
recorded by a stand-in interpreter and checked by the real doctor in this process; one broken setting
goes through the real doctor end to end. The launch-flow tests use test doubles for `python` and `ray`.
"""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_args import sglang_args_of

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
RUN_SCRIPTS = sorted(SCRIPTS.glob("run-*.sh"))

# Stand-ins for the checkpoints' config.json: the real models' values (the doctor checks MODEL_ARGS
# against them), no weights.
LLAMA31_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="bfloat16",
                  num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, max_position_embeddings=131072, attention_bias=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
EAGLE3_DRAFT = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", torch_dtype="float16",
                    max_position_embeddings=2048, num_hidden_layers=1, hidden_size=4096, vocab_size=128256,
                    draft_vocab_size=32000)
MIMO_7B = dict(architectures=["MiMoForCausalLM"], model_type="mimo", torch_dtype="bfloat16",
               num_hidden_layers=36, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=151680, rope_theta=640000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=False, max_position_embeddings=32768, attention_bias=True,
               num_nextn_predict_layers=1)
GLM45 = dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", torch_dtype="bfloat16",
             num_hidden_layers=92, hidden_size=5120, intermediate_size=12288, num_attention_heads=96,
             num_key_value_heads=8, head_dim=128, vocab_size=151552, rope_theta=1000000.0, rms_norm_eps=1e-5,
             tie_word_embeddings=False, max_position_embeddings=131072, attention_bias=True,
             partial_rotary_factor=0.5, n_routed_experts=160, n_shared_experts=1, moe_intermediate_size=1536,
             num_experts_per_tok=8, first_k_dense_replace=3, routed_scaling_factor=2.5, use_qk_norm=True,
             num_nextn_predict_layers=1)
DEEPSEEK_V3 = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", torch_dtype="bfloat16",
                   num_hidden_layers=61, hidden_size=7168, intermediate_size=18432, num_attention_heads=128,
                   num_key_value_heads=128, vocab_size=129280, rope_theta=10000.0, rms_norm_eps=1e-6,
                   tie_word_embeddings=False, max_position_embeddings=163840, attention_bias=False,
                   q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   n_routed_experts=256, n_shared_experts=1, moe_intermediate_size=2048, num_experts_per_tok=8,
                   n_group=8, topk_group=4, first_k_dense_replace=3, routed_scaling_factor=2.5,
                   num_nextn_predict_layers=1,
                   rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096})

CHECKPOINTS = {"Llama-3.1-8B-Instruct": LLAMA31_8B, "sglang-EAGLE3-LLaMA3.1-Instruct-8B": EAGLE3_DRAFT,
               "MiMo-7B-RL": MIMO_7B, "GLM-4.5-355B-A32B": GLM45, "DeepSeek-V3": DEEPSEEK_V3}
PROMPTS = ["gsm8k/gsm8k-train.jsonl", "dapo-math-17k/dapo-math-17k.jsonl", "aime-2024/aime-2024.jsonl"]

# script -> (extra environment, expected engines, expected per-engine --tp-size)
CLEAN_RUNS = {
    "run-eagle3-llama3.1-8B.sh": ({}, 8, 1),  # trains the policy and, online, its EAGLE3 draft
    "run-mimo-7B-rl-mtp.sh": ({}, 8, 1),
    "run-glm4.5-mtp.sh": ({"DEBUG_ROLLOUT_ONLY": "1"}, 4, 8),
    "run-deepseek-v3-mtp.sh": ({"DEBUG_ROLLOUT_ONLY": "1"}, 8, 8),
}


def make_base_dir(base: Path) -> Path:
    for name, cfg in CHECKPOINTS.items():
        (base / name).mkdir(parents=True)
        (base / name / "config.json").write_text(json.dumps(cfg))
    for rel in PROMPTS:
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / rel).write_text(json.dumps({"prompt": "What is 2+3?", "label": "5"}) + "\n")
    return base


# The environment overrides of scripts/common.sh: a test run sets none it does not mean to.
OVERRIDES = ("DEBUG_ROLLOUT_ONLY", "EXTRA_ARGS", "WANDB_API_KEY", "SMALL_MACHINE", "HF_CHECKPOINT", "DRAFT_CHECKPOINT",
             "PROMPT_DATA", "EVAL_PROMPT_DATA", "CKPT_DIR", "OUTPUT_DIR", "ROLLOUT_BACKEND", "NUM_GPUS_PER_NODE", "TP",
             "NUM_ROLLOUT", "DOCTOR_ONLY", "PYTHON")


def script_env(base: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in OVERRIDES}
    env.update({"BASE_DIR": str(base), "PYTHON": sys.executable, "DOCTOR_ONLY": "1", "REAL_PY": sys.executable,
                "OUTPUT_DIR": str(base / "outputs"), **extra})
    return env


# Test double for the doctor's interpreter: records the argv a script hands to `python -m slime_spec.doctor.diagnose`;
# the script's own import check (`python -c ...`) goes to the real interpreter.
FAKE_DOCTOR = """#!/bin/bash
if [ "$1" = -c ]; then exec "$REAL_PY" "$@"; fi
printf '%s\\n' "$@" > "$FAKE_LOG/doctor.args"
exit "${FAKE_DOCTOR_RC:-0}"
"""


def write_executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def doctor_runs(tmp_path_factory):
    """Each script's doctor flags, checked by the real doctor in this process (SGLang's slow ServerArgs
    import is paid once), plus one broken setting through the real doctor end to end, as a user runs it."""
    base = make_base_dir(tmp_path_factory.mktemp("base"))
    # `--sglang-dtype auto` after the script's `float16`: the float16 draft meets the bfloat16 target.
    broken = subprocess.Popen(["bash", str(SCRIPTS / "run-eagle3-llama3.1-8B.sh")],
                              env=script_env(base, EXTRA_ARGS="--sglang-dtype auto",  # its own doctor.txt
                                             OUTPUT_DIR=str(base / "outputs-broken")), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    from slime_spec.doctor.diagnose import main as doctor_main
    runs = {}
    for name, (env, _, _) in CLEAN_RUNS.items():
        log = tmp_path_factory.mktemp(name.removesuffix(".sh"))
        fake = write_executable(log / "fake-python", FAKE_DOCTOR)
        proc = subprocess.run(["bash", str(SCRIPTS / name)], env=script_env(base, PYTHON=str(fake),
                              FAKE_LOG=str(log), **env), capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        assert "DOCTOR_ONLY=1: configuration is clean; not launching" in proc.stdout
        argv = (log / "doctor.args").read_text().splitlines()
        assert argv[:2] == ["-m", "slime_spec.doctor.diagnose"]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = doctor_main([*argv[2:], "--json"])
        runs[name] = (rc, json.loads(out.getvalue()), argv[2:])
    runs["broken"] = (broken.wait(timeout=300), broken.stdout.read(), None)
    return runs


# SMALL_MACHINE=1 on a tiny MiMo: every script that needs no external draft model (EAGLE3 needs DRAFT_CHECKPOINT).
SMALL_RUNS = ("run-mimo-7B-rl-mtp.sh", "run-glm4.5-mtp.sh", "run-deepseek-v3-mtp.sh")


@pytest.fixture(scope="module")
def small_machine_runs(tmp_path_factory):
    """Each script's flags under SMALL_MACHINE=1 with a tiny model, checked by the real doctor in this process."""
    from slime_spec.doctor.diagnose import main as doctor_main
    from slime_spec.tools.tiny_model import make_tiny_model
    base = tmp_path_factory.mktemp("small")
    model = make_tiny_model(base / "tiny-mimo", arch="mimo", mtp_layers=1, hidden_size=32, num_layers=1,
                            intermediate_size=64, max_position_embeddings=128)
    (base / "prompts.jsonl").write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    runs = {}
    for name in SMALL_RUNS:
        log = tmp_path_factory.mktemp(name.removesuffix(".sh"))
        fake = write_executable(log / "fake-python", FAKE_DOCTOR)
        env = script_env(base, PYTHON=str(fake), FAKE_LOG=str(log), SMALL_MACHINE="1", HF_CHECKPOINT=str(model),
                         PROMPT_DATA=str(base / "prompts.jsonl"), EVAL_PROMPT_DATA=str(base / "prompts.jsonl"))
        proc = subprocess.run(["bash", str(SCRIPTS / name)], env=env, capture_output=True, text=True, timeout=60,
                              cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        argv = (log / "doctor.args").read_text().splitlines()[2:]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = doctor_main([*argv, "--json"])
        runs[name] = (rc, json.loads(out.getvalue()), argv)
    return runs


def last(flags: list[str], flag: str) -> str:
    return flags[len(flags) - 1 - flags[::-1].index(flag) + 1]


@pytest.mark.parametrize("name", SMALL_RUNS)
def test_small_machine_runs_every_script_on_a_tiny_model(small_machine_runs, name):
    rc, report, flags = small_machine_runs[name]
    problems = [f for f in report["findings"] if f["level"] != "info"]
    assert rc == 0 and problems == [], problems
    assert {e["backend"] for e in report["engines"]} == {"embedded"} and len(report["engines"]) == 1
    assert last(flags, "--tensor-model-parallel-size") == "1" and last(flags, "--rollout-num-gpus") == "0"
    assert last(flags, "--num-rollout") == "2" and last(flags, "--hf-checkpoint").endswith("tiny-mimo")
    for gpu_only in ("--sglang-attention-backend", "--sglang-cuda-graph-bs-decode", "--sglang-enable-memory-saver",
                     "--sequence-parallel", "--num-layers", "--hidden-size"):
        assert gpu_only not in flags, gpu_only
    assert "--sglang-speculative-algorithm" in flags  # speculative rollout stays on


def test_every_run_script_is_covered():
    assert sorted(p.name for p in RUN_SCRIPTS) == sorted(CLEAN_RUNS)


@pytest.mark.parametrize("name", sorted(CLEAN_RUNS))
def test_script_passes_doctor_with_no_error_or_warning(doctor_runs, name):
    rc, report, flags = doctor_runs[name]
    problems = [f for f in report["findings"] if f["level"] != "info"]
    assert rc == 0 and problems == [], problems
    _, n_engines, tp = CLEAN_RUNS[name]
    engines = report["engines"]
    assert len(engines) == n_engines and {e["backend"] for e in engines} == {"sglang"}
    argv = engines[0]["argv"]
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert argv[argv.index("--tp-size") + 1] == str(tp)
    assert "--speculative-algorithm" in argv and "--cuda-graph-bs-decode" in argv
    assert flags.count("--rollout-backend") == 1 and flags[flags.index("--rollout-backend") + 1] == "sglang"
    assert ("--debug-rollout-only" in flags) == ("DEBUG_ROLLOUT_ONLY" in CLEAN_RUNS[name][0])


def test_eagle3_script_forwards_the_example_sglang_args(doctor_runs):
    _, report, flags = doctor_runs["run-eagle3-llama3.1-8B.sh"]
    base = flags[flags.index("--hf-checkpoint") + 1].rsplit("/", 1)[0]
    example = [t.replace("/root/", base + "/") for t in sglang_args_of("sglang-args-eagle3-llama3.1-8B.sh")]
    start = flags.index(example[0])
    assert flags[start:start + len(example)] == example  # the example's SGLANG_ARGS, verbatim and in order
    argv = report["engines"][0]["argv"]
    text = " ".join(argv)
    for part in ("--speculative-algorithm EAGLE3", "--speculative-num-steps 5", "--speculative-eagle-topk 8",
                 "--speculative-num-draft-tokens 32", "--max-running-requests 48", "--dtype float16",
                 "--context-length 2048", "--attention-backend fa3", "--mem-fraction-static 0.8"):
        assert part in text
    assert argv[argv.index("--speculative-draft-model-path") + 1].endswith("/sglang-EAGLE3-LLaMA3.1-Instruct-8B")


def test_broken_setting_stops_with_the_doctors_message(doctor_runs):
    rc, out, _ = doctor_runs["broken"]
    assert rc == 2, out
    assert "[ERROR  ] SPEC_DTYPE_MISMATCH: the draft model is float16 but the target is bfloat16" in out
    assert "fix: --sglang-dtype float16" in out
    assert "doctor found errors (above)" in out and "DOCTOR_ONLY" not in out


def test_no_script_kills_by_name():
    for path in SCRIPTS.rglob("*.sh"):
        assert not re.search(r"\b(pkill|killall)\b", path.read_text()), path


# ---------------------------------------------------------------- launch flow, with test doubles

# A stand-in `ray`: logs each call; `start --head --block` listens on the GCS, dashboard and dashboard agent ports
# until it is killed (as the real head does); `job submit` records the entrypoint and can interrupt the script.
FAKE_RAY = """#!/bin/bash
echo "$*" >> "$FAKE_LOG/ray.calls"
case "$1 $2" in
  "start --head")
    while [ -n "$1" ]; do
      case "$1" in --port) gcs=$2 ;; --dashboard-port) dash=$2 ;; --dashboard-agent-listen-port) agent=$2 ;; esac
      shift
    done
    exec "$REAL_PY" -c "
import socket, sys, time
socks = []
for port in sys.argv[1:]:
    s = socket.socket(); s.bind(('127.0.0.1', int(port))); s.listen(); socks.append(s)
open(sys.argv[0] if False else '$FAKE_LOG/head.pid', 'w').write(str(__import__('os').getpid()))
time.sleep(600)
" "$gcs" "$dash" "$agent" ;;
  "job submit")
    while [ "$1" != "--" ]; do shift; done; shift
    printf '%s\\n' "$@" > "$FAKE_LOG/entrypoint.args"
    if [ -n "$FAKE_INTERRUPT" ]; then kill -TERM "$PPID"; fi
    exit "${FAKE_JOB_RC:-0}" ;;
esac
exit 0
"""


@pytest.fixture
def fakes(tmp_path):
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    for name, text in (("fake-doctor-python", FAKE_DOCTOR), ("ray", FAKE_RAY)):
        write_executable(bin_dir / name, text)
    return bin_dir, log


def launch(fakes, tmp_path, ray_address: str | None = None, **env):
    """Run the MiMo script with the stand-ins; the `ray` beside PYTHON is the one the script uses."""
    bin_dir, log = fakes
    full = script_env(tmp_path, PYTHON=str(bin_dir / "fake-doctor-python"), FAKE_LOG=str(log),
                      RAY_ADDRESS=ray_address, RAY_DASHBOARD=None,
                      RAY_TEMP_DIR=str(tmp_path / "ray"), RAY_AUTH_MODE="disabled")
    full.pop("DOCTOR_ONLY")
    full.update(env)
    full = {k: v for k, v in full.items() if v is not None}
    proc = subprocess.run(["bash", str(SCRIPTS / "run-mimo-7B-rl-mtp.sh")], env=full, capture_output=True,
                          text=True, timeout=60)
    calls = (log / "ray.calls").read_text().splitlines() if (log / "ray.calls").exists() else []
    return proc, calls, log


def runtime_env_of(submit_call: str) -> dict:
    """The --runtime-env-json value of a logged `ray job submit` call (the JSON holds spaces)."""
    tokens = submit_call.split()
    i = tokens.index("--runtime-env-json") + 1
    return json.loads(" ".join(tokens[i:tokens.index("--", i)]))


def head_gone(log: Path) -> bool:
    pid = int((log / "head.pid").read_text())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_starts_a_head_only_without_ray_address_and_stops_only_that(fakes, tmp_path):
    proc, calls, log = launch(fakes, tmp_path, DEBUG_ROLLOUT_ONLY="1")
    assert proc.returncode == 0, proc.stderr
    assert [c.split()[0:3] for c in calls] == [["start", "--head", "--block"], ["job", "submit", "--address"]]
    assert not any(c.split()[0] == "stop" for c in calls)  # never `ray stop`: it stops other clusters too
    assert head_gone(log)  # ... the head's own process group was stopped instead
    doctor_args = (log / "doctor.args").read_text().splitlines()
    entry = (log / "entrypoint.args").read_text().splitlines()
    assert doctor_args[:2] == ["-m", "slime_spec.doctor.diagnose"] and entry[1:3] == ["-m", "slime_spec.train"]
    assert entry[0] == str(fakes[0] / "fake-doctor-python")  # the job runs PYTHON, not whatever python3 is
    assert doctor_args[2:] == entry[3:]  # the job gets exactly the flags the doctor checked
    assert "--debug-rollout-only" in entry and "--rollout-backend" in entry
    env_vars = runtime_env_of(calls[1])["env_vars"]
    assert env_vars["NCCL_NVLS_ENABLE"] == "0" and env_vars["PYTHONPATH"].split(":")[0] == str(ROOT)
    start = calls[0].split()
    assert start[start.index("--temp-dir") + 1] == str(tmp_path / "ray")
    # every service of the head on a port chosen free, none on Ray's defaults (another Ray may hold them)
    flags = ("--port", "--dashboard-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
             "--metrics-export-port", "--ray-client-server-port", "--node-manager-port", "--object-manager-port",
             "--runtime-env-agent-port")
    ports = [int(start[start.index(f) + 1]) for f in flags]
    assert len(set(ports)) == len(flags) and not set(ports) & {6379, 8265, 52365, 10001}
    # ... and the job goes to that head's job server
    submit = calls[1].split()
    assert submit[submit.index("--address") + 1] == f"http://127.0.0.1:{ports[1]}"


def test_token_auth_gets_a_token_for_a_head_it_starts(fakes, tmp_path):
    proc, calls, _ = launch(fakes, tmp_path, RAY_AUTH_MODE=None,
                            RAY_AUTH_TOKEN=None, RAY_AUTH_TOKEN_PATH=None)
    assert proc.returncode == 0, proc.stderr
    assert [c.split()[0:2] for c in calls] == [["get-auth-token", "--generate"], ["start", "--head"],
                                              ["job", "submit"]]
    assert "RAY_AUTH_MODE=token" in proc.stdout


@pytest.mark.parametrize("given, dashboard", [("10.0.0.7:6380", "http://10.0.0.7:8265"),
                                              ("http://10.0.0.7:8266", "http://10.0.0.7:8266")])
def test_submits_to_the_cluster_ray_address_names_and_starts_nothing(fakes, tmp_path, given, dashboard):
    """RAY_ADDRESS is the user's cluster (a GCS address, or a job server address as `ray job` reads it): the job
    goes there, no head starts, and no port is probed to decide it (nothing listens at either address here)."""
    proc, calls, log = launch(fakes, tmp_path, given)
    assert proc.returncode == 0, proc.stderr
    assert [c.split()[0:2] for c in calls] == [["job", "submit"]]
    submit = calls[0].split()
    assert submit[submit.index("--address") + 1] == dashboard
    assert "--debug-rollout-only" not in (log / "entrypoint.args").read_text().splitlines()


def test_doctor_error_starts_nothing(fakes, tmp_path):
    proc, calls, _ = launch(fakes, tmp_path, FAKE_DOCTOR_RC="2")
    assert proc.returncode == 2 and calls == []
    assert "doctor found errors" in proc.stderr


def test_interrupted_job_is_stopped_by_its_id_then_the_head(fakes, tmp_path):
    proc, calls, log = launch(fakes, tmp_path, FAKE_INTERRUPT="1")
    assert proc.returncode == 143
    submit_id = calls[1].split()[calls[1].split().index("--submission-id") + 1]
    assert submit_id.startswith("run-mimo-7B-rl-mtp-")
    assert [c.split()[0:2] for c in calls[2:]] == [["job", "stop"]]
    assert calls[2].split()[-1] == submit_id
    assert head_gone(log) and "stopping the Ray head this script started" in proc.stderr


def test_failed_job_returns_its_exit_code_and_cleans_up(fakes, tmp_path):
    proc, calls, log = launch(fakes, tmp_path, FAKE_JOB_RC="3")
    assert proc.returncode == 3
    assert [c.split()[0:2] for c in calls] == [["start", "--head"], ["job", "submit"]]
    assert head_gone(log)


def test_an_interpreter_without_slime_spec_is_named_not_a_traceback(tmp_path):
    missing = write_executable(tmp_path / "bare-python", "#!/bin/bash\necho torch ray\n")  # answers the check
    for python, expected in ((str(missing), "cannot import: torch ray"), ("no-such-python", "no such interpreter")):
        proc = subprocess.run(["bash", str(SCRIPTS / "run-mimo-7B-rl-mtp.sh")],
                              env=script_env(tmp_path, PYTHON=python), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and expected in proc.stderr and "PYTHON=" in proc.stderr
        assert "Traceback" not in proc.stderr + proc.stdout


def test_no_script_runs_ray_stop():
    for path in SCRIPTS.rglob("*.sh"):
        code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        assert not re.search(r"\bray\b[^\n]*\bstop\b(?! --address)", code.replace("job stop", "")), path


# ---------------------------------------------------------------- docs that mirror the code

DOCS = ROOT / "docs"


# The speculative guide's doctor-code tables are checked against slime_spec/doctor/codes.py in tests/test_spec.py.


def heading_anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_docs_relative_links_resolve(lang):
    pages = sorted((DOCS / lang).rglob("*.md"))
    assert {p.name for p in pages} >= {"index.md", "quickstart.md", "usage.md", "speculative.md", "weight-sync.md",
                                      "debugging.md", "architecture.md"}
    for page in pages:
        for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).resolve().is_file(), f"{page}: broken link {target}"
            for anchor in re.findall(rf"\]\({re.escape(target)}#([^)]+)\)", page.read_text()):
                assert anchor in heading_anchors(page.parent / target), f"{page}: no #{anchor} in {target}"


@pytest.mark.parametrize("script", ["run-deepseek-v3-mtp.sh", "run-glm4.5-mtp.sh"])
def test_training_the_scripts_layout_passes_the_doctor(doctor_runs, script):
    """Without DEBUG_ROLLOUT_ONLY the script's whole layout is one the trainer builds: TP 8 x EP with whole experts
    over 4 pipeline stages, the last sized by --decoder-last-pipeline-num-layers."""
    from slime_spec.config.args import parse
    from slime_spec.doctor.diagnose import diagnose
    _, _, flags = doctor_runs[script]
    assert last(flags, "--pipeline-model-parallel-size") == "4"
    _, findings = diagnose(parse([f for f in flags if f != "--debug-rollout-only"]))
    assert [f for f in findings if f.level == "error"] == []


def test_eagle3_script_trains_the_draft_online(doctor_runs):
    _, _, flags = doctor_runs["run-eagle3-llama3.1-8B.sh"]
    assert "--debug-rollout-only" not in flags and "--enable-draft-training" in flags
    assert last(flags, "--draft-ttt-steps") == "7" and last(flags, "--draft-lr") == "5e-5"
