"""megatron-core GPTModel (+ its MTP block) from an HF config, loading HF weights, and a forward that
returns the policy's logits and every MTP layer's logits.

Local (non-TransformerEngine) layer spec: RMSNorm, SwiGLU, RoPE (plain or Llama-3.1's llama3 scaling), GQA, no
linear bias except Qwen2's q/k/v bias. Qwen3's per-head q/k RMSNorm is megatron-core's qk_layernorm (applied before
RoPE, as in HF and SGLang), its head_dim megatron's kv_channels. Qwen3-MoE's routed experts are megatron-core's MoE
layer: its top-k router (softmax, renormalized over the k as `norm_topk_prob` asks) and token dispatcher over
sequential local experts. GLM-4.5 (partial RoPE over the first `partial_rotary_factor` of each head, q/k/v bias)
has dense layers before `first_k_dense_replace`, then megatron-core's MoE layer with sigmoid routing, the
checkpoint's correction bias as the router's expert bias (held fixed: policy training moves the router only by the
loss), `routed_scaling_factor` and one shared expert; its MTP layers are megatron-core's MTP block over its last
(sparse) layer spec. DeepSeek-V3 is GLM-4.5's MoE (with group-limited top-k over `n_group` groups) under
megatron-core's multi-latent attention: its MLASelfAttention (q / kv down projections, their RMSNorms, up
projections) with its own YaRN RoPE and softmax scale, and as core attention `sdpa_attention.SDPACoreAttention`,
which stands in for TransformerEngine's (the local DotProductAttention takes no separate key / value head dims).
Parameters are float32 (training on CPU, and exact comparisons with HF), or bfloat16 with --bf16 (the optimizer
then keeps float32 master copies: precision.py).
Needs `parallel.init_parallel` first (Megatron's TP groups and RNG trackers).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from slime_spec.common import rope
from slime_spec.common.model_families import DENSE_FIRST_FAMILIES
from slime_spec.config.run_config import TrainConfig
from slime_spec.trainer import pipeline
from slime_spec.trainer.model_config import transformer_config
from slime_spec.trainer.packing import causal_mask
from slime_spec.weight_sync import convert


def read_hf_config(checkpoint: str | Path) -> dict:
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"--hf-checkpoint {checkpoint}: no config.json there")
    return json.loads(path.read_text())


def read_hf_state(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF safetensors checkpoint (single file or shards), as float32; a block-FP8 checkpoint's
    weights dequantized by their scales (weight_sync/fp8.py)."""
    from safetensors.torch import load_file

    from slime_spec.weight_sync import fp8
    files = sorted(Path(checkpoint).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"--hf-checkpoint {checkpoint}: no *.safetensors files there")
    try:
        scheme = fp8.Fp8BlockScheme.from_hf_config(read_hf_config(checkpoint))
    except fp8.Fp8ConfigError as e:
        raise fp8.Fp8ConfigError(f"--hf-checkpoint {checkpoint}: {e}") from None
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)) if scheme else {k: v.float() for k, v in load_file(str(f)).items()})
    if scheme is not None:
        try:
            state = fp8.dequantize_state(state, scheme)
        except fp8.Fp8ConfigError as e:
            raise fp8.Fp8ConfigError(f"--hf-checkpoint {checkpoint}: {e}") from None
    return state


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """Megatron splits the vocabulary evenly over TP ranks; the extra rows are never read as logits."""
    return -(-vocab_size // tp_size) * tp_size


def build_gpt_model(hf_config: dict, train: TrainConfig):
    """A randomly initialised GPTModel shaped like the HF model (load weights with `load_hf_weights`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    config = transformer_config(hf_config, train)
    if config.num_moe_experts:
        _define_te_general_gemm()
    # a pipeline stage builds its own layers (megatron-core's specs slice them by the stage); the first holds the
    # embedding, the last the final norm, the output layer and the MTP block (with its own copy of the embedding)
    pre_process, post_process = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    mla = config.multi_latent_attention
    rope_spec = None if mla else rope.rope_spec(hf_config)  # MLA: megatron's MLASelfAttention holds its own RoPE
    if convert.family_of(hf_config) in DENSE_FIRST_FAMILIES:  # a spec per layer, dense or MoE by moe_layer_freq
        layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        layer_specs = layer_spec.layer_specs
        if mla:
            _mark_te_linear_absent()
    else:
        layer_spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                              normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
        layer_specs = [layer_spec]
    if mla or config.context_parallel_size > 1:  # core attention megatron-core builds only with TransformerEngine
        from slime_spec.trainer.sdpa_attention import SDPACoreAttention
        for spec in layer_specs:
            spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    rotary_percent = float(hf_config.get("partial_rotary_factor") or 1.0)
    mtp_spec = (get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False)
                if train.mtp_num_layers else None)
    if config.sequence_parallel:  # MoE under TP (model_config.moe_config)
        from slime_spec.trainer import sequence_parallel
        layer_spec = sequence_parallel.block_spec(layer_spec, get_num_layers_to_build(config))
        mtp_spec = sequence_parallel.with_sequence_parallel_norms(mtp_spec)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size(hf_config["vocab_size"], train.tensor_model_parallel_size),
        max_sequence_length=hf_config.get("max_position_embeddings", 4096),
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=False,
        share_embeddings_and_output_weights=bool(hf_config.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_percent=rotary_percent,
        rotary_base=config.rotary_base if mla else rope_spec.theta,
        mtp_block_spec=mtp_spec,
    )
    if config.pipeline_model_parallel_size > 1:
        # each micro-batch's rows have their own length: megatron-core's point-to-point exchange sends the shape
        # first. Set after construction: the config refuses it next to the all-gather token dispatcher, which needs
        # equal token counts over the expert-parallel ranks, and the trainer gives each micro-batch those
        # (step_plan.row_lengths)
        config.variable_seq_lengths = True
    if not mla:
        # Megatron's own llama3 scaling has fixed numbers: use the checkpoint's (set before the first forward,
        # whose RoPE table Megatron caches).
        model.rotary_pos_emb.inv_freq = rope.inv_freq(rope_spec, int(rope.head_dim_of(hf_config) * rotary_percent))
    if train.bf16:  # as Megatron's Float16Module: every parameter, norms included (torch's RMSNorm is built float32)
        model.bfloat16()
        for module in model.modules():  # but the routers' expert bias, which megatron-core keeps in float32
            if hasattr(module, "_maintain_float32_expert_bias"):
                module._maintain_float32_expert_bias()
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if config.qk_layernorm and train.tensor_model_parallel_size > 1:
        sum_qk_norm_grads_over_tp(model)
    if config.sequence_parallel:
        from slime_spec.trainer import sequence_parallel
        sequence_parallel.sum_sequence_parallel_grads_over_tp(model)
        if mla:
            sequence_parallel.mla_kv_down_proj_full_width(model)
    return model


def _define_te_general_gemm() -> None:
    """megatron-core 0.16.1's router gating tests `te_general_gemm is not None`, a name it imports only with
    TransformerEngine: without TE the test raises NameError. None is what it means to find (plain torch.mm)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _mark_te_linear_absent() -> None:
    """Without TransformerEngine, megatron-core 0.16.1's extensions/transformer_engine.py stands a MagicMock in for
    the `te` module, so the `TELinear` that multi_latent_attention.py imports from it is a MagicMock instance, not a
    class, and MultiLatentAttention.__init__'s `isinstance(self.linear_proj, TELinear)` raises TypeError. A class
    nothing is an instance of is what that test means to find where TE is absent."""
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.TELinear = type("TELinearAbsent", (), {})


def sum_qk_norm_grads_over_tp(model) -> None:
    """Under TP every rank holds all of a q/k norm's weight but normalizes only its own heads, so each rank's
    gradient is a partial sum: add them up over the TP group as each backward produces them (Megatron's
    finalize_model_grads does this sum for `q_layernorm` / `k_layernorm` after the backward pass)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()

    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    for name, param in model.named_parameters():
        if name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
            param.register_hook(summed)


def named_weights(model):
    """(Megatron name, tensor) of every parameter, then of every router's expert bias: a float32 buffer in
    megatron-core, a weight of the checkpoint (`e_score_correction_bias`) that the engines serve. Decoder layers
    by their number in the whole model: a later pipeline stage's first layer is not `decoder.layers.0`."""
    rename = pipeline.global_layer_names(model)
    yield from ((rename(n), p) for n, p in model.named_parameters())
    yield from ((rename(n), b) for n, b in model.named_buffers() if n.endswith("router.expert_bias"))


def weights_copy(model) -> dict[str, torch.Tensor]:
    """A copy of every weight a checkpoint holds (`named_weights`: the routers' expert bias too)."""
    return {n: p.detach().clone() for n, p in named_weights(model)}


def copy_weights_into(model, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` (exactly the model's `named_weights`) into the model in place."""
    params = dict(named_weights(model))
    if set(state) != set(params):
        raise ValueError(f"checkpoint does not match the model: missing {sorted(set(params) - set(state))}, "
                         f"unexpected {sorted(set(state) - set(params))}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name])


def load_hf_weights(model, hf_state: dict[str, torch.Tensor], hf_config: dict, tp_rank: int, tp_size: int,
                    ep_rank: int = 0, ep_size: int = 1, etp_rank: int | None = None,
                    etp_size: int | None = None) -> None:
    """Copy an HF state dict into this rank's shards (HF -> Megatron names, MTP included; under expert
    parallelism only this EP rank's experts, each split over the expert-TP ranks, by default the TP ranks);
    strict."""
    family = convert.family_of(hf_config)
    mtp_layers = model.config.mtp_num_layers or 0
    if family == "mimo":  # the checkpoint may carry more MTP layers than the trainer runs
        hf_state = {k: v for k, v in hf_state.items()
                    if not k.startswith("model.mtp_layers.") or int(k.split(".")[2]) < mtp_layers}
    elif family in convert.MTP_FAMILIES:  # MTP layers are model.layers.{num_hidden_layers + i}
        last = int(hf_config["num_hidden_layers"]) + mtp_layers
        hf_state = {k: v for k, v in hf_state.items()
                    if not k.startswith("model.layers.") or int(k.split(".")[2]) < last}
    full = convert.hf_to_megatron(family, hf_state, hf_config)
    params = {convert.global_expert_name(n, ep_rank, ep_size, hf_config): p for n, p in named_weights(model)}
    if ep_size > 1:  # the other EP ranks' experts are theirs to load
        per_rank = convert.num_experts(hf_config) // ep_size
        full = {k: v for k, v in full.items()
                if convert.expert_index(k) is None or convert.expert_index(k) // per_rank == ep_rank}
    if "output_layer.weight" in params and "output_layer.weight" not in full:  # tied: the last stage's own copy
        full["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    full = {k: v for k, v in full.items() if pipeline.on_this_stage(k, model)}  # the other stages' are theirs
    missing = sorted(set(params) - set(full))
    unexpected = sorted(set(full) - set(params))
    if missing or unexpected:
        raise ValueError(f"HF checkpoint does not match the Megatron model: missing {missing}, unexpected {unexpected}")
    expert_split = None if etp_size is None else (etp_rank, etp_size)
    with torch.no_grad():
        for name, param in params.items():
            tensor = full[name]
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                tensor = F.pad(tensor, (0, 0, 0, padded_vocab_size(tensor.shape[0], tp_size) - tensor.shape[0]))
            rank, size = convert.tp_split_of(name, (tp_rank, tp_size), expert_split)
            shard = convert.split_tp_shard(name, tensor, rank, size)
            if shard.shape != param.shape:
                raise ValueError(f"{name}: HF gives shard shape {tuple(shard.shape)}, model has {tuple(param.shape)}")
            param.copy_(shard)


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [batch, seq, vocab]; position i predicts token i + 1
    mtp_logits: list[torch.Tensor]  # MTP layer k: position i predicts token i + k + 2
    aux_hidden: torch.Tensor | None = None  # [b, s, n * h] outputs of the aux layers (EAGLE3), detached
    embeds: torch.Tensor | None = None  # [b, s, h] token embeddings, detached (with aux_hidden)


@contextlib.contextmanager
def captured_layer_outputs(model, layer_ids: list[int]):
    """Collect the (detached) outputs of decoder layers `layer_ids` during a forward, in layer order."""
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for i in layer_ids:
        def hook(_module, _inputs, output, i=i):
            captured[i] = (output[0] if isinstance(output, tuple) else output).detach()
        handles.append(model.decoder.layers[i].register_forward_hook(hook))
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


@dataclass
class TrunkOutput:
    """The policy's pass over model rows, and what the MTP layers and an EAGLE3 draft reuse from it."""

    hidden: torch.Tensor  # [s, b, h] the decoder's output (before the output layer); a stage's, under PP
    logits: torch.Tensor | None  # [b, s, vocab]; None on a pipeline stage without the output layer
    position_ids: torch.Tensor  # [b, s]
    mask: torch.Tensor  # the attention mask the decoder used
    rope: torch.Tensor | None  # None under multi-latent attention (its layers apply RoPE)
    aux_hidden: torch.Tensor | None = None  # [b, s, n * h] outputs of the aux layers (EAGLE3), detached
    embeds: torch.Tensor | None = None  # [b, s, h] token embeddings, detached (with aux_hidden)


def rope_for_positions(model, position_ids: torch.Tensor) -> torch.Tensor | None:
    """Megatron's RoPE table [s, b, 1, d] looked up at each token's own position (packed rows restart at 0).

    None under multi-latent attention, whose layers apply RoPE themselves at row positions 0..s-1: a packed row's
    later samples are then rotated by their offset in the row, which leaves their attention scores as they are
    (RoPE scores depend on q / k position differences only, and the mask keeps each sample to itself)."""
    if model.config.multi_latent_attention:
        return None
    # the whole table (RotaryEmbedding.forward would cut this context-parallel rank's chunks from it)
    table = model.rotary_pos_emb.get_emb(int(position_ids.max()) + 1)  # [max_pos, 1, 1, d]
    return table[:, 0, 0][position_ids.t()][:, :, None]


def output_weight(model) -> torch.Tensor:
    """This rank's vocabulary shard of the output layer (the embedding when the two are tied)."""
    return model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights \
        else model.output_layer.weight


def logits_of(model, hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[s, b, h] hidden states -> [b, s, vocab] logits, gathered over TP ranks, padded vocabulary rows dropped."""
    out, _ = model.output_layer(hidden, weight=weight, runtime_gather_output=True)
    return out.transpose(0, 1)[..., :vocab_size]


def trunk_forward(model, input_ids: torch.Tensor, vocab_size: int, position_ids: torch.Tensor | None = None,
                  attention_mask: torch.Tensor | None = None,
                  aux_layer_ids: list[int] | None = None) -> TrunkOutput:
    """The policy's logits for `input_ids` [rows, seq]: right-padded rows by default; packed rows pass their
    per-sample `position_ids` and block-diagonal `attention_mask` (packing.ModelRows).

    On a pipeline stage, this stage's part: the first embeds the tokens, a later one reads the previous stage's
    output (the tensor megatron-core's schedule hands the model through `set_input_tensor`), and only the last
    computes logits.
    `aux_layer_ids`: also return those layers' outputs and the embeddings, detached (an EAGLE3 draft's inputs).
    """
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
    mask = causal_mask(input_ids.shape[1], input_ids.device) if attention_mask is None else attention_mask
    rope_table = rope_for_positions(model, position_ids)
    decoder_input = model.embedding(input_ids=input_ids, position_ids=position_ids) if model.pre_process else None
    with captured_layer_outputs(model, aux_layer_ids or []) as captured:
        hidden = model.decoder(hidden_states=decoder_input, attention_mask=mask, rotary_pos_emb=rope_table)
    aux_hidden = embeds = None
    if aux_layer_ids:
        aux_hidden = torch.cat([captured[i] for i in aux_layer_ids], dim=-1)
        embeds = decoder_input.detach()
        if model.config.sequence_parallel:  # each TP rank holds a slice of the sequence; the draft reads it all
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
            aux_hidden, embeds = (gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
                                  for x in (aux_hidden, embeds))
        aux_hidden, embeds = aux_hidden.transpose(0, 1), embeds.transpose(0, 1)
    logits = logits_of(model, hidden, output_weight(model), vocab_size) if model.post_process else None
    return TrunkOutput(hidden, logits, position_ids, mask, rope_table, aux_hidden, embeds)


def mtp_hidden_states(model, input_ids: torch.Tensor, trunk: TrunkOutput,
                      mtp_zero_first_token: bool = False, unroll_steps: int = 1) -> list[torch.Tensor]:
    """Every MTP layer's final hidden states [s, b, h] (before the shared output layer), then `unroll_steps` - 1
    more of the last layer fed its own output: entry k at position i predicts token i + k + 2.

    The MTP block sees the decoder output and the embedding *detached*: MTP training moves only the MTP
    layers, the draft follows the policy and never pulls it.
    `mtp_zero_first_token`: zero the MTP token embedding at each sample's position 0, as SGLang serves
    MiMo's MTP layer (sglang models/mimo_mtp.py), so the draft is trained on exactly the inputs it is served with.
    `unroll_steps` (--mtp-unroll-steps): NEXTN drafts k tokens with one MTP layer by feeding it its own hidden
    states, which Megatron's loss never trains (each layer is trained one step ahead). The unrolled steps chain as
    Megatron chains its layers (layer k + 1 reads layer k's output at the same position and the next token), with
    the last layer's weights: what the drafter computes at draft step k, except that attention there also sees the
    context's keys of the first step (here every step attends within its own step).
    """
    sample_start = (trunk.position_ids == 0).t()[:, :, None]  # [s, b, 1]; Megatron rolls position_ids, not this

    def detached_embedding(input_ids, position_ids):
        return model.embedding(input_ids=input_ids, position_ids=position_ids).detach()  # [s, b, h]

    def first_step_embedding(input_ids, position_ids):  # later steps draft at positions >= 1: nothing zeroed
        return detached_embedding(input_ids, position_ids).masked_fill(sample_start, 0.0)

    layers = list(model.mtp.layers)
    layers += layers[-1:] * (unroll_steps - 1)
    hidden, ids, positions, out = trunk.hidden.detach(), input_ids, trunk.position_ids, []
    for k, layer in enumerate(layers):  # MultiTokenPredictionBlock.forward's loop, over the unrolled layer list
        embedding = first_step_embedding if mtp_zero_first_token and k == 0 else detached_embedding
        hidden, ids, positions = layer(input_ids=ids, position_ids=positions, hidden_states=hidden,
                                       attention_mask=trunk.mask, rotary_pos_emb=trunk.rope, embedding=embedding)
        out.append(hidden)
    return out


def forward(model, input_ids: torch.Tensor, vocab_size: int, with_mtp: bool = True,
            mtp_zero_first_token: bool = False, position_ids: torch.Tensor | None = None,
            attention_mask: torch.Tensor | None = None, aux_layer_ids: list[int] | None = None,
            mtp_unroll_steps: int = 1) -> ModelOutput:
    """The policy's and the MTP layers' full logits for `input_ids` [rows, seq] (checks against HF and the
    engines; training reads the MTP layers' hidden states through `mtp_loss` instead of their logits).

    Not GPTModel.forward: with MTP it returns only losses (no logits for PPO), and it lets the MTP loss
    reach the trunk (`mtp_hidden_states` detaches it). `aux_layer_ids`: as in `trunk_forward`; `mtp_unroll_steps`:
    as in `mtp_hidden_states`.
    """
    trunk = trunk_forward(model, input_ids, vocab_size, position_ids, attention_mask, aux_layer_ids)
    mtp = mtp_logits(model, input_ids, trunk, vocab_size, mtp_zero_first_token, mtp_unroll_steps) if with_mtp else []
    return ModelOutput(trunk.logits, mtp, trunk.aux_hidden, trunk.embeds)


def mtp_logits(model, input_ids: torch.Tensor, trunk: TrunkOutput, vocab_size: int,
               mtp_zero_first_token: bool = False, unroll_steps: int = 1) -> list[torch.Tensor]:
    """Every MTP layer's full logits [b, s, vocab] (`mtp_hidden_states` through the shared output layer); [] on a
    model or stage without the MTP block."""
    if not getattr(model, "mtp_process", False):
        return []
    weight = output_weight(model).detach()
    return [logits_of(model, h, weight, vocab_size)
            for h in mtp_hidden_states(model, input_ids, trunk, mtp_zero_first_token, unroll_steps)]
