"""Drafters: propose k tokens per running row; the engine verifies them with one batched target forward.

Every drafter here drafts greedily (SGLang's eagle_topk 1 chain picks the draft's argmax; NGRAM copies tokens),
so the draft distribution q is one-hot and verification (see sampling.speculative_accept) is lossless.

Row state the engine keeps (see core._Row): `tokens` (prompt + output), `kv_len` (tokens whose keys/values are
in the target cache: all but the last, pending one), `slot` (cache row). The settings come from
`slime_spec.spec.SpecConfig`, resolved and checked for this engine before `make_drafter` runs.

Drafter protocol:
  k                                   draft tokens per verify (SpecConfig.draft_tokens_per_verify)
  on_prefill(rows, hidden)            after the target prefilled rows and appended their first token
  propose(rows) -> LongTensor [B, k]  draft tokens following each row's pending token
  on_verify(rows, hidden, accepted)   after the verify pass appended accepted[i] + 1 tokens to rows[i]
  weight_runner() -> {hf name: param} the draft's weights, as SGLang's draft runner loads them (or None)
  new_cache() / drop_cache()          (re)allocate or free the drafter's KV cache
"""

from __future__ import annotations

import torch

from slime_spec.engine.model import CausalLM, KVCache, hf_weight_names, load_model
from slime_spec.spec import Algorithm, SpecConfig

def _pad(seqs: list[list[int]], device) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    return torch.tensor([s + [0] * (width - len(s)) for s in seqs], dtype=torch.long, device=device)


def _slots(rows, device) -> torch.Tensor:
    return torch.tensor([r.slot for r in rows], dtype=torch.long, device=device)


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
        slots = _slots(rows, tokens.device)
        out = self.target.mtp_forward(tokens, hidden, positions, self.cache, slots)
        out = out[torch.arange(len(rows), device=out.device), last]
        self.next_token[slots] = self.target.logits(out).argmax(-1)
        self.next_hidden[slots] = out

    def on_prefill(self, rows, hidden: torch.Tensor) -> None:
        device = hidden.device
        tokens = _pad([r.tokens[1:] for r in rows], device)  # x_1..x_n: prompt shifted, plus the first output
        positions = torch.arange(tokens.shape[1], device=device)[None].expand_as(tokens)
        last = torch.tensor([len(r.tokens) - 2 for r in rows], device=device)
        self._extend(rows, tokens, hidden[:, : tokens.shape[1]], positions, last)

    def propose(self, rows) -> torch.Tensor:
        device = self.next_token.device
        slots = _slots(rows, device)
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
        tokens = _pad([r.tokens[len(r.tokens) - a - 1:] for r, a in zip(rows, accepted)], device)
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


