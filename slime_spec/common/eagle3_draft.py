"""The EAGLE3 draft head in plain torch, laid out as SGLang 0.5.23's `LlamaForCausalLMEagle3` loads it.

One draft step, per token position i (what SGLang's llama_eagle3 model computes):
  hidden   = fc(cat[aux_0, aux_1, aux_2])      the target's residual stream after three of its layers
             (or, on later steps, the draft's own pre-norm output of the previous step: fc is skipped)
  x        = cat[input_layernorm(embed(token)), hidden_norm(hidden)]     2 * hidden_size wide
  residual = hidden + o_proj(attention(x))     q/k/v read the 2H-wide x, RoPE at the token's position
  out      = residual + mlp(post_attention_layernorm(residual))          fed to the next step
  logits   = lm_head(norm(out))                over the draft vocabulary; draft id d is target id d + d2t[d]
The embedding is the target's (SGLang shares it; the draft checkpoint has none).

Checkpoint names (the published EAGLE3 layout; SGLang renames `midlayer` to `layers.0` and prefixes
`model.`): fc.weight, midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight,
midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight, norm.weight,
lm_head.weight, and the buffers d2t [draft_vocab] (int64 offsets) and t2d [vocab] (bool).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from slime_spec.common import rope

ARCHITECTURE = "LlamaForCausalLMEagle3"
AUX_IDS_FIELD = "eagle_aux_hidden_state_layer_ids"  # in the draft config's `eagle_config`
CHECKPOINT_FILE = "model.safetensors"


def default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """SGLang's default: it captures the inputs of layers 2, L//2 and L-3, i.e. the outputs of these layers."""
    return [1, num_target_layers // 2 - 1, num_target_layers - 4]


def aux_layer_ids(draft_config: dict, num_target_layers: int) -> list[int]:
    """The target layers whose outputs the draft reads, in SGLang's capture (layer) order.

    `eagle_config.eagle_aux_hidden_state_layer_ids` names them (SGLang captures the output of layer id, as
    the input of layer id + 1); without it SGLang's default applies.
    """
    explicit = (draft_config.get("eagle_config") or {}).get(AUX_IDS_FIELD)
    ids = list(explicit) if explicit else default_aux_layer_ids(num_target_layers)
    if len(set(ids)) != len(ids) or any(not 0 <= i <= num_target_layers - 2 for i in ids):
        raise ValueError(f"EAGLE3 aux layer ids {ids} for a target with {num_target_layers} layers: SGLang "
                         f"captures distinct layers 0..{num_target_layers - 2}; set eagle_config."
                         f"{AUX_IDS_FIELD} in the draft's config.json")
    return sorted(ids)  # SGLang appends captures as its layer loop reaches them


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the half-split (non-interleaved) layout of HF Llama and SGLang."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], dim=-1) * sin


class Eagle3Draft(nn.Module):
    """An EAGLE3 draft head; parameter and buffer names are the checkpoint's."""

    def __init__(self, config: dict, num_aux: int = 3):
        super().__init__()
        self.config = config
        h = config["hidden_size"]
        h_in = config.get("target_hidden_size") or h
        self.heads = config["num_attention_heads"]
        self.kv_heads = config.get("num_key_value_heads") or self.heads
        self.head_dim = rope.head_dim_of(config)
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.draft_vocab_size = int(config.get("draft_vocab_size") or config["vocab_size"])
        if config.get("tie_word_embeddings"):
            raise ValueError("EAGLE3 draft config has tie_word_embeddings=true: SGLang then reads logits from the "
                             "target embedding; this trainer needs the draft's own lm_head (set it false)")
        if int(config.get("num_hidden_layers", 1)) != 1:
            raise ValueError(f"EAGLE3 draft num_hidden_layers={config['num_hidden_layers']}: only one-layer "
                             f"drafts are supported (SGLang's published EAGLE3 drafts)")
        i = config["intermediate_size"]
        self.fc = nn.Linear(num_aux * h_in, h, bias=False)
        self.midlayer = nn.Module()
        m = self.midlayer
        m.input_layernorm = _Norm(h)
        m.hidden_norm = _Norm(h)
        m.post_attention_layernorm = _Norm(h)
        m.self_attn = nn.Module()
        m.self_attn.q_proj = nn.Linear(2 * h, self.heads * self.head_dim, bias=False)
        m.self_attn.k_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=False)
        m.self_attn.v_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=False)
        m.self_attn.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        m.mlp = nn.Module()
        m.mlp.gate_proj = nn.Linear(h, i, bias=False)
        m.mlp.up_proj = nn.Linear(h, i, bias=False)
        m.mlp.down_proj = nn.Linear(i, h, bias=False)
        self.norm = _Norm(h)
        self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config["vocab_size"], dtype=torch.bool))
        self.register_buffer("inv_freq", rope.inv_freq(rope.rope_spec(config), self.head_dim), persistent=False)

    # ------------------------------------------------------------ pieces
    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[..., num_aux * target_hidden] -> [..., hidden]: the first step's hidden input."""
        return self.fc(aux_hidden)

    def draft_to_target(self) -> torch.Tensor:
        """Target token id of each draft id (SGLang's hot_token_id)."""
        return self.d2t + torch.arange(self.draft_vocab_size, device=self.d2t.device)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(rms_norm(out, self.norm.weight, self.eps))

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """q [b, heads, s, d] and k, v [b, kv_heads, s, d] of one step, RoPE applied."""
        m = self.midlayer
        x = torch.cat([rms_norm(embeds, m.input_layernorm.weight, self.eps),
                       rms_norm(hidden, m.hidden_norm.weight, self.eps)], dim=-1)
        b, s, _ = x.shape
        q = m.self_attn.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = m.self_attn.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = m.self_attn.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        angles = positions.to(self.inv_freq.dtype)[..., None] * self.inv_freq  # [b, s, d/2]
        cos = torch.cat([angles, angles], -1).cos()[:, None].to(x.dtype)
        sin = torch.cat([angles, angles], -1).sin()[:, None].to(x.dtype)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual, post-attention norm, MLP: the step's pre-norm output from the attention output."""
        m = self.midlayer
        b, _, s, _ = attn.shape
        residual = hidden + m.self_attn.o_proj(attn.transpose(1, 2).reshape(b, s, -1))
        x = rms_norm(residual, m.post_attention_layernorm.weight, self.eps)
        return residual + m.mlp.down_proj(F.silu(m.mlp.gate_proj(x)) * m.mlp.up_proj(x))

    # ------------------------------------------------------------ one step
    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One causal draft step over whole rows: (draft-vocab logits [b, s, Vd], pre-norm output [b, s, H]).

        hidden: aux states [b, s, num_aux * Ht] (projected by fc) or a previous step's output [b, s, H].
        attention_mask: [b or 1, 1, s, s] bool, True = masked (default causal).
        """
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = self.project(hidden)
        q, k, v = self.qkv(embeds, hidden, positions)
        s = q.shape[2]
        if attention_mask is None:
            attention_mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)[None, None]
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, enable_gqa=True)
        out = self.finish(hidden, attn)
        return self.logits(out), out


class _Norm(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


def trainable_state(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    """The draft's own tensors (checkpoint names): every parameter and the d2t / t2d maps."""
    return {n: t.detach() for n, t in draft.state_dict().items()}


