"""`Sample`: one response to one prompt, as the rollout produces it and the trainer consumes it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum


class Status(str, Enum):
    COMPLETED = "completed"
    TRUNCATED = "truncated"  # hit max_new_tokens / context length
    ABORTED = "aborted"  # failed repeatedly or was aborted; `error` says why


@dataclass
class SpecStats:
    """Raw speculative counters summed over every request this sample made.

    Summing raw counters (not averaging per-request ratios) keeps a sample that spans several
    requests (partial rollout, multi-turn) weighted by its tokens.
    """

    completion_tokens: int = 0
    verify_ct: int = 0
    accept_token_num: int | None = None  # only where the server reports it
    draft_token_num: int | None = None

    # meta_info names of the accepted / drafted counters: SGLang 0.5.23 first, then the names of the
    # releases around PR #13754. A server sends one spelling (the embedded engine sends both, equal).
    ACCEPTED_KEYS = ("spec_num_correct_drafts", "spec_accept_token_num")
    DRAFTED_KEYS = ("spec_num_proposed_drafts", "spec_draft_token_num")

    def add_meta_info(self, meta: dict) -> None:
        self.completion_tokens += int(meta.get("completion_tokens", 0))
        self.verify_ct += int(meta.get("spec_verify_ct") or 0)
        for keys, attr in ((self.ACCEPTED_KEYS, "accept_token_num"), (self.DRAFTED_KEYS, "draft_token_num")):
            value = next((meta[k] for k in keys if meta.get(k) is not None), None)
            if value is not None:
                setattr(self, attr, (getattr(self, attr) or 0) + int(value))

    @property
    def accept_length(self) -> float:
        """Tokens per verify pass, as SGLang's tests compute it (1.0 without a verify pass)."""
        return self.completion_tokens / self.verify_ct if self.verify_ct else 1.0


@dataclass
class Sample:
    index: int  # position in the rollout batch
    group_index: int  # which prompt; the n samples of a prompt share it (GRPO groups)
    prompt: str | list[dict]
    label: str | None = None
    tokens: list[int] = field(default_factory=list)  # prompt + response token ids
    response: str = ""
    response_length: int = 0
    rollout_log_probs: list[float] = field(default_factory=list)  # target model's, one per response token
    loss_mask: list[int] | None = None  # 1 for tokens the policy generated; None means all response tokens
    reward: float | None = None
    status: Status = Status.COMPLETED
    error: str | None = None
    meta_info: dict = field(default_factory=dict)  # the engine's last meta_info
    spec: SpecStats = field(default_factory=SpecStats)
    engine_index: int | None = None
    weight_version: str | None = None  # the policy weights that generated it (the engine's meta_info)
    metadata: dict = field(default_factory=dict)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    def to_dict(self) -> dict:
        d = asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Sample":
        d = dict(d)
        d["status"] = Status(d["status"])
        d["spec"] = SpecStats(**d["spec"])
        return cls(**d)
