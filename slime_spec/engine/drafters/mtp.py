"""NEXTN / EAGLE drafting with MiMo's MTP layer 0 (SGLang's EAGLE worker, eagle_topk 1)."""

from __future__ import annotations

import torch

from slime_spec.engine.drafters.base import pad, slots_of
from slime_spec.engine.model import CausalLM, KVCache, hf_weight_names


class MTPDrafter:
    """NEXTN / EAGLE with MiMo's MTP layer 0, driven like SGLang's EAGLE worker drives one MTP layer.

    Draft position p reads (token x_{p+1}, hidden h_p). After each target forward, a draft extend runs over the
    newly verified positions with the target's hidden states (tokens shifted left by one); its last output gives
    the first draft token and hidden. Further draft tokens run the same layer on its own output hidden state.
    """

    def __init__(self, target: CausalLM, k: int, slots: int, max_seq: int):
        self.target, self.k, self.slots, self.max_seq = target, k, slots, max_seq
        device = target.lm_head.weight.device
        self.next_token = torch.zeros(slots, dtype=torch.long, device=device)
        self.next_hidden = torch.zeros(slots, target.args.hidden_size, dtype=target.lm_head.weight.dtype,
                                       device=device)
        self.cache: KVCache | None = None
        self.new_cache()

    def new_cache(self) -> None:
        self.cache = self.target.new_mtp_cache(self.slots, self.max_seq)

    def drop_cache(self) -> None:
        self.cache = None

    def _extend(self, rows, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                last: torch.Tensor) -> None:
        slots = slots_of(rows, tokens.device)
        out = self.target.mtp_forward(tokens, hidden, positions, self.cache, slots)
        out = out[torch.arange(len(rows), device=out.device), last]
        self.next_token[slots] = self.target.logits(out).argmax(-1)
        self.next_hidden[slots] = out

    def on_prefill(self, rows, hidden: torch.Tensor) -> None:
        device = hidden.device
        tokens = pad([r.tokens[1:] for r in rows], device)  # x_1..x_n: prompt shifted, plus the first output
        positions = torch.arange(tokens.shape[1], device=device)[None].expand_as(tokens)
        last = torch.tensor([len(r.tokens) - 2 for r in rows], device=device)
        self._extend(rows, tokens, hidden[:, : tokens.shape[1]], positions, last)

    def propose(self, rows) -> torch.Tensor:
        device = self.next_token.device
        slots = slots_of(rows, device)
        token, hidden = self.next_token[slots], self.next_hidden[slots]
        drafts = [token]
        pos = torch.tensor([r.kv_len for r in rows], device=device)
        for j in range(self.k - 1):
            hidden = self.target.mtp_forward(token[:, None], hidden[:, None], (pos + j)[:, None], self.cache,
                                             slots)[:, 0]
            token = self.target.logits(hidden).argmax(-1)
            drafts.append(token)
        return torch.stack(drafts, dim=1)

    def on_verify(self, rows, hidden: torch.Tensor, accepted: list[int]) -> None:
        device = hidden.device
        k1 = self.k + 1
        # Row i verified positions n..n+k; its newly committed tokens x_{n+1}..x_{n+a+1} are tokens[-(a+1):].
        tokens = pad([r.tokens[len(r.tokens) - a - 1:] for r, a in zip(rows, accepted)], device)
        tokens = torch.nn.functional.pad(tokens, (0, k1 - tokens.shape[1]))
        start = torch.tensor([r.kv_len - a - 1 for r, a in zip(rows, accepted)], device=device)
        positions = start[:, None] + torch.arange(k1, device=device)[None]
        self._extend(rows, tokens, hidden, positions, torch.tensor(accepted, device=device))

    def weight_runner(self) -> dict[str, torch.nn.Parameter]:
        """SGLang's MiMoMTP draft runner loads the MTP layers plus the embedding and lm_head it shares."""
        params = dict(self.target.named_parameters(remove_duplicate=False))
        names = [n for n in hf_weight_names(self.target) if n.startswith("model.mtp_layers.")]
        names += ["model.embed_tokens.weight"] + ([] if self.target.args.tie_word_embeddings else ["lm_head.weight"])
        return {n: params[n] for n in names}
