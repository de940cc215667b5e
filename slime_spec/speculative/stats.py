"""Speculative decoding's counters as SGLang reports them, and the one definition of accept length and rate.

SGLang 0.5.23 reports them in each `/generate` reply's `meta_info` (TokenizerManager's
`_calculate_spec_decoding_metrics`), and only for a request that had a verify pass:
- `spec_verify_ct`: verify passes (target forwards over a draft);
- `spec_num_correct_drafts`: draft tokens the target accepted (the bonus token not counted);
- `spec_num_proposed_drafts`: draft tokens proposed, spec_verify_ct * (speculative_num_draft_tokens - 1);
- `spec_accept_length` and `spec_accept_rate`: that request's ratios, as defined below.
`completion_tokens` is always there. Releases around SGLang PR #13754 named the two draft counters
`spec_accept_token_num` and `spec_draft_token_num`: they are read where 0.5.23's names are absent (the embedded
engine sends both, equal).

- accept length: completion tokens per verify pass, the bonus token included (1.0 without a verify pass: plain
  decoding); what SGLang's tests and its meta_info compute.
- accept rate: accepted / proposed draft tokens, the draft's quality apart from how many tokens a step drafted;
  None where nothing was drafted or the server reports no draft counters.

Over many requests both are ratios of summed counters (token-weighted: `SpecStats.total`). slime's
`spec_accept_length` is instead the mean of per-sample ratios (`mean_accept_length`): short samples weigh as much
as long ones, so the two differ on skewed batches and are never shown as one series.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

# meta_info names of the accepted / proposed draft-token counters: SGLang 0.5.23's first, then the older ones
ACCEPTED_KEYS = ("spec_num_correct_drafts", "spec_accept_token_num")
DRAFTED_KEYS = ("spec_num_proposed_drafts", "spec_draft_token_num")


def accept_length(completion_tokens: int, verify_ct: int) -> float:
    """Tokens per verify pass; 1.0 without any verify pass."""
    return completion_tokens / verify_ct if verify_ct else 1.0


def accept_rate(accepted: int | None, drafted: int | None) -> float | None:
    """Accepted over proposed draft tokens; None when nothing was drafted or the counters are not reported."""
    return accepted / drafted if accepted is not None and drafted else None


@dataclass
class SpecStats:
    """Raw speculative counters summed over requests (one request, a sample's requests, a batch's)."""

    completion_tokens: int = 0
    verify_ct: int = 0
    accept_token_num: int | None = None  # accepted draft tokens; None where the server does not report them
    draft_token_num: int | None = None  # proposed draft tokens

    @classmethod
    def from_meta_info(cls, meta: dict) -> "SpecStats":
        """One `/generate` reply's counters (SGLang omits the spec keys of a request without a verify pass)."""
        stats = cls()
        stats.add_meta_info(meta)
        return stats

    def add_meta_info(self, meta: dict) -> None:
        self.add(SpecStats(int(meta.get("completion_tokens") or 0), int(meta.get("spec_verify_ct") or 0),
                           _first_present(meta, ACCEPTED_KEYS), _first_present(meta, DRAFTED_KEYS)))

    def add(self, other: "SpecStats") -> None:
        self.completion_tokens += other.completion_tokens
        self.verify_ct += other.verify_ct
        if other.accept_token_num is not None:
            self.accept_token_num = (self.accept_token_num or 0) + other.accept_token_num
        if other.draft_token_num is not None:
            self.draft_token_num = (self.draft_token_num or 0) + other.draft_token_num

    @classmethod
    def total(cls, stats: Iterable["SpecStats"]) -> "SpecStats":
        """The counters summed; the draft counters over the items that report both (so the rate compares like
        with like), None when none does."""
        out = cls()
        for s in stats:
            out.completion_tokens += s.completion_tokens
            out.verify_ct += s.verify_ct
            if s.accept_token_num is not None and s.draft_token_num is not None:
                out.accept_token_num = (out.accept_token_num or 0) + s.accept_token_num
                out.draft_token_num = (out.draft_token_num or 0) + s.draft_token_num
        return out

    @property
    def accept_length(self) -> float:
        return accept_length(self.completion_tokens, self.verify_ct)

    @property
    def accept_rate(self) -> float | None:
        return accept_rate(self.accept_token_num, self.draft_token_num)


def mean_accept_length(stats: Iterable[SpecStats]) -> float:
    """slime's `spec_accept_length`: the mean of each item's accept length over the items with a verify pass;
    1.0 when none had one."""
    ratios = [s.accept_length for s in stats if s.verify_ct > 0]
    return sum(ratios) / len(ratios) if ratios else 1.0


def _first_present(meta: dict, keys: tuple[str, ...]) -> int | None:
    return next((int(meta[k]) for k in keys if meta.get(k) is not None), None)
