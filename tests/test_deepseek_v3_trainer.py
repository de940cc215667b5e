"""DeepSeek-V3 in the trainer: megatron-core's own blocks (MLASelfAttention with its q / kv latent projections and
RMSNorms and its YaRN RoPE, dense layers before `first_k_dense_replace`, then its MoE layer with sigmoid routing over
the checkpoint's correction bias within the best expert groups, a shared expert, its MTP block), with
`SDPACoreAttention` as the core attention TransformerEngine would provide. It computes what transformers'
DeepseekV3ForCausalLM computes, trains (forward and backward through policy and MTP layer, packed rows as padded
ones), and its parameters are, name for name and shape for shape, what the conversion gives both ways."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from slime_spec.config.run_config import TrainConfig
from slime_spec.rollout.sample import Sample
from slime_spec.tools.tiny_model import make_tiny_model
from slime_spec.trainer import batch as B
from slime_spec.trainer import model as M
from slime_spec.trainer import packing, parallel
from slime_spec.weight_sync import convert
from tests.helpers.trainers import built_model, model_device


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    parallel.init_single_process(seed=0)
    return make_tiny_model(tmp_path_factory.mktemp("deepseek_v3") / "m", arch="deepseek_v3", num_layers=3,
                           mtp_layers=1, first_k_dense_replace=1, seed=3)



def megatron_attention(heads: int, groups: int, dim: int):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                               num_query_groups=groups, attention_dropout=0.0, masked_softmax_fusion=False,
                               use_cpu_initialization=True)
    return config, DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                       attention_type="self")


@pytest.mark.parametrize("groups", [4, 2])
def test_sdpa_core_attention_is_megatrons_local_attention_where_head_dims_agree(groups):
    from megatron.core.transformer.enums import AttnMaskType

    from slime_spec.trainer.sdpa_attention import SDPACoreAttention
    parallel.init_single_process(seed=0)
    heads, dim, s, b = 4, 8, 7, 2
    config, theirs = megatron_attention(heads, groups, dim)
    ours = SDPACoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    # megatron's local attention takes its score buffer on the current CUDA device where there is one
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, heads, dim, generator=gen).to(device)
    k, v = (torch.randn(s, b, groups, dim, generator=gen).to(device) for _ in range(2))
    causal = packing.causal_mask(s, device)
    block = causal | ((torch.arange(s, device=device)[:, None] >= 3) != (torch.arange(s, device=device)[None] >= 3))
    for mask in (causal, block):  # the second: two packed samples
        expected = theirs(q, k, v, mask)
        # float32 both ways; CUDA's attention kernels sum in another order than the CPU's
        torch.testing.assert_close(ours(q, k, v, mask), expected, atol=1e-6 if device == "cpu" else 1e-5, rtol=0)
    assert ours(q, k, v, causal).shape == (s, b, heads * dim)


def test_sdpa_core_attention_takes_a_value_head_dim_apart_from_the_keys():
    from megatron.core.transformer.enums import AttnMaskType

    from slime_spec.trainer.sdpa_attention import SDPACoreAttention
    parallel.init_single_process(seed=0)
    config, _ = megatron_attention(2, 2, 8)
    scale = 0.3
    ours = SDPACoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                             softmax_scale=scale, k_channels=12, v_channels=5)
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(6, 1, 2, 12, generator=gen), torch.randn(6, 1, 2, 12, generator=gen)
    v = torch.randn(6, 1, 2, 5, generator=gen)
    mask = packing.causal_mask(6, "cpu")
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    probs = scores.masked_fill(mask, -math.inf).softmax(-1)
    expected = torch.einsum("bhst,tbhd->sbhd", probs, v).reshape(6, 1, 10)
    torch.testing.assert_close(ours(q, k, v, mask), expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="packed_seq_params"):
        ours(q, k, v, mask, packed_seq_params=object())


def test_trainer_is_megatrons_mla_and_moe_and_equals_hf(deepseek):
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from transformers import AutoModelForCausalLM, DeepseekV3ForCausalLM

    from slime_spec.trainer.sdpa_attention import SDPACoreAttention
    hf_config, model = built_model(deepseek)
    config = model.config
    assert config.multi_latent_attention and config.rope_type == "yarn"
    assert (config.q_lora_rank, config.kv_lora_rank) == (hf_config["q_lora_rank"], hf_config["kv_lora_rank"])
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (
        hf_config["qk_nope_head_dim"], hf_config["qk_rope_head_dim"], hf_config["v_head_dim"])
    assert config.moe_layer_freq == [0, 1, 1] and config.moe_router_score_function == "sigmoid"
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (hf_config["n_group"],
                                                                            hf_config["topk_group"])
    attention = model.decoder.layers[0].self_attention
    assert type(attention) is MLASelfAttention and type(attention.core_attention) is SDPACoreAttention
    assert type(model.decoder.layers[0].mlp) is MLP and isinstance(model.decoder.layers[1].mlp, MoELayer)
    checkpoint = load_file(str(deepseek / "model.safetensors"))
    assert torch.equal(model.decoder.layers[2].mlp.router.expert_bias.cpu(),
                       checkpoint["model.layers.2.mlp.gate.e_score_correction_bias"])
    ref = AutoModelForCausalLM.from_pretrained(deepseek, dtype=torch.float32)
    assert isinstance(ref, DeepseekV3ForCausalLM)  # transformers has no MTP layer: model.layers.3 is left unread
    ids = torch.randint(0, hf_config["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = M.forward(model.eval(), ids.to(model_device(model)), hf_config["vocab_size"]).logits.cpu()
        theirs = ref.eval()(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_without_query_lora_and_with_plain_rope_equals_hf(deepseek, tmp_path):
    """`q_lora_rank` null (megatron's linear_q_proj, HF's q_proj) and no `rope_scaling`: both ways MLA is built."""
    import json
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    path = tmp_path / "no_q_lora"
    shutil.copytree(deepseek, path)
    config = {**json.loads((path / "config.json").read_text()), "q_lora_rank": None, "rope_scaling": None}
    (path / "config.json").write_text(json.dumps(config))
    weights, gen = load_file(str(path / "model.safetensors")), torch.Generator().manual_seed(5)
    for name in [n for n in weights if n.endswith("q_a_proj.weight")]:
        layer = name.removesuffix("q_a_proj.weight")
        rows, cols = weights.pop(layer + "q_b_proj.weight").shape[0], weights.pop(name).shape[1]
        del weights[layer + "q_a_layernorm.weight"]
        weights[layer + "q_proj.weight"] = torch.randn(rows, cols, generator=gen) / math.sqrt(cols)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf_config, model = built_model(path, mtp_num_layers=1)
    assert model.config.q_lora_rank is None and model.config.rope_type == "rope"
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(0, hf_config["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = M.forward(model.eval(), ids.to(model_device(model)), hf_config["vocab_size"]).logits.cpu()
        theirs = ref.eval()(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_parameters_are_the_conversions_both_ways(deepseek):
    from slime_spec.weight_sync.gather import iter_hf_tensors
    hf_config, model = built_model(deepseek, mtp_num_layers=1)
    hf_state = M.read_hf_state(deepseek)
    theirs = {n: tuple(t.shape) for n, t in M.named_weights(model)}
    ours = {n: tuple(t.shape) for n, t in convert.hf_to_megatron("deepseek_v3", hf_state, hf_config).items()}
    assert ours == theirs
    assert "mtp.layers.0.transformer_layer.self_attention.kv_layernorm.weight" in theirs
    sent = {t.name: t.tensor for t in iter_hf_tensors(M.named_weights(model), hf_config)}
    # all but the MTP layer's embedding and head copies (Megatron's MTP, and SGLang's NextN, use the main ones)
    assert sorted(set(hf_state) - set(sent)) == ["model.layers.3.embed_tokens.weight",
                                                 "model.layers.3.shared_head.head.weight"]
    assert all(torch.equal(sent[n].cpu(), hf_state[n]) for n in sent)


def test_forward_backward_reaches_every_parameter_with_mtp(deepseek):
    hf_config, model = built_model(deepseek, mtp_num_layers=1, enable_mtp_training=True)
    ids = torch.randint(0, hf_config["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(1))
    out = M.forward(model.train(), ids.to(model_device(model)), hf_config["vocab_size"])
    assert len(out.mtp_logits) == 1 and out.mtp_logits[0].shape == out.logits.shape
    (out.logits.logsumexp(-1).mean() + out.mtp_logits[0].logsumexp(-1).mean()).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum()]
    assert missing == []


def test_a_packed_sample_matches_its_own_forward(deepseek):
    """MLA rotates a packed row's tokens by their place in the row, not in their sample: the same attention, as
    RoPE scores depend on position differences only and the mask keeps each sample to itself."""
    hf_config, model = built_model(deepseek, mtp_num_layers=1)
    vocab = hf_config["vocab_size"]
    first = Sample(index=0, group_index=0, prompt="p", tokens=[11, 12, 13, 14, 15, 16], response_length=3)
    second = Sample(index=1, group_index=0, prompt="p", tokens=[21, 22, 23, 24, 25], response_length=2)
    rows = packing.packed_rows(B.collate([first, second]))
    with torch.no_grad():
        device = model_device(model)
        packed = M.forward(model.eval(), rows.input_ids.to(device), vocab, position_ids=rows.position_ids.to(device),
                           attention_mask=rows.attention_mask.to(device))
        alone = M.forward(model, torch.tensor([second.tokens], device=device), vocab)
    n0, n1 = len(first.tokens), len(second.tokens)
    torch.testing.assert_close(packed.logits[:, n0:], alone.logits, atol=1e-5, rtol=0)
    # MTP: the last position of a sample sees a rolled-in token from past its end (masked in the loss).
    torch.testing.assert_close(packed.mtp_logits[0][:, n0:n0 + n1 - 1], alone.mtp_logits[0][:, :-1], atol=1e-5,
                               rtol=0)


def test_packed_step_has_the_padded_steps_gradients(deepseek):
    """--max-tokens-per-gpu (the script's --use-dynamic-batch-size on GPUs): the same gradients, MTP layer included."""
    from slime_spec.trainer.trainer import Trainer

    prompts, responses = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14, 15], [16], [17, 18, 19]]
    samples = [Sample(index=i, group_index=i // 2, prompt="p", tokens=prompts[i // 2] + r, response_length=len(r),
                      reward=float(i % 2)) for i, r in enumerate(responses)]
    base = dict(hf_checkpoint=str(deepseek), mtp_num_layers=1, enable_mtp_training=True, global_batch_size=4,
                micro_batch_size=2, n_samples_per_prompt=2)
    padded = Trainer(TrainConfig(**base))
    packed = Trainer(TrainConfig(**base, max_tokens_per_gpu=12, use_dynamic_batch_size=True))
    assert len([mb for step in packed.plan(samples) for mb in step]) >= 2  # really split into several rows
    g_pad, g_pack = padded.gradients(samples), packed.gradients(samples)
    assert set(g_pad) == set(g_pack) and any(n.startswith("mtp.") for n in g_pad)
    for name in g_pad:
        torch.testing.assert_close(g_pack[name], g_pad[name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_saved_step_resumes_and_serves_as_the_kl_reference(deepseek, tmp_path):
    """A checkpoint holds the routers' correction bias (a megatron-core buffer) with the parameters: --load resumes
    it, and --ref-load takes it as the KL reference, both with exactly the saved weights."""
    from slime_spec.trainer.trainer import Trainer

    samples = [Sample(index=i, group_index=i // 2, prompt="p", tokens=[5, 6, 7, 10 + i, 11 + i], response_length=2,
                      reward=float(i % 2)) for i in range(4)]
    base = dict(hf_checkpoint=str(deepseek), global_batch_size=4, micro_batch_size=2, n_samples_per_prompt=2, lr=1e-3)
    trained = Trainer(TrainConfig(**base, save=str(tmp_path / "ckpt")))
    trained.train_step(samples, 0)
    trained.save(0)
    saved = {n: t.clone() for n, t in trained.hf_state_dict().items()}
    saved_megatron = {n: t.clone() for n, t in trained.named_megatron_params()}
    assert any(n.endswith("router.expert_bias") for n in saved_megatron)
    resumed = Trainer(TrainConfig(**base, load=str(tmp_path / "ckpt")))
    assert resumed.start_rollout_id == 1
    assert all(torch.equal(t, saved[n]) for n, t in resumed.hf_state_dict().items())
    reference = Trainer(TrainConfig(**base, use_kl_loss=True, ref_load=str(tmp_path / "ckpt")))
    assert set(reference.ref_state) == set(saved_megatron)
    assert all(torch.equal(reference.ref_state[n], t) for n, t in saved_megatron.items())
    assert not all(torch.equal(t, saved[n]) for n, t in reference.hf_state_dict().items())  # the policy: HF weights


def test_refusals_name_the_config_key(deepseek):
    hf_config = M.read_hf_config(deepseek)
    train = TrainConfig(hf_checkpoint=str(deepseek))
    with pytest.raises(ValueError, match="num_experts_per_tok=2, topk_group=2"):
        M.transformer_config({**hf_config, "topk_group": 2}, train)
    with pytest.raises(ValueError, match="scoring_func='softmax'"):
        M.transformer_config({**hf_config, "scoring_func": "softmax"}, train)
    with pytest.raises(ValueError, match="attention_bias=true"):
        M.transformer_config({**hf_config, "attention_bias": True}, train)
    with pytest.raises(ValueError, match="rope_scaling type 'linear'"):
        M.transformer_config({**hf_config, "rope_scaling": {"type": "linear", "factor": 2.0}}, train)
    # under TP with sequence parallelism (tests/test_trainer_cp.py at TP 2 x CP 2)
    assert M.transformer_config(hf_config, TrainConfig(hf_checkpoint=str(deepseek),
                                                       tensor_model_parallel_size=2)).sequence_parallel
