"""What a request is inside the embedded engine: its sampling parameters (SGLang's names and defaults), the request,
the row the scheduler keeps for it while it runs, the output it returns, and the eos ids it stops at."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

NAN_FINISH = {"type": "stop", "matched": "NaN happened"}  # SGLang's FINISH_MATCHED_STR for non-finite logits


@dataclass
class SamplingParams:
    """SGLang's names and defaults (sglang/srt/sampling/sampling_params.py)."""

    temperature: float = 1.0     # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1              # -1 = off
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    def validate(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not (self.temperature >= 0 and self.temperature != float("inf")):
            raise ValueError(f"temperature must be a non-negative finite number, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if self.max_new_tokens is None or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    history: object = None  # drafters.history.HistoryRef: the slime-spec extension `slime_history`


@dataclass
class Output:
    rid: str
    output_ids: list[int]
    output_logprobs: list[float] | None   # the target's logprob of each output token (see sampling.py)
    finish_reason: dict                   # SGLang's finish_reason JSON: length | stop (matched) | abort
    prompt_tokens: int
    completion_tokens: int
    spec_verify_ct: int                   # verify passes of this request
    spec_accept_token_num: int            # accepted draft tokens (bonus tokens excluded)
    spec_draft_token_num: int             # draft tokens proposed
    text: str                             # detokenized output


@dataclass(eq=False)
class Row:
    """A request while it is admitted: what the scheduler and the drafters keep for it (compared by identity)."""

    req: Request
    slot: int = -1
    tokens: list[int] = field(default_factory=list)  # prompt + output
    kv_len: int = 0                                  # tokens in the target KV cache: all but the pending last
    logprobs: list[float] = field(default_factory=list)
    finish: dict | None = None
    verify_ct: int = 0
    accept_num: int = 0
    draft_num: int = 0
    draft_cached_len: int = 0                        # STANDALONE: tokens in the draft model's KV cache
    draft_state: dict = field(default_factory=dict)  # drafters' per-row state (n-gram hashes, history cursors)
    ngram_upto: int = 1                              # NGRAM: n-grams ending before this position are indexed

    @property
    def prompt_len(self) -> int:
        return len(self.req.input_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]


def eos_ids(model_path: Path, config: dict, tokenizer) -> set[int]:
    """The token ids a request stops at: config.json's, generation_config.json's and the tokenizer's eos ids."""
    ids: set[int] = set()
    sources = [config.get("eos_token_id")]
    gen = model_path / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    sources.append(tokenizer.eos_token_id)
    for s in sources:
        if isinstance(s, int):
            ids.add(s)
        elif isinstance(s, list):
            ids.update(int(x) for x in s)
    return ids
