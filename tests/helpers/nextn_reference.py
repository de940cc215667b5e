"""A NextN (MTP) layer's logits computed outside the engine, for the MoE families whose NextN layer SGLang wires the
same way (Glm4MoeModelNextN, DeepseekModelNextN): eh_proj(cat(enorm(embed(next token)), hnorm(target hidden))),
transformers' own sparse decoder layer, shared_head.norm, and the target's lm_head (SGLang's NextN runner shares the
target's embedding and head)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file


def nextn_logits(hf, path: Path, layer_idx: int, decoder_layer_cls, rms_norm_cls, ids: torch.Tensor,
                 next_ids: torch.Tensor, causal_mask: bool = False) -> torch.Tensor:
    """`hf`: transformers' model of the target at `path`; the NextN layer is `model.layers.{layer_idx}` there.
    `causal_mask`: pass an explicit additive causal mask (a layer that does not mask by itself)."""
    config = hf.config
    prefix = f"model.layers.{layer_idx}."
    w = {k[len(prefix):]: v for k, v in load_file(str(path / "model.safetensors")).items() if k.startswith(prefix)}
    layer = decoder_layer_cls(config, layer_idx=layer_idx).eval()
    experts = range(config.n_routed_experts)  # transformers packs the experts: [E, 2I, H] gate then up, [E, H, I]
    w["mlp.experts.gate_up_proj"] = torch.stack([
        torch.cat((w.pop(f"mlp.experts.{e}.gate_proj.weight"), w.pop(f"mlp.experts.{e}.up_proj.weight")))
        for e in experts])
    w["mlp.experts.down_proj"] = torch.stack([w.pop(f"mlp.experts.{e}.down_proj.weight") for e in experts])
    own = {n: w.pop(n) for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                                  "embed_tokens.weight", "shared_head.head.weight")}
    layer.load_state_dict(w, strict=True)
    norms = {n: rms_norm_cls(config.hidden_size, config.rms_norm_eps) for n in ("enorm", "hnorm", "shared_head")}
    for n, norm in norms.items():
        norm.weight.data.copy_(own[f"{n}.norm.weight" if n == "shared_head" else f"{n}.weight"])
    with torch.no_grad():
        hidden = hf.model(ids).last_hidden_state
        x = torch.cat((norms["enorm"](hf.model.embed_tokens(next_ids)), norms["hnorm"](hidden)), -1) @ own[
            "eh_proj.weight"].T
        positions = torch.arange(ids.shape[1])[None].expand_as(ids)
        mask = torch.full((ids.shape[1], ids.shape[1]), float("-inf")).triu(1)[None, None] if causal_mask else None
        out = layer(x, attention_mask=mask, position_ids=positions,
                    position_embeddings=hf.model.rotary_emb(x, positions))
        out = out[0] if isinstance(out, tuple) else out
        return hf.lm_head(norms["shared_head"](out))
