"""SGLang 0.5.23's own model classes and WeightChecker on CPU, in a process of their own.

Run as `python -m tests.conformance.sglang_models IN.json OUT.pt`. IN holds a list of jobs
`{"arch": "mimo" | "llama" | "qwen2" | "qwen3" | "qwen3_moe" | "deepseek_v3" | "glm4_moe", "weights": PATH.safetensors,
"config": PATH.json, "dtype": "bfloat16", "eagle3_weights": ..., "eagle3_config": ...}`. For each job this builds the
target runner's model (`MiMoForCausalLM`, `LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`,
`Qwen3MoeForCausalLM`, `DeepseekV3ForCausalLM`, `Glm4MoeForCausalLM`) and the draft runner's (`MiMoMTP` for MiMo,
`DeepseekV3ForCausalLMNextN` / `Glm4MoeForCausalLMNextN` for a DeepSeek-V3 / GLM-4.5 with MTP layers; the EAGLE3
draft `LlamaForCausalLMEagle3` when given) the way SGLang's runners do (default dtype set to the engine's, the
quantization config its loader builds from the config's `quantization_config` (Fp8Config for DeepSeek-V3's FP8), the
draft sharing the target's embedding and lm_head as the EAGLE worker's `init_lm_head` does), loads the weights through
each model's own `load_weights`, and answers `/weights_checker {"action": "checksum"}` as the scheduler does:
`WeightChecker.handle` per runner, merged by `_merge_checksum_payloads`. OUT gets, per job, that merged payload and
every parameter and buffer of each runner (SGLang's names and values).

Test doubles: a one-rank gloo process group stands in for the GPU's; `vllm` (a fallback rotary kernel that
SGLang picks on a device it does not know, never called here: nothing runs a forward) is an absent module;
`torch.cuda.synchronize` is a no-op while DeepSeek-V3's / GLM-4.5's `set_embed_and_head` runs (it calls it directly).
It runs in its own process because SGLang keeps the parallel state and platform in process globals.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.conformance import sglang_doubles


def _setup(model_path: str) -> None:
    """Publish a CPU ServerArgs and build SGLang's one-rank parallel groups, as the scheduler process does."""
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    from slime_spec.common.net import free_port
    server_args = ServerArgs(model_path=model_path, device="cpu")
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    initialize_model_parallel()
    initialize_dp_attention(server_args=server_args)


