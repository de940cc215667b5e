"""Our weight checksums against SGLang 0.5.23's own model classes and WeightChecker.

SGLang's `MiMoForCausalLM` with its `MiMoMTP` draft, `LlamaForCausalLM` with an EAGLE3 draft
(`LlamaForCausalLMEagle3`), `Qwen2ForCausalLM` (tied embedding) and `Qwen3MoeForCausalLM` (routed experts in
FusedMoE's stacked `w13_weight` / `w2_weight`) are built on CPU in a process of their own
(sglang_models.py), load what our weight sync sends (Megatron tensors through convert.megatron_to_hf) with their
own `load_weights`, and answer `/weights_checker {"action": "checksum"}` with SGLang's WeightChecker. Three
computations of the same weights must agree in every name and every checksum, and the tensors by value:

- SGLang's model classes (the reference);
- the trainer side (`sglang_params.ServedChecksums`, what --check-weight-sync and push-weights --check compare);
- the embedded engine (`engine.weight_checker.check_weights` over `EngineCore.named_weights`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slime_spec.weight_sync import convert
from slime_spec.weight_sync.verify.sglang_params import RunnerLayout, ServedChecksums, served_tensors
from tests.conformance.sglang_models import answers_in_own_process, assert_served_equals_sglang

ARCHS = ["mimo", "llama", "qwen2", "qwen3_moe"]


def sync_sends(checkpoint: Path, family: str) -> list[tuple[str, torch.Tensor]]:
    """What the weight sync sends for a checkpoint: its Megatron form, converted back to HF names, in order."""
    config = json.loads((checkpoint / "config.json").read_text())
    megatron = convert.hf_to_megatron(family, load_file(str(checkpoint / "model.safetensors")), config)
    return [pair for name, t in megatron.items() for pair in convert.megatron_to_hf(family, name, t, config)]


def perturbed(named: list[tuple[str, torch.Tensor]], seed: int) -> list[tuple[str, torch.Tensor]]:
    """New weights (a training step's worth of change), so the check cannot pass on the checkpoint's values."""
    gen = torch.Generator().manual_seed(seed)
    return [(n, t + 0.01 * torch.randn(t.shape, generator=gen)) for n, t in named]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Per case: the sent tensors and SGLang's answer (merged checksum payload, each runner's state)."""
    from safetensors.torch import save_file

    from slime_spec.tools.tiny_model import make_tiny_eagle3_draft, make_tiny_model
    tmp = tmp_path_factory.mktemp("sglang_models")
    made = {"mimo": (make_tiny_model(tmp / "mimo", arch="mimo", vocab_size=100), "bfloat16"),
            "llama": (make_tiny_model(tmp / "llama", arch="llama", num_layers=4), "float32"),
            "qwen2": (make_tiny_model(tmp / "qwen2", arch="qwen2"), "float16"),
            "qwen3_moe": (make_tiny_model(tmp / "qwen3_moe", arch="qwen3_moe", num_experts=4, num_experts_per_tok=2),
                          "bfloat16")}
    eagle3 = make_tiny_eagle3_draft(tmp / "eagle3", made["llama"][0])
    jobs, out = [], {}
    for i, (arch, (path, dtype)) in enumerate(made.items()):
        sent = perturbed(sync_sends(path, arch), seed=i)
        save_file({n: t.contiguous() for n, t in sent}, str(tmp / f"{arch}.sent.safetensors"))
        job = dict(arch=arch, weights=str(tmp / f"{arch}.sent.safetensors"), config=str(path / "config.json"),
                   dtype=dtype)
        if arch == "llama":
            job.update(eagle3_weights=str(eagle3 / "model.safetensors"), eagle3_config=str(eagle3 / "config.json"))
        jobs.append(job)
        out[arch] = {"sent": sent, "config": json.loads((path / "config.json").read_text()),
                     "dtype": getattr(torch, dtype), "path": path}
    out["llama"]["eagle3"] = list(load_file(str(eagle3 / "model.safetensors")).items())
    out["llama"]["eagle3_path"] = eagle3
    for arch, answer in zip(made, answers_in_own_process(jobs, tmp)):
        out[arch].update(answer)
    return out


def layouts(case: dict) -> dict[str, RunnerLayout]:
    config, dtype = case["config"], case["dtype"]
    roles = {"target": RunnerLayout.target(config, dtype)}
    if config.get("num_nextn_predict_layers"):
        roles["draft"] = RunnerLayout.mtp_draft(config, dtype)
    return roles


def ours(case: dict) -> dict[str, dict[str, str]]:
    """The trainer side's checksums, streamed as a sync streams (SGLang's `role.` key prefix added back)."""
    recorder = ServedChecksums(layouts(case))
    for name, tensor in case["sent"]:
        recorder.add(name, tensor)
    if "eagle3" in case:
        draft_tensors = case["eagle3"]
        eagle3 = ServedChecksums({"draft": RunnerLayout.eagle3_draft(case["dtype"])})
        for name, tensor in [("model.embed_tokens.weight", dict(case["sent"])["model.embed_tokens.weight"]),
                             *draft_tensors]:
            eagle3.add(name, tensor)
        recorder.checksums["draft"] = eagle3.checksums["draft"]
    assert not recorder.incomplete()
    return recorder.payload_keys()


@pytest.mark.parametrize("arch", ARCHS)
def test_trainer_checksums_equal_sglang_weight_checker(cases, arch):
    case = cases[arch]
    theirs = case["payload"]["checksums"]
    mine = ours(case)
    assert sorted(mine) == sorted(theirs)
    assert {n: (mine[n], theirs[n]) for n in theirs if mine[n] != theirs[n]} == {}
    roles = {info["role"] for info in case["payload"]["parallelism_info"]}
    assert roles == ({"target", "draft"} if arch in ("mimo", "llama") else {"target"})


@pytest.mark.parametrize("arch", ARCHS)
def test_served_tensors_equal_sglang_parameters_by_value(cases, arch):
    """Not only the hashes: every tensor SGLang's model holds equals ours, name for name, bit for bit."""
    case = cases[arch]
    assert_served_equals_sglang(case, layouts(case))


def test_sglang_pads_the_vocabulary_with_zero_rows(cases):
    """The padding our checksums reproduce: MiMo's vocabulary of 100 is served as 128 rows, the last 28 zero."""
    embed = cases["mimo"]["state"]["target"]["model.embed_tokens.weight"]
    assert embed.shape[0] == 128 and not embed[100:].any() and embed[:100].any()
    # the draft runner serves the target's embedding and lm_head (set_embed_and_head): same checksums
    checksums = cases["mimo"]["payload"]["checksums"]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert checksums[f"draft.{name}"] == checksums[name]


@pytest.mark.parametrize("arch", ARCHS)
def test_embedded_engine_checksums_equal_sglang_weight_checker(cases, arch):
    """The embedded engine, after loading the same tensors, answers what SGLang's scheduler answers: the same
    merged payload (checksums, per-GPU checksum, one parallelism entry per runner)."""
    from slime_spec.engine.managers.engine_core import EngineCore
    from slime_spec.engine.weights.checker import check_weights
    from slime_spec.speculative.settings import SpecConfig
    case = cases[arch]
    spec = {"mimo": SpecConfig("EAGLE", 2, 1, 3), "llama": SpecConfig("EAGLE3", 2, 1, 3, str(case.get("eagle3_path"))),
            "qwen2": None, "qwen3_moe": None}[arch]
    core = EngineCore(str(case["path"]), spec, dtype=str(case["dtype"]).removeprefix("torch."), max_running_requests=1)
    core.load_weights(case["sent"], selector="target" if arch == "llama" else "all")
    assert check_weights(core, {"action": "checksum", "selector": "all"}) == case["payload"]


def test_embedded_engine_selector_and_skip_list(cases):
    from slime_spec.engine.managers.engine_core import EngineCore
    from slime_spec.engine.weights.checker import check_weights
    from slime_spec.speculative.settings import SpecConfig
    case = cases["mimo"]
    core = EngineCore(str(case["path"]), SpecConfig("EAGLE", 2, 1, 3), dtype="bfloat16", max_running_requests=1)
    core.load_weights(case["sent"], selector="all")
    theirs = case["payload"]["checksums"]
    draft = check_weights(core, {"selector": "draft"})
    assert draft["checksums"] == {k: c for k, c in theirs.items() if k.startswith("draft.")}
    skipped = check_weights(core, {"selector": "target", "skip_tensor_list": ["mlp."]})
    assert skipped["checksums"] == {k: c for k, c in theirs.items() if "draft." not in k and "mlp." not in k}
    with pytest.raises(ValueError, match="invalid selector"):
        check_weights(core, {"selector": "drafts"})
    for action in ("reset_tensors", "names"):
        with pytest.raises(ValueError, match="Unsupported action"):
            check_weights(core, {"action": action})


def test_embedded_engine_with_fused_projections_checks_without_copying(cases):
    """On CUDA the engine keeps q/k/v and gate/up as views of fused tensors: the same checksums, and the served
    `qkv_proj` is that fused tensor itself, not a copy (fused here on CPU, as the CUDA engine fuses)."""
    from slime_spec.engine.managers.engine_core import EngineCore
    from slime_spec.engine.weights.checker import check_weights
    from slime_spec.weight_sync.verify.sglang_params import served_tensors
    case = cases["qwen2"]
    core = EngineCore(str(case["path"]), None, dtype="float16", max_running_requests=1)
    core.load_weights(case["sent"])
    core.model.fuse_projections()
    assert check_weights(core, {"selector": "target"}) == case["payload"]
    served = served_tensors(core.named_weights("target").items(), RunnerLayout.target(case["config"], None))
    assert served["model.layers.0.self_attn.qkv_proj.weight"].data_ptr() == \
        core.model.model.layers[0].self_attn.qkv[0].data_ptr()



@pytest.mark.parametrize("arch", ARCHS)
def test_sync_coverage_of_sglang_served_names(cases, arch):
    """The coverage check (verify.check_coverage) over the names SGLang's target runner serves: what the sync sent
    writes every one (Qwen3-MoE's stacked experts included), and a left-out expert tensor is reported."""
    from slime_spec.weight_sync.verify import coverage as verify
    case = cases[arch]
    served = {"target": {n: c for n, c in case["payload"]["checksums"].items() if not n.startswith("draft.")}}
    sent = {n for n, _ in case["sent"]}
    assert verify.check_coverage(served, sent, {"target"}).ok
    if arch == "qwen3_moe":
        coverage = verify.check_coverage(served, sent - {"model.layers.1.mlp.experts.2.up_proj.weight"}, {"target"})
        assert coverage.missing["target"] == ["model.layers.1.mlp.experts.w13_weight"]


def test_an_expert_the_layout_has_no_place_for_is_refused():
    """An expert's tensor for a runner built without (enough) experts raises rather than hashing a wrong tensor."""
    expert = [("model.layers.0.mlp.experts.2.up_proj.weight", torch.zeros(4, 8))]
    for layout in (RunnerLayout("causal_lm"), RunnerLayout("causal_lm", num_experts=2)):
        with pytest.raises(ValueError, match="expert 2's weight for a runner of num_experts"):
            served_tensors(expert, layout)
        with pytest.raises(ValueError, match="expert 2's weight"):
            ServedChecksums({"target": layout}).add(*expert[0])
