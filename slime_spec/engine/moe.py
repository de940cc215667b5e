"""Qwen3-MoE's sparse MLP for the embedded engine (engine/model.py): its config fields and the routed-experts block.

A layer's `mlp` is a router (`mlp.gate`) and `num_experts` SwiGLU experts (`mlp.experts.{e}.{gate,up,down}_proj`),
by the checkpoint's names, so weight updates and checkpoints need no name mapping.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from slime_spec.engine.model import ModelArgs

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)


def moe_fields(config: dict, arch: str) -> dict:
    """ModelArgs' MoE fields from an HF config.json (none for a dense architecture, whose defaults say dense)."""
    if arch not in MOE_ARCHITECTURES:
        return {}
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
