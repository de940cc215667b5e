"""Every engine command line we build (`EngineConfig.server_argv`, backend sglang) as SGLang 0.5.23 reads it.

The argvs come from each scripts/run-*.sh (the flags it hands the doctor, recorded by a stand-in
interpreter) and from the shared SGLANG_ARGS examples, then go through SGLang's own
`prepare_server_args` + `ServerArgs.resolve_once()` on a faked 8 x H100 node (sglang_node.py), against
stand-in checkpoints (config.json only; MiMo's ships its config class, as the real checkpoint does).
Each must resolve, with the tp/pp split, seed and GPU slot we meant.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime_spec.config.args import parse_config
from slime_spec.config.run_config import EngineConfig
from tests.test_args import sglang_args_of
from tests.test_scripts import CLEAN_RUNS, FAKE_DOCTOR, SCRIPTS, make_base_dir, script_env, write_executable

ROOT = Path(__file__).resolve().parents[2]

# MiMo's config class is not in transformers or SGLang: the checkpoint ships it (auto_map), like the real one.
MIMO_AUTO_MAP = {"AutoConfig": "configuration_mimo.MiMoConfig",
                 "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"}
MIMO_CONFIG_PY = '''from transformers.models.qwen2.configuration_qwen2 import Qwen2Config


class MiMoConfig(Qwen2Config):
    model_type = "mimo"

    def __init__(self, *args, num_nextn_predict_layers=0, **kwargs):
        self.num_nextn_predict_layers = num_nextn_predict_layers
        super().__init__(*args, **kwargs)
'''


def stand_in_checkpoints(base: Path) -> Path:
    make_base_dir(base)
    mimo = base / "MiMo-7B-RL"
    config = json.loads((mimo / "config.json").read_text())
    (mimo / "config.json").write_text(json.dumps({**config, "auto_map": MIMO_AUTO_MAP}))
    (mimo / "configuration_mimo.py").write_text(MIMO_CONFIG_PY)
    return base


def script_flags(name: str, base: Path, log: Path, env: dict) -> list[str]:
    fake = write_executable(log / "fake-python", FAKE_DOCTOR)
    proc = subprocess.run(["bash", str(SCRIPTS / name)],
                          env=script_env(base, PYTHON=str(fake), FAKE_LOG=str(log), **env),
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return (log / "doctor.args").read_text().splitlines()[2:]


def example_flags(example: str, base: Path, checkpoint: str) -> list[str]:
    tokens = [t.replace("/root/", f"{base}/") for t in sglang_args_of(example)]
    return ["--hf-checkpoint", str(base / checkpoint), "--rollout-backend", "sglang", *tokens]


def engine_launches(flags: list[str]) -> list[tuple[EngineConfig, int, list[str]]]:
    """(engine config, engine index, argv) for the first and the last engine of a configuration."""
    config, _ = parse_config(flags)
    gpus = config.engine.num_gpus_per_engine
    return [(config.engine, i, config.engine.server_argv("127.0.0.1", 30000 + i, base_gpu_id=i * gpus,
                                                         python="python3", engine_index=i))
            for i in sorted({0, config.num_engines - 1})]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    base = stand_in_checkpoints(tmp_path_factory.mktemp("base"))
    cases = {}
    for name, (env, _, _) in CLEAN_RUNS.items():
        cases[name] = script_flags(name, base, tmp_path_factory.mktemp(name.removesuffix(".sh")), env)
    cases["example eagle3"] = example_flags("sglang-args-eagle3-llama3.1-8B.sh", base, "Llama-3.1-8B-Instruct")
    cases["example native mtp"] = example_flags("sglang-args-native-mtp.sh", base, "MiMo-7B-RL")
    cases["example native mtp, pp 2"] = [*cases["example native mtp"], "--rollout-num-gpus", "8",
                                         "--rollout-num-gpus-per-engine", "4", "--sglang-pp-size", "2"]
    cases["example native mtp, adaptive"] = [*cases["example native mtp"], "--sglang-speculative-adaptive"]
    rows = [(case, *launch) for case, flags in cases.items() for launch in engine_launches(flags)]
    work = tmp_path_factory.mktemp("resolve")
    (work / "in.json").write_text(json.dumps([argv for *_, argv in rows]))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "tests.conformance.sglang_node", str(work / "in.json"),
                           str(work / "out.json")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    resolved = json.loads((work / "out.json").read_text())
    return [(case, engine, i, argv, out) for (case, engine, i, argv), out in zip(rows, resolved)]


def test_every_script_and_example_is_resolved(launches):
    cases = {case for case, *_ in launches}
    assert cases >= set(CLEAN_RUNS) | {"example eagle3", "example native mtp", "example native mtp, adaptive"}


def test_sglang_resolves_every_engine_argv(launches):
    failed = {f"{case} engine {i}": out["error"] for case, _, i, _, out in launches if "error" in out}
    assert failed == {}


def test_resolved_values_are_the_ones_we_meant(launches):
    for case, engine, i, argv, out in launches:
        if "error" in out:
            continue
        pp = int(engine.server_args.get("pp_size") or 1)
        assert (out["tp_size"], out["pp_size"]) == (engine.num_gpus_per_engine // pp, pp), case
        assert out["random_seed"] == engine.seed + i, case
        assert out["base_gpu_id"] == i * engine.num_gpus_per_engine, case
        assert out["trust_remote_code"] is True, case
        assert out["speculative_algorithm"] == engine.server_args.get("speculative_algorithm"), case
        assert out["model_path"] == engine.model_path and out["port"] == 30000 + i, case
        assert out["speculative_adaptive"] == bool(engine.server_args.get("speculative_adaptive")), case


def test_engines_get_distinct_seeds(launches):
    by_case = {}
    for case, _, _, _, out in launches:
        by_case.setdefault(case, []).append(out.get("random_seed"))
    multi = {case: seeds for case, seeds in by_case.items() if len(seeds) > 1}
    assert multi and all(len(set(seeds)) == len(seeds) for seeds in multi.values()), multi


def test_pp_size_that_does_not_divide_the_engine_gpus_is_refused():
    engine = EngineConfig(backend="sglang", model_path="m", num_gpus_per_engine=4,
                          forwarded_argv=("--pp-size", "3"), server_args={"pp_size": 3})
    with pytest.raises(ValueError, match=r"--rollout-num-gpus-per-engine 4 is not divisible by --sglang-pp-size 3"):
        engine.server_argv("127.0.0.1", 30000)
