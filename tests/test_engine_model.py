"""The embedded engine's model: logits equal transformers', cached/batched forwards equal full ones, MTP wiring."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime_spec.engine.model_executor.model import load_model
from slime_spec.tools.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, arch=arch, hidden_size=32, num_layers=2, seed=7)
            for arch in ("llama", "qwen2", "qwen3", "mimo")}


def _ids(batch, length, seed=0, vocab=100):
    return torch.randint(5, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_logits_match_transformers(ckpts, arch):
    model, _ = load_model(ckpts[arch])
    hf = AutoModelForCausalLM.from_pretrained(ckpts[arch], dtype=torch.float32).eval()
    ids = _ids(3, 33)
    with torch.no_grad():
        ref = hf(ids).logits
    cache = model.new_cache(4, 64)
    slots = torch.tensor([3, 0, 2])
    positions = torch.arange(33)[None].expand(3, 33)
    logits = model.logits(model(ids, positions, cache, slots))
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
    # Prefill then one token at a time through the cache gives the same logits.
    cache = model.new_cache(4, 64)
    steps = [model.logits(model(ids[:, :20], positions[:, :20], cache, slots))]
    for t in range(20, 33):
        steps.append(model.logits(model(ids[:, t:t + 1], positions[:, t:t + 1], cache, slots)))
    torch.testing.assert_close(torch.cat(steps, 1), ref, atol=1e-5, rtol=0)


def test_rows_of_different_lengths_in_one_batch(ckpts):
    model, _ = load_model(ckpts["qwen2"])
    a, b = _ids(1, 9, seed=1)[0], _ids(1, 4, seed=2)[0]
    cache = model.new_cache(2, 32)
    padded = torch.stack([a, torch.cat([b, torch.zeros(5, dtype=torch.long)])])
    positions = torch.arange(9)[None].expand(2, 9)
    hidden = model(padded, positions, cache, torch.tensor([0, 1]))
    # Row 1 continues at its own length (4) while row 0 continues at 9: pad entries are overwritten, never read.
    nxt = torch.tensor([[7], [8]])
    step = model.logits(model(nxt, torch.tensor([[9], [4]]), cache, torch.tensor([0, 1])))[:, 0]
    for row, seq, last in ((0, torch.cat([a, nxt[0]]), hidden[0, 8]), (1, torch.cat([b, nxt[1]]), hidden[1, 3])):
        alone = model.new_cache(1, 32)
        full = model(seq[None], torch.arange(len(seq))[None], alone, torch.tensor([0]))
        torch.testing.assert_close(full[0, -2], last, atol=1e-5, rtol=0)
        torch.testing.assert_close(model.logits(full[0, -1]), step[row], atol=1e-5, rtol=0)


def test_mimo_base_is_qwen2_and_mtp_input_order(ckpts, tmp_path):
    model, config = load_model(ckpts["mimo"])
    assert model.args.mtp_layers == 1 and model.args.qkv_bias
    # The base model is Qwen2: transformers' Qwen2 on the same tensors (MTP layers dropped) gives the same logits.
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    qwen = tmp_path / "as_qwen2"
    shutil.copytree(ckpts["mimo"], qwen)
    cfg = dict(config, architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    (qwen / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(qwen / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if "mtp_layers" not in k}, str(qwen / "model.safetensors"))
    ids = _ids(2, 17)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(qwen, dtype=torch.float32).eval()(ids).logits
    positions = torch.arange(17)[None].expand(2, 17)
    out = model.logits(model(ids, positions, model.new_cache(2, 32), torch.tensor([0, 1])))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)

    # MTP input is cat(hidden_layernorm(hidden), token_layernorm(embedding)) as in SGLang's mimo_mtp.py:
    # zeroing input_proj's first half makes the output independent of the hidden state, and vice versa.
    mtp = model.model.mtp_layers[0]
    h = model.args.hidden_size
    hidden = torch.randn(2, 17, h)

    def run(tokens, hid):
        return model.mtp_forward(tokens, hid, positions, model.new_mtp_cache(2, 32), torch.tensor([0, 1]))

    with torch.no_grad():
        original = mtp.input_proj.weight.clone()
        mtp.input_proj.weight[:, :h] = 0
        torch.testing.assert_close(run(ids, hidden), run(ids, torch.randn(2, 17, h)))
        assert not torch.allclose(run(ids, hidden), run(_ids(2, 17, seed=5), hidden))
        mtp.input_proj.weight.copy_(original)
        mtp.input_proj.weight[:, h:] = 0
        torch.testing.assert_close(run(ids, hidden), run(_ids(2, 17, seed=5), hidden))
        mtp.input_proj.weight.copy_(original)
        # The token embedding at position 0 is masked out (SGLang: hidden_states[positions == 0] = 0).
        other = ids.clone()
        other[:, 0] = (ids[:, 0] + 1) % 100
        torch.testing.assert_close(run(ids, hidden)[:, 0], run(other, hidden)[:, 0])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_dtypes_run(ckpts, dtype):
    ref_model, _ = load_model(ckpts["llama"])
    model, _ = load_model(ckpts["llama"], dtype=dtype)
    assert model.lm_head.weight.dtype == getattr(torch, dtype)
    ids = _ids(2, 12)
    positions = torch.arange(12)[None].expand(2, 12)
    ref = ref_model.logits(ref_model(ids, positions, ref_model.new_cache(2, 16), torch.tensor([0, 1])))
    out = model.logits(model(ids, positions, model.new_cache(2, 16), torch.tensor([0, 1])))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert (out - ref).abs().max() < 0.25 * ref.abs().max()


def test_load_model_rejects_unsupported(tmp_path):
    import json
    path = make_tiny_model(tmp_path / "m", hidden_size=32)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, architectures=["GPT2LMHeadModel"])))
    with pytest.raises(ValueError, match="architectures"):
        load_model(path)
    (path / "config.json").write_text(json.dumps(dict(cfg, hidden_size=48, head_dim=12)))
    with pytest.raises(ValueError, match="shape"):
        load_model(path)
