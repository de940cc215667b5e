"""The memory saver's CPU-checkable parts: the weights' move into its region (one allocation) keeps views and ties,
and the flag is refused where it cannot run (the release and resume themselves: tests/test_gpu_memory.py, on the
GPU machine)."""

import pytest
import torch

from slime_spec.engine.model_executor import memory_saver
from slime_spec.engine.model_executor.model import load_model
from slime_spec.tools.tiny_model import make_tiny_model


def test_the_weights_move_into_one_fresh_allocation_with_views_and_ties_kept(tmp_path):
    model, _ = load_model(make_tiny_model(tmp_path / "m", arch="qwen2", tie_word_embeddings=True), device="cpu")
    model.fuse_projections()
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    old_storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    old_qkv = attn.qkv[0].untyped_storage().data_ptr()
    allocation = memory_saver.copy_into_one_allocation([model], torch.device("cpu"))

    block = attn.qkv[0].untyped_storage().data_ptr()
    assert block != old_qkv and block == allocation.data_ptr()  # fresh storage, the one returned
    # one allocation: the saver pauses, backs up and resumes each allocation on its own
    assert {p.untyped_storage().data_ptr() for p in model.parameters()} == {block}
    assert {(p.data_ptr() - block) % memory_saver.SLOT_ALIGN for p in (attn.qkv[0], mlp.gate_up)} == {0}
    # q/k/v stay views of the fused tensor, gate/up of theirs, so a weight update still lands in what the matmul reads
    esize = attn.qkv[0].element_size()
    assert attn.q_proj.weight.data_ptr() == attn.qkv[0].data_ptr()
    assert attn.v_proj.weight.data_ptr() == attn.qkv[0].data_ptr() + esize * (
        attn.q_proj.weight.numel() + attn.k_proj.weight.numel())
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up.data_ptr() + esize * mlp.gate_proj.weight.numel()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    with torch.no_grad():
        attn.k_proj.weight.add_(1.0)
        mlp.up_proj.weight.add_(1.0)
    rows = attn.q_proj.weight.shape[0]
    assert torch.equal(attn.qkv[0][rows:rows + attn.k_proj.weight.shape[0]], attn.k_proj.weight)
    assert torch.equal(mlp.gate_up[mlp.gate_proj.weight.shape[0]:], mlp.up_proj.weight)
    for name, p in model.named_parameters():  # the neighbours of what was written are untouched
        if name not in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"):
            assert torch.equal(p, before[name]), name
    padding = allocation.numel() - sum(old_storages.values())
    assert 0 <= padding < memory_saver.SLOT_ALIGN * len(old_storages)


def test_the_flag_is_refused_on_cpu_and_without_the_package(monkeypatch):
    assert "needs a CUDA device" in memory_saver.unavailable_reason("cpu")
    monkeypatch.setattr(memory_saver.importlib.util, "find_spec", lambda name: None)
    assert "pip install torch_memory_saver" in memory_saver.unavailable_reason("cuda:0")
    with pytest.raises(memory_saver.MemorySaverError, match="--enable-memory-saver needs a CUDA device"):
        memory_saver.enable(torch.device("cpu"))


def test_enable_names_the_missing_preload(monkeypatch):
    monkeypatch.setattr(memory_saver, "unavailable_reason", lambda device: None)  # as on a GPU with the package
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with pytest.raises(memory_saver.MemorySaverError, match="configure_subprocess"):
        memory_saver.enable(torch.device("cuda"))
    assert not memory_saver.enabled()