def read_draft_config(path: str | Path) -> dict:
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"--sglang-speculative-draft-model-path {path}: no config.json there")
    config = json.loads(config_path.read_text())
    if ARCHITECTURE not in (config.get("architectures") or []):
        raise ValueError(f"--sglang-speculative-draft-model-path {path}: architectures "
                         f"{config.get('architectures')} is not [{ARCHITECTURE!r}] (an EAGLE3 draft)")
    return config


def load_draft(path: str | Path, num_target_layers: int) -> Eagle3Draft:
    """An Eagle3Draft from an SGLang-layout EAGLE3 checkpoint directory (float32, strict)."""
    from safetensors.torch import load_file

    config = read_draft_config(path)
    draft = Eagle3Draft(config, num_aux=len(aux_layer_ids(config, num_target_layers)))
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(str(f)))
    for name, tensor in state.items():
        if tensor.is_floating_point():
            state[name] = tensor.float()
    state["d2t"] = state["d2t"].long() if "d2t" in state else draft.d2t
    state["t2d"] = state["t2d"].bool() if "t2d" in state else draft.t2d
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"EAGLE3 draft {path} does not match {ARCHITECTURE}: missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)}")
    return draft


def save_draft(draft: Eagle3Draft, path: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json + model.safetensors in the SGLang EAGLE3 layout."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(draft.config, indent=2))
    tensors = {n: (t.to(dtype) if t.is_floating_point() else t).contiguous().cpu()
               for n, t in trainable_state(draft).items()}
    save_file(tensors, str(out / CHECKPOINT_FILE), metadata={"format": "pt"})
    return out
