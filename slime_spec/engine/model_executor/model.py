"""A gpt-fast-style decoder for Llama, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm before RoPE, its own head_dim),
Qwen3-MoE (Qwen3 with top-k routed experts), MiMo (Qwen2 + MTP layers), GLM-4.5 (qkv bias, partial RoPE, dense
then grouped-top-k MoE layers, NextN MTP layers) and DeepSeek-V3 (GLM-4.5's layout with multi-latent attention,
engine/model_executor/mla.py), by HF names.

Module attribute paths equal the HF checkpoint names (`model.layers.0.self_attn.q_proj.weight`, ...),
so `state_dict()` is the checkpoint and weight updates need no name mapping. The attention of each layer and its
static KV cache: engine/model_executor/attention.py (grouped-query) and mla.py.
"""

from __future__ import annotations

import json
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from itertools import islice
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from slime_spec.common.dtypes import torch_dtype
from slime_spec.engine.kernels import dependent_launches
from slime_spec.engine.kernels.decode_attention import MAX_QUERY_TOKENS
from slime_spec.engine.kernels.decode_attention import supports as attention_kernel_supports
from slime_spec.engine.kernels.ops import Kernels, gated_linear, linear
from slime_spec.engine.model_executor.attention import Attention, KVCache, fuse_linears
from slime_spec.engine.model_executor.attention import apply_rope as apply_rope  # re-exported: tests rotate by it
from slime_spec.engine.model_executor.mla import MLAttention
from slime_spec.engine.model_executor.model_args import ModelArgs
from slime_spec.engine.model_executor.model_args import (
    rope_cos_sin as rope_cos_sin,  # re-exported: tests build cos/sin by it
)
from slime_spec.engine.model_executor.moe import BiasedRouter, GroupedTopkMoeBlock, SparseMoeBlock
from slime_spec.engine.model_executor.norm import RMSNorm
from slime_spec.weight_sync import fp8

# Attention backends for eager calls on CUDA: all but cuDNN's, which builds an execution plan for every new shape
# (about 35 ms on an H100), while eager steps (prefill, a draft's catch-up, a tree verify, an EAGLE3 draft step)
# read a new key count nearly every step. Captured graphs have static shapes and keep cuDNN.
EAGER_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextmanager
def attention_backends(device: torch.device, graphed: bool = False):
    """The context a forward's layers run in: cuDNN left out on CUDA unless the call is (the warm-up of) a captured
    graph, whose shapes are fixed; in a captured graph the kernels launch as programmatic dependents (kernels.pdl)."""
    with sdpa_kernel(EAGER_SDPA_BACKENDS) if device.type == "cuda" and not graphed else nullcontext(), \
            dependent_launches(graphed):
        yield


class MLP(nn.Module):
    def __init__(self, a: ModelArgs, intermediate_size: int | None = None):
        super().__init__()
        intermediate_size = intermediate_size or a.intermediate_size
        self.gate_proj = nn.Linear(a.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, a.hidden_size, bias=False)
        self.gate_up: torch.Tensor | None = None  # fused gate/up weight (CausalLM.fuse_projections)
        self.kernels = Kernels()  # CausalLM.use_kernels

    def forward(self, x):
        if self.gate_up is not None:
            return gated_linear(linear(x, self.gate_up, None, self.kernels), self.down_proj.weight, self.kernels)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def feed_forward(a: ModelArgs, sparse: bool) -> nn.Module:
    """A layer's `mlp`: dense, or (a MoE model's sparse layer) routed experts, GLM-4.5's and DeepSeek-V3's with their
    shared experts."""
    if not (a.num_experts and sparse):
        return MLP(a)
    experts = (MLP(a, a.moe_intermediate_size) for _ in range(a.num_experts))
    if not a.grouped_topk:
        return SparseMoeBlock(a, experts)
    shared = MLP(a, a.moe_intermediate_size * a.n_shared_experts) if a.n_shared_experts else None
    return GroupedTopkMoeBlock(a, experts, shared)


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, sparse: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = MLAttention(a) if a.mla else Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = feed_forward(a, sparse)

    def mlps(self) -> list[MLP]:
        """The layer's SwiGLU MLPs: its one dense MLP, or its experts (and shared experts)."""
        return [m for m in self.mlp.modules() if isinstance(m, MLP)]

    def forward(self, x, cos, sin, cache_k, cache_v, slots, positions, mask, num_keys: int):
        delta = self.self_attn(self.input_layernorm(x), cos, sin, cache_k, cache_v, slots, positions, mask, num_keys)
        normed, x = self.post_attention_layernorm.add_forward(x, delta)
        return x + self.mlp(normed)

    def residual_forward(self, x, pending, cos, sin, cache_k, cache_v, slots, positions, mask, num_keys: int):
        """`forward` of x + pending, returned as (h, delta) with the output h + delta: the residual add is left to
        the next norm, which adds it in its own kernel (SGLang's residual passing), one kernel fewer per layer.
        The sums round as `forward`'s do, so the output is the same bits."""
        if pending is None:
            normed = self.input_layernorm(x)
        else:
            normed, x = self.input_layernorm.add_forward(x, pending)
        delta = self.self_attn(normed, cos, sin, cache_k, cache_v, slots, positions, mask, num_keys)
        normed, x = self.post_attention_layernorm.add_forward(x, delta)
        return x, self.mlp(normed)


