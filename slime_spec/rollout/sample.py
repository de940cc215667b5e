"""`Sample`: one response to one prompt, as the rollout produces it and the trainer consumes it."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import asdict, dataclass, field
from enum import Enum

from slime_spec.speculative.stats import SpecStats


class Status(str, Enum):
    COMPLETED = "completed"
    TRUNCATED = "truncated"  # hit max_new_tokens / context length
    ABORTED = "aborted"  # failed repeatedly or was aborted; `error` says why


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

    def get_reward_value(self, args=None) -> float | None:
        """The reward, as slime's `Sample.get_reward_value(args)` gives it to filters written for slime (rewards are
        one float here: slime's `--reward-key` is refused)."""
        return self.reward

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


def groups_of(samples: list[Sample]) -> list[list[Sample]]:
    """`samples` cut into their GRPO groups (consecutive samples of one `group_index`), in order."""
    groups: list[list[Sample]] = []
    for s in samples:
        if groups and groups[-1][0].group_index == s.group_index:
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


def fresh_copy(s: Sample) -> Sample:
    """A copy whose mutable fields are new objects (deepcopy's per-token recursion costs ~1 ms a sample)."""
    return dataclasses.replace(s, tokens=list(s.tokens), rollout_log_probs=list(s.rollout_log_probs),
                               loss_mask=None if s.loss_mask is None else list(s.loss_mask),
                               meta_info=copy.deepcopy(s.meta_info), spec=dataclasses.replace(s.spec),
                               metadata=copy.deepcopy(s.metadata))


def exclude_stale(samples: list[Sample], current_version: str | None) -> int:
    """Mark samples generated with other weights than `current_version` ABORTED (never trained on); count."""
    stale = 0
    for s in samples:
        if s.status != Status.ABORTED and s.weight_version != current_version:
            s.status = Status.ABORTED
            s.error = (f"generated with weight version {s.weight_version!r} on engine {s.engine_index}, but the "
                       f"policy is at {current_version!r}: excluded from training")
            stale += 1
    return stale


def served_by(sample: Sample, idx: int, version: str | None) -> Sample:
    """A generated sample marked with its engine, and with the weight version the fleet recorded for it where the
    server did not report one."""
    sample.engine_index = idx
    if sample.weight_version is None:
        sample.weight_version = version
    return sample