class StandaloneDrafter:
    """STANDALONE: a separate small causal LM with its own KV cache, drafting greedily k tokens per verify.

    `r.draft_cached_len` counts the tokens of row r whose keys/values the draft cache holds; after a verify only the
    accepted prefix of what the draft consumed stays, and the next propose first catches up on the rest.
    """

    def __init__(self, draft: CausalLM, k: int, slots: int, max_seq: int):
        self.draft, self.k, self.slots, self.max_seq = draft, k, slots, max_seq
        self.cache: KVCache | None = None
        self.new_cache()

    def new_cache(self) -> None:
        self.cache = self.draft.new_cache(self.slots, self.max_seq)

    def drop_cache(self) -> None:
        self.cache = None

    def _feed(self, rows, seqs: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Run the draft over seqs[i] at positions starts[i]...; return the logits at each row's last token."""
        device = self.draft.lm_head.weight.device
        tokens = _pad(seqs, device)
        positions = torch.tensor(starts, device=device)[:, None] + torch.arange(tokens.shape[1], device=device)
        hidden = self.draft(tokens, positions, self.cache, _slots(rows, device))
        last = torch.tensor([len(s) - 1 for s in seqs], device=device)
        return self.draft.logits(hidden[torch.arange(len(rows), device=device), last])

    def on_prefill(self, rows, hidden: torch.Tensor) -> None:
        self._feed(rows, [r.tokens[:-1] for r in rows], [0] * len(rows))
        for r in rows:
            r.draft_cached_len = len(r.tokens) - 1

    def propose(self, rows) -> torch.Tensor:
        logits = self._feed(rows, [r.tokens[r.draft_cached_len:] for r in rows], [r.draft_cached_len for r in rows])
        token = logits.argmax(-1)
        drafts = [token]
        device = token.device
        slots = _slots(rows, device)
        pos = torch.tensor([len(r.tokens) for r in rows], device=device)
        for j in range(self.k - 1):
            hidden = self.draft(token[:, None], (pos + j)[:, None], self.cache, slots)
            token = self.draft.logits(hidden[:, 0]).argmax(-1)
            drafts.append(token)
        return torch.stack(drafts, dim=1)

    def on_verify(self, rows, hidden: torch.Tensor, accepted: list[int]) -> None:
        for r, a in zip(rows, accepted):
            # The draft consumed the old pending token and d_1..d_{k-1}; valid are the pending token and d_1..d_a.
            r.draft_cached_len = r.kv_len - a + min(a, self.k - 1)

    def weight_runner(self) -> dict[str, torch.nn.Parameter]:
        params = dict(self.draft.named_parameters(remove_duplicate=False))
        return {n: params[n] for n in hf_weight_names(self.draft)}


class NgramDrafter:
    """NGRAM: copy the continuation of the longest earlier match of the row's suffix in its own prompt + output.

    SGLang keeps a trie over recent requests; this is a per-request suffix index (n-gram -> the position right
    after its latest occurrence), updated incrementally. Rows with no match get filler drafts, which verification
    rejects at no cost to correctness.
    """

    def __init__(self, k: int, max_window: int, min_window: int, device):
        self.k, self.max_window, self.min_window, self.device = k, max_window, min_window, device

    def new_cache(self) -> None:
        return None

    def drop_cache(self) -> None:
        return None

    def _index(self, r) -> None:
        tokens = r.tokens
        # An n-gram ending right before position e is indexed once tokens[e] (its continuation) exists.
        for e in range(r.ngram_upto, len(tokens)):
            for w in range(1, min(self.max_window, e) + 1):
                r.ngram_index[tuple(tokens[e - w:e])] = e
        r.ngram_upto = len(tokens)

    def draft_for(self, r) -> list[int]:
        self._index(r)
        tokens = r.tokens
        for w in range(min(self.max_window, len(tokens)), self.min_window - 1, -1):
            e = r.ngram_index.get(tuple(tokens[-w:]))
            if e is not None:
                found = tokens[e:e + self.k]
                return found + [found[-1]] * (self.k - len(found))
        return [tokens[-1]] * self.k

    def on_prefill(self, rows, hidden: torch.Tensor) -> None:
        for r in rows:
            self._index(r)

    def propose(self, rows) -> torch.Tensor:
        return torch.tensor([self.draft_for(r) for r in rows], dtype=torch.long, device=self.device)

    def on_verify(self, rows, hidden: torch.Tensor, accepted: list[int]) -> None:
        return None

    def weight_runner(self) -> None:
        return None


def make_drafter(spec: SpecConfig | None, target: CausalLM, slots: int, max_seq: int, dtype: str, device: str):
    """The drafter for `spec` (None without speculation); `spec.check_resolved` must have passed."""
    if spec is None:
        return None
    k = spec.draft_tokens_per_verify
    algorithm = spec.speculative_algorithm
    if algorithm is Algorithm.EAGLE:
        return MTPDrafter(target, k, slots, max_seq)
    if algorithm is Algorithm.STANDALONE:
        path = spec.speculative_draft_model_path
        draft, config = load_model(path, dtype=dtype, device=device)
        if draft.args.vocab_size != target.args.vocab_size:
            raise ValueError(f"--speculative-draft-model-path {path}: vocab_size {draft.args.vocab_size} != the "
                             f"target's {target.args.vocab_size}; STANDALONE needs a draft with the target's "
                             "tokenizer")
        return StandaloneDrafter(draft, k, slots, max_seq)
    if algorithm is Algorithm.NGRAM:
        # SGLang 0.5.23's trie matches suffixes of every length up to max_trie_depth (no minimum-window flag).
        return NgramDrafter(k, spec.speculative_ngram_max_trie_depth, 1, device)
    raise ValueError(f"speculative_algorithm={algorithm}: no drafter in the embedded engine "
                     "(spec.check_resolved refuses it first)")