class MTPLayer(DecoderLayer):
    """MiMo's `model.mtp_layers.{i}`: norms + input_proj in front of a full decoder layer (see `mtp_forward`)."""

    def __init__(self, a: ModelArgs):
        super().__init__(a)
        self.token_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.hidden_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.input_proj = nn.Linear(2 * a.hidden_size, a.hidden_size, bias=False)
        self.final_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def input_states(self, embeds, hidden, positions, kernels: Kernels) -> torch.Tensor:
        """SGLang's mimo_mtp.py: the token embedding zeroed at position 0, after the hidden state in the concat."""
        embeds = embeds.masked_fill((positions == 0)[..., None], 0.0)
        return linear(torch.cat((self.hidden_layernorm(hidden), self.token_layernorm(embeds)), dim=-1),
                      self.input_proj.weight, None, kernels)

    def output_norm(self) -> RMSNorm:
        return self.final_layernorm


class NextNLayer(DecoderLayer):
    """GLM-4.5's and DeepSeek-V3's `model.layers.{N + i}` as SGLang's Glm4MoeModelNextN / DeepseekModelNextN run it:
    enorm/hnorm/eh_proj in front of a sparse decoder layer, shared_head.norm after it. The checkpoint's copies of the
    embedding and head (`embed_tokens`, `shared_head.head`) are not held: SGLang's NextN runner uses the target's."""

    def __init__(self, a: ModelArgs):
        super().__init__(a, sparse=True)
        self.enorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.hnorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * a.hidden_size, a.hidden_size, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def input_states(self, embeds, hidden, positions, kernels: Kernels) -> torch.Tensor:
        return linear(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1), self.eh_proj.weight, None, kernels)

    def output_norm(self) -> RMSNorm:
        return self.shared_head.norm


NEXTN_SKIPPED = ("embed_tokens.weight", "shared_head.head.weight")  # a NextN layer's copies of the target's


class Backbone(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a, sparse=i >= a.first_k_dense_replace) for i in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        if a.mtp_layers and a.nextn_mtp:
            self.layers.extend(NextNLayer(a) for _ in range(a.mtp_layers))
        elif a.mtp_layers:
            self.mtp_layers = nn.ModuleList(MTPLayer(a) for _ in range(a.mtp_layers))


