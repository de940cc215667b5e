"""Sparse MLPs for the embedded engine (engine/model_executor/model.py): their config fields and the routed-experts
blocks.

Qwen3-MoE routes by a softmax top-k (`SparseMoeBlock`); GLM-4.5 and DeepSeek-V3 by sigmoid scores with a correction
bias, grouped top-k, a routed scaling factor and shared experts (`GroupedTopkMoeBlock`; DeepSeek-V3's `noaux_tc`
routing). A layer's
`mlp` is a router (`mlp.gate`) and SwiGLU experts (`mlp.experts.{e}.{gate,up,down}_proj`, GLM's
`mlp.shared_experts.*`), by the checkpoint's names, so weight updates and checkpoints need no name mapping.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from slime_spec.common.model_families import DENSE_FIRST_FAMILIES, MOE_FAMILIES, architectures

if TYPE_CHECKING:
    from slime_spec.engine.model_executor.model_args import ModelArgs

MOE_ARCHITECTURES = architectures(MOE_FAMILIES)
# GLM-4.7-Flash (Glm4MoeLite) routes as GLM-4.5 does (SGLang's Glm4MoeLiteGate: a float32 router)
GROUPED_TOPK_ARCHITECTURES = architectures(DENSE_FIRST_FAMILIES)


def moe_fields(config: dict, arch: str) -> dict:
    """ModelArgs' MoE fields from an HF config.json (none for a dense architecture, whose defaults say dense)."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    if arch == "DeepseekV3ForCausalLM":
        return deepseek_v3_fields(config)
    if arch in GROUPED_TOPK_ARCHITECTURES:
        return grouped_topk_fields(config)
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1:
        raise ValueError(f"mlp_only_layers={config.get('mlp_only_layers')}, decoder_sparse_step="
                         f"{config.get('decoder_sparse_step')}: the embedded engine serves Qwen3-MoE with every "
                         "layer sparse (as Qwen3-30B-A3B and Qwen3-235B-A22B); use --rollout-backend sglang")
    return dict(num_experts=int(config["num_experts"]), num_experts_per_tok=int(config["num_experts_per_tok"]),
                moe_intermediate_size=int(config["moe_intermediate_size"]),
                norm_topk_prob=bool(config.get("norm_topk_prob", False)))


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE's `mlp`: a router (`gate`) picks each token's top-k experts; their outputs are summed, weighted by the
    softmax probabilities (renormalized over the k when `norm_topk_prob`), as transformers' and SGLang's Qwen3-MoE.

    Every expert runs on every token, its weight zero where the router did not pick it: shapes stay static (CUDA
    graphs, torch.compile) and a zero weight adds exactly nothing, so the sum is the top-k one, summed in expert
    order. The embedded engine serves small models; this costs num_experts / num_experts_per_tok more MLP work."""

    def __init__(self, a: ModelArgs, experts: Iterable[nn.Module]):
        super().__init__()
        self.a = a
        self.gate = nn.Linear(a.hidden_size, a.num_experts, bias=False)
        self.experts = nn.ModuleList(experts)

    def routing_weights(self, x: torch.Tensor) -> torch.Tensor:
        """[..., num_experts] in x's dtype: the top-k probabilities where picked, 0 elsewhere."""
        probs = F.softmax(F.linear(x, self.gate.weight).float(), dim=-1)
        top, index = torch.topk(probs, self.a.num_experts_per_tok, dim=-1)
        if self.a.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return torch.zeros_like(probs).scatter(-1, index, top).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.routing_weights(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + expert(x) * weights[..., e:e + 1]
        return out


def grouped_topk_fields(config: dict) -> dict:
    """GLM-4.5's MoE fields: layers from `first_k_dense_replace` on are sparse, each with `n_shared_experts` shared
    experts' width of always-on MLP. The MTP (NextN) layer is sparse whatever its index, as SGLang builds it."""
    experts, groups = int(config["n_routed_experts"]), int(config.get("n_group") or 1)
    topk_group, k = int(config.get("topk_group") or 1), int(config["num_experts_per_tok"])
    if experts % groups or experts // groups < 2 or not 1 <= topk_group <= groups \
            or not 1 <= k <= topk_group * experts // groups:
        raise ValueError(f"n_routed_experts={experts}, n_group={groups}, topk_group={topk_group}, num_experts_per_tok="
                         f"{k}: grouped top-k routing needs at least 2 experts per group, 1 <= topk_group <= n_group "
                         "and num_experts_per_tok no more than the kept groups' experts; fix the checkpoint's "
                         "config.json")
    return dict(num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=int(config["moe_intermediate_size"]),
                norm_topk_prob=bool(config.get("norm_topk_prob", False)), grouped_topk=True,
                first_k_dense_replace=int(config.get("first_k_dense_replace") or 0),
                n_shared_experts=int(config.get("n_shared_experts") or 0),
                routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
                n_group=groups, topk_group=topk_group)


def deepseek_v3_fields(config: dict) -> dict:
    """DeepSeek-V3's MoE: GLM-4.5's fields (`noaux_tc`: sigmoid scores, correction bias, grouped top-k), every layer
    from `first_k_dense_replace` on sparse, the router weight in the model's dtype (SGLang's MoEGate)."""
    method, scoring = config.get("topk_method", "noaux_tc"), config.get("scoring_func", "sigmoid")
    if method != "noaux_tc" or scoring != "sigmoid":
        raise ValueError(f"topk_method={method!r}, scoring_func={scoring!r}: the embedded engine routes DeepSeek-V3 "
                         "by 'noaux_tc' over 'sigmoid' scores, as the released checkpoints; use --rollout-backend "
                         "sglang")
    if int(config.get("moe_layer_freq") or 1) != 1:
        raise ValueError(f"moe_layer_freq={config.get('moe_layer_freq')}: the embedded engine serves DeepSeek-V3 with "
                         "every layer from first_k_dense_replace on sparse (moe_layer_freq 1, as released); use "
                         "--rollout-backend sglang")
    return {**grouped_topk_fields(config), "router_float32": bool(config.get("router_fp32", False))}


def grouped_topk_weights(scores: torch.Tensor, correction_bias: torch.Tensor, a: ModelArgs) -> torch.Tensor:
    """Dense routing weights [..., num_experts] (float32) from sigmoid scores, as SGLang's biased_grouped_topk and
    transformers' Glm4MoeTopkRouter: experts are chosen by score + correction bias within the `topk_group` groups
    whose two best biased scores sum highest, weighted by their unbiased scores (renormalized over the k when
    `norm_topk_prob`), times `routed_scaling_factor`; 0 where not chosen."""
    shape = scores.shape
    scores = scores.reshape(-1, a.num_experts)
    choice = scores + correction_bias
    grouped = choice.view(-1, a.n_group, a.num_experts // a.n_group)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    groups = torch.topk(group_scores, k=a.topk_group, dim=-1, sorted=False)[1]
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, groups, True)
    choice = choice.masked_fill(~kept[:, :, None].expand_as(grouped).reshape(choice.shape), float("-inf"))
    index = torch.topk(choice, k=a.num_experts_per_tok, dim=-1, sorted=False)[1]
    top = scores.gather(1, index)
    if a.norm_topk_prob:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    weights = torch.zeros_like(scores).scatter(1, index, top * a.routed_scaling_factor)
    return weights.view(shape)


class BiasedRouter(nn.Module):
    """GLM-4.5's and DeepSeek-V3's `mlp.gate`: the router weight and its score correction bias. SGLang holds the bias
    in float32 whatever the engine's dtype, and GLM-4.5's weight too (`Glm4MoeGate`; DeepSeek-V3's `MoEGate` keeps the
    weight in the model's dtype): `keep_float32`. Scores are computed in float32 either way."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.router_float32 = a.router_float32
        self.weight = nn.Parameter(torch.empty(a.num_experts, a.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(a.num_experts))

    def keep_float32(self) -> None:
        self.e_score_correction_bias.data = self.e_score_correction_bias.data.float()
        if self.router_float32:
            self.weight.data = self.weight.data.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float()).sigmoid()


class GroupedTopkMoeBlock(nn.Module):
    """GLM-4.5's and DeepSeek-V3's sparse `mlp`: routed experts weighted by `grouped_topk_weights`, plus the shared
    experts (one MLP of n_shared_experts * moe_intermediate_size) on every token. As in `SparseMoeBlock`, every routed
    expert runs on every token, weighted 0 where not chosen: static shapes, and the sum is the top-k one."""

    def __init__(self, a: ModelArgs, experts: Iterable[nn.Module], shared_experts: nn.Module | None):
        super().__init__()
        self.a = a
        self.gate = BiasedRouter(a)
        self.experts = nn.ModuleList(experts)
        self.shared_experts = shared_experts

    def routing_weights(self, x: torch.Tensor) -> torch.Tensor:
        """[..., num_experts] in x's dtype."""
        return grouped_topk_weights(self.gate(x), self.gate.e_score_correction_bias.float(), self.a).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.routing_weights(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + expert(x) * weights[..., e:e + 1]
        return out if self.shared_experts is None else out + self.shared_experts(x)
