"""The Megatron policy built from an HF config computes what the HF model computes (float32)."""

from __future__ import annotations

import pytest
import torch

from slime_spec.config.run_config import TrainConfig
from slime_spec.tools.tiny_model import make_tiny_model
from slime_spec.trainer import cpu_compat, parallel
from slime_spec.trainer import model as M

ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def megatron():
    parallel.init_single_process(seed=0)


def build(path, **train_kwargs):
    hf_config, hf_state = M.read_hf_config(path), M.read_hf_state(path)
    train = TrainConfig(hf_checkpoint=str(path), **train_kwargs)
    model = M.build_gpt_model(hf_config, train)
    M.load_hf_weights(model, hf_state, hf_config, tp_rank=0, tp_size=1)
    return model.eval(), hf_config, hf_state


def hf_model(hf_config: dict, hf_state: dict, num_layers: int | None = None):
    """transformers' Llama/Qwen2/Qwen3 (MiMo's trunk is a Qwen2) with the checkpoint's trunk weights."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    fields = {k: v for k, v in hf_config.items() if k not in ("num_nextn_predict_layers", "architectures")}
    if num_layers is not None:
        fields.update(num_hidden_layers=num_layers, max_window_layers=num_layers)
    if hf_config["model_type"] == "llama":
        model = LlamaForCausalLM(LlamaConfig(**fields))
    elif hf_config["model_type"] == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**fields))
    else:
        fields["model_type"] = "qwen2"
        model = Qwen2ForCausalLM(Qwen2Config(**fields))
    trunk = {k: v for k, v in hf_state.items() if not k.startswith("model.mtp_layers.")}
    missing, unexpected = model.load_state_dict(trunk, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if hf_config["tie_word_embeddings"]:
        model.tie_weights()
    return model.eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_logits_equal_hf(arch, tmp_path):
    model, hf_config, hf_state = build(make_tiny_model(tmp_path, arch=arch, seed=3))
    ids = torch.randint(0, hf_config["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = M.forward(model, ids, hf_config["vocab_size"]).logits
        ref = hf_model(hf_config, hf_state)(ids).logits
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def mimo_mtp_step(hf_config: dict, hf_state: dict, h: torch.Tensor, next_ids: torch.Tensor,
                  zero_first: bool) -> torch.Tensor:
    """One application of MiMo's MTP layer from the HF weights (sglang mimo_mtp.py), over a whole sequence:
    final_ln(layer(input_proj(cat[hidden_ln(h[i]), token_ln(embed(next_ids[i]))]))), the normed hidden states."""
    eps = hf_config["rms_norm_eps"]
    p = "model.mtp_layers.0."

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    emb = hf_state["model.embed_tokens.weight"][next_ids].clone()
    if zero_first:
        emb[:, 0] = 0  # SGLang zeroes the MTP token embedding at position 0
    x = torch.cat([rms(h, hf_state[p + "hidden_layernorm.weight"]),
                   rms(emb, hf_state[p + "token_layernorm.weight"])], -1)
    x = x @ hf_state[p + "input_proj.weight"].T
    # One Qwen2 decoder layer = a one-layer Qwen2 model fed with inputs_embeds (its norm = MTP final_layernorm).
    layer_state = {k.replace(p, "model.layers.0."): v for k, v in hf_state.items()
                   if k.startswith(p) and k.split(".")[3] in ("self_attn", "mlp", "input_layernorm",
                                                              "post_attention_layernorm")}
    layer_state["model.norm.weight"] = hf_state[p + "final_layernorm.weight"]
    layer_state["model.embed_tokens.weight"] = hf_state["model.embed_tokens.weight"]  # unused: inputs_embeds
    return hf_model(hf_config, layer_state, num_layers=1).model(inputs_embeds=x).last_hidden_state


def mimo_mtp_reference(hf_config: dict, hf_state: dict, ids: torch.Tensor, steps: int = 1) -> list[torch.Tensor]:
    """MiMo's MTP recurrence as NEXTN drafts with it: step 1 reads the trunk's final (normed) hidden state h[i] and
    token ids[i + 1] and predicts ids[i + 2]; step k + 1 reads step k's output at i and token ids[i + k + 1].
    Logits per step, over the positions that have their input tokens."""
    h = hf_model(hf_config, hf_state).model(ids).last_hidden_state
    out = []
    for k in range(steps):
        h = mimo_mtp_step(hf_config, hf_state, h[:, :ids.shape[1] - 1 - k], ids[:, k + 1:], zero_first=k == 0)
        out.append(h @ hf_state["lm_head.weight"].T)
    return out


def test_mimo_trunk_and_mtp_logits_equal_hf_reference(tmp_path):
    model, hf_config, hf_state = build(make_tiny_model(tmp_path, arch="mimo", seed=5), mtp_num_layers=1)
    ids = torch.randint(0, hf_config["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = M.forward(model, ids, hf_config["vocab_size"], mtp_zero_first_token=True)
        torch.testing.assert_close(out.logits, hf_model(hf_config, hf_state)(ids).logits, atol=ATOL, rtol=0)
        assert len(out.mtp_logits) == 1
        ref = mimo_mtp_reference(hf_config, hf_state, ids)[0]
    # Megatron's last position sees a rolled-in token: only positions 0..s-2 have a next token.
    torch.testing.assert_close(out.mtp_logits[0][:, :-1], ref, atol=ATOL, rtol=0)


def test_unrolled_mtp_steps_feed_the_layer_its_own_output_as_nextn_drafts(tmp_path):
    """--mtp-unroll-steps 3: the one MTP layer applied three times in a chain, each step reading the previous
    step's normed output and the next token, the position-0 embedding zeroed only in the first step (later draft
    steps are at positions >= 1); step 1 is the un-unrolled MTP output, unchanged."""
    model, hf_config, hf_state = build(make_tiny_model(tmp_path, arch="mimo", seed=5), mtp_num_layers=1)
    ids = torch.randint(0, hf_config["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = M.forward(model, ids, hf_config["vocab_size"], mtp_zero_first_token=True, mtp_unroll_steps=3)
        single = M.forward(model, ids, hf_config["vocab_size"], mtp_zero_first_token=True)
        ref = mimo_mtp_reference(hf_config, hf_state, ids, steps=3)
    assert len(out.mtp_logits) == 3
    torch.testing.assert_close(out.mtp_logits[0], single.mtp_logits[0], atol=0, rtol=0)
    for k in range(3):  # step k + 1 has its input tokens at positions 0..s-2-k
        torch.testing.assert_close(out.mtp_logits[k][:, :ids.shape[1] - 1 - k], ref[k], atol=ATOL, rtol=0)


def test_one_step_mtp_loop_is_megatrons_block(tmp_path):
    """mtp_hidden_states runs the MTP layers itself (to repeat the last one); unrolled once it is exactly
    Megatron's MultiTokenPredictionBlock.forward."""
    model, hf_config, _ = build(make_tiny_model(tmp_path, arch="mimo", seed=6), mtp_num_layers=1)
    ids = torch.randint(0, hf_config["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        trunk = M.trunk_forward(model, ids, hf_config["vocab_size"])
        ours = M.mtp_hidden_states(model, ids, trunk)
        embedding = lambda input_ids, position_ids: model.embedding(input_ids=input_ids, position_ids=position_ids)  # noqa: E731
        block = model.mtp(input_ids=ids, position_ids=trunk.position_ids, hidden_states=trunk.hidden,
                          attention_mask=trunk.mask, rotary_pos_emb=trunk.rope, embedding=embedding)
    torch.testing.assert_close(ours[0], torch.chunk(block, 2, dim=0)[1], atol=0, rtol=0)


def test_bad_configs_are_clear_errors(tmp_path):
    path = make_tiny_model(tmp_path, arch="qwen2")
    hf_config = M.read_hf_config(path)
    with pytest.raises(ValueError, match="no MTP layers"):
        M.transformer_config(hf_config, TrainConfig(hf_checkpoint=str(path), mtp_num_layers=1))
    with pytest.raises(ValueError, match="--enable-mtp-training needs --mtp-num-layers"):
        M.transformer_config(hf_config, TrainConfig(hf_checkpoint=str(path), enable_mtp_training=True))
    with pytest.raises(ValueError, match="only num_nextn_predict_layers=1"):
        M.transformer_config({**hf_config, "model_type": "mimo", "num_nextn_predict_layers": 1},
                             TrainConfig(hf_checkpoint=str(path), mtp_num_layers=2))


def test_cpu_compat_is_idempotent():
    assert cpu_compat.needed() == (not torch.cuda.is_available())
    assert cpu_compat.apply() is False  # already applied by init_parallel (or CUDA present)
    if cpu_compat.needed():
        assert torch.cuda.current_device() == "cpu"
        state = torch.cuda.get_rng_state()
        a = torch.rand(3)
        torch.cuda.set_rng_state(state)
        assert torch.equal(torch.rand(3), a)