def _hf_config(arch: str, config: dict):
    from transformers import (
        DeepseekV3Config,
        Glm4MoeConfig,
        Glm4MoeLiteConfig,
        LlamaConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    # MiMo has no config class in transformers or SGLang (it needs --trust-remote-code): its config is Qwen2's
    # plus num_nextn_predict_layers, which a Qwen2Config keeps as an extra attribute.
    cls = LlamaConfig if arch == "llama" or config.get("architectures") == ["LlamaForCausalLMEagle3"] else Qwen2Config
    cls = {"qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig, "deepseek_v3": DeepseekV3Config,
           "glm4_moe": Glm4MoeConfig, "glm4_moe_lite": Glm4MoeLiteConfig}.get(arch, cls)
    return cls(**{k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")})


def _build(cls, hf_config, dtype, quant_config=None):
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    with set_default_torch_dtype(dtype):
        return cls(hf_config) if quant_config is None else cls(hf_config, quant_config=quant_config)


def _quant_config(config: dict):
    """SGLang's quantization config of a checkpoint whose config.json has a `quantization_config` (Fp8Config for
    `quant_method: fp8`, as its model loader builds it), or None."""
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    from sglang.srt.layers.quantization import get_quantization_config

    return get_quantization_config(quantization["quant_method"]).from_config(quantization)


def _without_cuda_synchronize():
    """DeepSeek-V2/V3's and GLM-4.5's `set_embed_and_head` end with `torch.cuda.synchronize()` (MiMoMTP's with the
    platform's own), which raises on a torch built without CUDA; a device barrier, it changes no value, so it is a
    no-op here where no CUDA device exists."""
    from unittest import mock

    import torch

    if torch.cuda.is_available():
        return mock.patch.object(torch.cuda, "synchronize", torch.cuda.synchronize)
    return mock.patch.object(torch.cuda, "synchronize", lambda *args, **kwargs: None)


def run_job(job: dict) -> dict:
    import torch
    from safetensors.torch import load_file
    from sglang.srt.managers.scheduler_components.weight_updater import _merge_checksum_payloads
    from sglang.srt.models.deepseek_nextn import DeepseekV3ForCausalLMNextN
    from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM
    from sglang.srt.models.glm4_moe import Glm4MoeForCausalLM
    from sglang.srt.models.glm4_moe_lite import Glm4MoeLiteForCausalLM
    from sglang.srt.models.glm4_moe_lite_nextn import Glm4MoeLiteForCausalLMNextN
    from sglang.srt.models.glm4_moe_nextn import Glm4MoeForCausalLMNextN
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from sglang.srt.models.mimo import MiMoForCausalLM
    from sglang.srt.models.mimo_mtp import MiMoMTP
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM
    from sglang.srt.utils.weight_checker import WeightChecker

    dtype = getattr(torch, job["dtype"])
    config = json.loads(Path(job["config"]).read_text())
    weights = list(load_file(job["weights"]).items())
    target_cls = {"mimo": MiMoForCausalLM, "llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM,
                  "qwen3": Qwen3ForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM,
                  "deepseek_v3": DeepseekV3ForCausalLM, "glm4_moe": Glm4MoeForCausalLM,
                  "glm4_moe_lite": Glm4MoeLiteForCausalLM}[job["arch"]]
    quant_config = _quant_config(config)
    runners = {"target": _build(target_cls, _hf_config(job["arch"], config), dtype, quant_config)}
    runners["target"].load_weights(weights)
    embed, head = runners["target"].get_embed_and_head()
    draft_cls = {"mimo": MiMoMTP, "deepseek_v3": DeepseekV3ForCausalLMNextN,
                 "glm4_moe": Glm4MoeForCausalLMNextN, "glm4_moe_lite": Glm4MoeLiteForCausalLMNextN}.get(job["arch"])
    if draft_cls is not None and config.get("num_nextn_predict_layers"):
        draft = _build(draft_cls, _hf_config(job["arch"], config), dtype, quant_config)
        draft.load_weights(weights)
        with _without_cuda_synchronize():
            draft.set_embed_and_head(embed, head)  # eagle_worker_v2.init_lm_head (not EAGLE3)
        runners["draft"] = draft
    if job.get("eagle3_config"):
        draft_config = json.loads(Path(job["eagle3_config"]).read_text())
        draft = _build(LlamaForCausalLMEagle3, _hf_config("llama", draft_config), dtype)
        draft.load_weights(list(load_file(job["eagle3_weights"]).items()))
        draft.set_embed(embed)  # init_lm_head, EAGLE3 without load_lm_head_from_target
        runners["draft"] = draft
    payloads = [(role, WeightChecker(get_model=lambda m=model: m).handle("checksum", role=role))
                for role, model in runners.items()]
    state = {role: {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
             for role, model in runners.items()}
    return {"payload": _merge_checksum_payloads(payloads), "state": state}


def answers_in_own_process(jobs: list[dict], workdir: Path) -> list[dict]:
    """Run this module on `jobs` in a fresh process (IN/OUT files kept in `workdir`); its answer per job, in order."""
    import torch

    root = Path(__file__).resolve().parents[2]
    (workdir / "in.json").write_text(json.dumps(jobs))
    proc = subprocess.run([sys.executable, "-m", "tests.conformance.sglang_models", str(workdir / "in.json"),
                           str(workdir / "out.pt")], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(workdir / "out.pt")


def main(argv: list[str]) -> int:
    sglang_doubles.install()
    sys.meta_path.insert(0, sglang_doubles.AbsentModuleFinder({"vllm"}))
    import torch

    from slime_spec.tools.tiny_model import make_tiny_model
    jobs = json.loads(Path(argv[0]).read_text())
    with tempfile.TemporaryDirectory() as tmp:  # any model SGLang's ServerArgs can resolve, for the parallel state
        _setup(str(make_tiny_model(Path(tmp) / "llama", arch="llama")))
        torch.save([run_job(job) for job in jobs], argv[1])
    return 0


SKIPPED_BY_SGLANG = ("cos_sin_cache",)  # rotary caches: derived, never hashed (engine/weights/checker.py)


def assert_served_equals_sglang(case: dict, layouts: dict) -> None:
    """Every tensor SGLang's runners hold (`case["state"][role]`) equals our model of the served layout of what was
    sent (`sglang_params.served_tensors`), name for name, dtype and bits."""
    import torch

    from slime_spec.weight_sync.verify.sglang_params import served_tensors
    for role, layout in layouts.items():
        theirs = {n: t for n, t in case["state"][role].items() if not n.endswith(SKIPPED_BY_SGLANG)}
        mine = served_tensors(case["sent"], layout)
        assert sorted(mine) == sorted(theirs), role
        for name, tensor in theirs.items():
            assert mine[name].dtype == tensor.dtype and torch.equal(mine[name], tensor), f"{role}:{name}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