def causal_mask(positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[B, 1, T, S] boolean: query at position p sees keys at positions 0..p of its own row."""
    keys = torch.arange(num_keys, device=positions.device)
    return (keys[None, None, :] <= positions[:, :, None])[:, None]


class CausalLM(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.graphs: dict = {}  # "target"/"mtp" -> cuda_graph.GraphedForward, set by the engine on CUDA
        self._compiled_layer = None
        self.kernels = Kernels()  # use_kernels
        self.model = Backbone(a)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        if a.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _decoder_layers(self) -> list[DecoderLayer]:
        return list(self.model.layers) + list(getattr(self.model, "mtp_layers", []))

    def mtp_stack(self) -> list[MTPLayer | NextNLayer]:
        """The MTP layers: MiMo's `model.mtp_layers`, or the NextN layers past the target's in `model.layers`."""
        if self.args.nextn_mtp:
            return list(self.model.layers)[self.args.num_layers:]
        return list(getattr(self.model, "mtp_layers", []))

    def is_mtp_weight(self, name: str) -> bool:
        """Whether checkpoint name `name` is an MTP layer's (the draft runner's, not the target's)."""
        if not self.args.nextn_mtp:
            return name.startswith("model.mtp_layers.")
        parts = name.split(".")
        return name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= self.args.num_layers

    def fuse_projections(self) -> None:
        """One matmul for q/k/v and one for gate/up in every layer (fewer, larger kernels: on a GPU a decode step
        is bound by kernel count). The separate parameters stay, as views of the fused tensors, so weight
        loading and checkpoints see the usual names."""
        for layer in self._decoder_layers():
            layer.self_attn.fuse()
            for mlp in layer.mlps():
                mlp.gate_up = fuse_linears([mlp.gate_proj, mlp.up_proj])[0]

    def use_kernels(self, kernels: Kernels) -> None:
        """Route this model's few-row matmuls, causal attention and norms through the Triton kernels (engine/kernels);
        the attention kernel only where it runs this head size (grouped-query heads: not MLA's)."""
        kernels = replace(kernels, attention=kernels.attention and self.args.mla is None
                          and attention_kernel_supports(self.args.head_dim)
                          and self.args.rotary_dim in (0, self.args.head_dim))  # the kernel rotates whole heads
        self.kernels = kernels
        for layer in self._decoder_layers():
            layer.self_attn.kernels = kernels
            for mlp in layer.mlps():
                mlp.kernels = kernels
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.kernels = kernels

    def unfuse_projections(self) -> None:
        """Drop the fused tensors (before weights are released, so their memory goes with the parameters')."""
        for layer in self._decoder_layers():
            layer.self_attn.unfuse()
            for mlp in layer.mlps():
                mlp.gate_up = None

    def cache_bytes(self, slots: int, max_seq: int) -> int:
        """What `new_cache(slots, max_seq)` allocates: keys and values of every layer."""
        a = self.args
        per_token = a.num_kv_heads * (a.head_dim + (a.mla.v_head_dim if a.mla else a.head_dim))
        return a.num_layers * slots * max_seq * per_token * self.lm_head.weight.element_size()

    def new_cache(self, slots: int, max_seq: int, num_layers: int | None = None) -> KVCache:
        a, p = self.args, self.lm_head.weight
        return KVCache(num_layers or a.num_layers, slots, max_seq, a.num_kv_heads, a.head_dim, p.dtype, p.device,
                       v_head_dim=a.mla.v_head_dim if a.mla else None)

    def new_mtp_cache(self, slots: int, max_seq: int) -> KVCache:
        return self.new_cache(slots, max_seq, num_layers=1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                slots: torch.Tensor, num_keys: int | None = None, aux_layer_ids: list[int] | None = None):
        """input_ids/positions [B, T] -> final-normed hidden states [B, T, H] (logits: `self.logits(hidden)`).

        num_keys: keys attention reads per row (at least the longest row's last position + 1); None reads
        the positions back from the device, which a captured CUDA graph cannot do. With a captured graph for
        this cache and shape (`self.graphs`, set by the engine on CUDA), the graph replays instead.
        aux_layer_ids: (hidden, aux) as `eager_forward` returns them (EAGLE3's target forward), from the
        "target_aux" graph when one was captured for those layers.
        """
        if aux_layer_ids:
            graph = self.graphs.get("target_aux")  # captured for the engine's drafter's aux layers
            if graph is not None and graph.serves(cache, input_ids, num_keys):
                out = graph(input_ids, positions, slots, num_keys)
                return out[..., : self.args.hidden_size], out[..., self.args.hidden_size:]
            return self.eager_forward(input_ids, positions, cache, slots, num_keys, aux_layer_ids=aux_layer_ids)
        graph = self.graphs.get("target")
        if graph is not None and graph.serves(cache, input_ids, num_keys):
            return graph(input_ids, positions, slots, num_keys)
        return self.eager_forward(input_ids, positions, cache, slots, num_keys)

    def eager_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                      slots: torch.Tensor, num_keys: int | None = None, compiled: bool = False,
                      aux_layer_ids: list[int] | None = None, cache_positions: torch.Tensor | None = None,
                      attn_mask: torch.Tensor | None = None, graphed: bool = False):
        """compiled: run each decoder layer through `compiled_layer` (--enable-torch-compile; CUDA graphs).
        graphed: the call is (a warm-up of) a captured graph, so attention may use cuDNN (attention_backends).
        aux_layer_ids: also return the outputs of those layers, concatenated [B, T, n * H] (an EAGLE3 draft's
        input: SGLang captures them as the inputs of layers id + 1), as (hidden, aux).
        cache_positions / attn_mask (tree verification, engine/speculative/tree.py): where the keys/values are written
        when
        not at `positions` (which then only rotate), and the [B, 1, T, S] mask replacing the causal one."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.args.cos_sin(positions, x.dtype)
        num_keys, mask = self._attention_keys(positions, num_keys, attn_mask)
        write = positions if cache_positions is None else cache_positions
        aux, pending = [], None  # pending: the last layer's residual delta, added by the next norm
        with attention_backends(x.device, graphed):
            for i, layer in enumerate(islice(self.model.layers, self.args.num_layers)):  # NextN layers follow
                if compiled:
                    x = self.compiled_layer()(layer, x, cos, sin, cache.k[i], cache.v[i], slots, write, mask, num_keys)
                else:
                    x, pending = layer.residual_forward(x, pending, cos, sin, cache.k[i], cache.v[i], slots, write,
                                                        mask, num_keys)
                if aux_layer_ids and i in aux_layer_ids:
                    aux.append(x if pending is None else x + pending)
        normed = self.model.norm(x) if pending is None else self.model.norm.add_forward(x, pending)[0]
        if aux_layer_ids:
            return normed, torch.cat(aux, dim=-1)
        return normed

    def _attention_keys(self, positions: torch.Tensor, num_keys: int | None, attn_mask: torch.Tensor | None
                        ) -> tuple[int, torch.Tensor | None]:
        """(keys attention reads, the mask): the given mask (a tree), None where the decode-attention kernel reads
        the cache causally in place (decode and verify: a few tokens per row), else the causal mask."""
        if attn_mask is not None:
            return num_keys or attn_mask.shape[-1], attn_mask
        num_keys = num_keys or int(positions.max()) + 1  # a read-back: captured graphs always pass num_keys
        in_place = self.kernels.attention and positions.shape[1] <= MAX_QUERY_TOKENS
        return num_keys, None if in_place else causal_mask(positions, num_keys)

    def compiled_layer(self):
        """One decoder layer's forward under torch.compile, shared by every layer (parameters are inputs, shapes
        dynamic): the elementwise ops fuse into a few kernels, which a captured graph then replays. Compiling
        one layer rather than the whole forward keeps the compile to seconds."""
        if self._compiled_layer is None:
            # Every layer, model and shape class (batch or tokens of 1 specialise) shares this function's compiled
            # code; several engines in one process (the benches) pass dynamo's default of 8 variants, after which
            # it would silently run eagerly.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._compiled_layer = torch.compile(DecoderLayer.forward, dynamic=True)
        return self._compiled_layer

    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """The lm_head's logits, in float32 unless not `upcast` (the sampling kernel reads the model's dtype)."""
        out = linear(hidden, self.lm_head.weight, None, self.kernels)
        return out.float() if upcast else out

    def mtp_forward(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor,
                    cache: KVCache, slots: torch.Tensor, layer: int = 0, num_keys: int | None = None) -> torch.Tensor:
        """One MTP layer, as SGLang's MiMoMultiTokenPredictorLayer or Glm4MoeModelNextN / DeepseekModelNextN runs it.

        At position p it reads the token x_{p+1} and the hidden state of position p (the target's final-normed
        hidden, or this layer's own output when drafting further), projects the normed pair (`input_states`: MiMo
        `cat(hidden_layernorm(hidden), token_layernorm(embed))` with the embedding zeroed at position 0, NextN
        `eh_proj(cat(enorm(embed), hnorm(hidden)))`), runs the decoder layer, and returns its output norm: both what
        the shared lm_head reads and the hidden state of the next draft step.
        """
        graph = self.graphs.get("mtp") if layer == 0 else None
        if graph is not None and graph.serves(cache, input_ids, num_keys):
            return graph(input_ids, positions, slots, num_keys, prev_hidden=prev_hidden)
        return self.eager_mtp_forward(input_ids, prev_hidden, positions, cache, slots, layer, num_keys)

    def eager_mtp_forward(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor,
                          cache: KVCache, slots: torch.Tensor, layer: int = 0,
                          num_keys: int | None = None, compiled: bool = False,
                          cache_positions: torch.Tensor | None = None,
                          attn_mask: torch.Tensor | None = None, graphed: bool = False) -> torch.Tensor:
        """cache_positions / attn_mask / graphed: as in `eager_forward` (tree drafting: each draft-tree node at a
        cache location of its own, seeing its ancestors)."""
        mtp = self.mtp_stack()[layer]
        x = mtp.input_states(self.model.embed_tokens(input_ids), prev_hidden, positions, self.kernels)
        cos, sin = self.args.cos_sin(positions, x.dtype)
        num_keys, mask = self._attention_keys(positions, num_keys, attn_mask)
        write = positions if cache_positions is None else cache_positions
        with attention_backends(x.device, graphed):
            if compiled:
                return mtp.output_norm()(self.compiled_layer()(mtp, x, cos, sin, cache.k[0], cache.v[0], slots,
                                                               write, mask, num_keys))
            x, pending = mtp.residual_forward(x, None, cos, sin, cache.k[0], cache.v[0], slots, write, mask, num_keys)
        return mtp.output_norm().add_forward(x, pending)[0]


def hf_weight_names(model: CausalLM) -> list[str]:
    """The checkpoint names of a model's tensors (a tied lm_head is not a separate tensor in HF checkpoints)."""
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    if model.args.tie_word_embeddings:
        names.remove("lm_head.weight")
    return names


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu") -> tuple[CausalLM, dict]:
    """Build the model from `path/config.json` and load every tensor of `path/*.safetensors` by HF name."""
    path = Path(path)
    weight_dtype = torch_dtype(dtype)  # refuses an unknown name before any work
    config = json.loads((path / "config.json").read_text())
    args = ModelArgs.from_hf_config(config)
    with torch.device("meta"):
        model = CausalLM(args)
    model = model.to_empty(device=device).to(weight_dtype)
    for module in model.modules():
        if isinstance(module, BiasedRouter):
            module.keep_float32()
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"--model-path {path}: no *.safetensors files")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    try:
        scheme = fp8.Fp8BlockScheme.from_hf_config(config)
        if scheme is not None:  # held dequantized: this engine computes in its own dtype
            state = fp8.dequantize_state(state, scheme)
    except fp8.Fp8ConfigError as e:
        raise ValueError(f"--model-path {path}: {e}") from None
    expected = set(hf_weight_names(model))
    ignored = {n for n in state if "rotary_emb.inv_freq" in n or (n == "lm_head.weight" and args.tie_word_embeddings)
               or (model.is_mtp_weight(n) and n.endswith(NEXTN_SKIPPED))}
    missing = expected - set(state)
    unknown = set(state) - expected - ignored
    if missing or unknown:
        raise ValueError(f"checkpoint {path} does not match {config['architectures'][0]}: "
                         f"missing {sorted(missing)[:5]}, unexpected {sorted(unknown)[:5]}")
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name in expected:
            if params[name].shape != state[name].shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(state[name].shape)} != "
                                 f"config shape {tuple(params[name].shape)}")
            params[name].copy_(state[name])
    return model.eval().requires_grad_(False), config
