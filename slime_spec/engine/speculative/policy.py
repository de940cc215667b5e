"""How many draft tokens the next speculative step proposes: fixed, SGLang's adaptive rule, or our auto rule.

Every policy answers `choose(batch_size) -> k` (0 = a plain decode step), the step's `num_steps` as the worker hands
it to the drafter, before a step and is told what the step did through `observe(...)` after it. `max_num_steps`
(SpecConfig.num_steps, or adaptive speculation's largest candidate) sizes the caches.

- FixedSteps: SGLang's static chain (`--speculative-num-steps`).
- AdaptiveSteps: SGLang 0.5.23's `--speculative-adaptive` (sglang/srt/speculative/adaptive_spec_params.py):
  batch-size tiers, each with candidate steps and an EMA of the accepted drafts per request; after a warm-up,
  every few batches a tier moves one candidate down when the EMA falls below it and up when it reaches it.
- AutoSteps (`--spec-auto`, ours): measures the step's own cost online per batch-size bucket and per k (draft and
  verify together, the minimum of recent samples) and the per-token accept rate (EMA), and picks the k that
  maximises expected tokens per second; probes of other k are bounded in steps and in time (see AutoSteps).

`observe` takes the step's draft seconds, verify seconds (target forward, acceptance, sampling, bookkeeping) and
switch seconds: a drafter's one-off catch-up after plain steps (MTP's deferred extends, the tokens a STANDALONE
draft has not seen), the price of leaving k = 0 rather than of drafting, so it is kept out of the step's cost
estimate. A plain step that the overlap schedule launched is observed when it is read back, at the latest by the next
speculative step (SpecWorker.drain_plain_step).
"""

from __future__ import annotations

import bisect
import json
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from slime_spec.engine.speculative.tree import tree_shape
from slime_spec.speculative.settings import ADAPTIVE_TIERS, Algorithm, SpecConfig

# SGLang's per-tier knobs and their defaults (a tier entry overrides the file's top level, which overrides these).
ADAPTIVE_KNOB_DEFAULTS = {"ema_alpha": 0.2, "update_interval": 5, "warmup_batches": 10, "down_hysteresis": -0.25,
                          "up_hysteresis": 0.0, "ceiling_coeff": 0}
# SGLang's default tiers also set the hysteresis per tier (batch 1 keeps the -0.25 default, the others 0).
DEFAULT_TIER_KNOBS = {1: {"down_hysteresis": -0.25}, 8: {"down_hysteresis": 0.0}, 32: {"down_hysteresis": 0.0},
                      64: {"down_hysteresis": 0.0}}


class StepPolicy(Protocol):
    """What every policy answers (module docstring); the speculative worker holds one."""

    max_num_steps: int

    def choose(self, batch_size: int) -> int: ...

    def draft_lengths(self) -> tuple[int, ...]: ...

    def verify_widths(self) -> tuple[int, ...]: ...

    def observe(self, batch_size: int, k: int, accepted: list[int], draft_s: float, verify_s: float,
                switch_s: float = 0.0) -> None: ...


class FixedSteps:
    """Always num_steps (SGLang's static speculative parameters)."""

    def __init__(self, num_steps: int):
        self.max_num_steps = num_steps

    def choose(self, batch_size: int) -> int:
        return self.max_num_steps

    def draft_lengths(self) -> tuple[int, ...]:
        """Every k > 0 `choose` may return (what the engine captures a draft chain graph for)."""
        return (self.max_num_steps,) if self.max_num_steps > 0 else ()

    def verify_widths(self) -> tuple[int, ...]:
        """Every width of a decode step's target forward: k + 1 for each k `choose` may return (1: a plain step);
        what the engine captures the target's graphs for."""
        return (self.max_num_steps + 1,)

    def observe(self, batch_size: int, k: int, accepted: list[int], draft_s: float, verify_s: float,
                switch_s: float = 0.0) -> None:
        return None


@dataclass
class AdaptiveTier:
    """One batch-size tier: candidate steps, the EMA of accepted drafts per request, and the current steps."""

    candidates: list[int]
    current: int
    ema: float
    ema_alpha: float = 0.2
    update_interval: int = 5
    warmup_batches: int = 10
    down_hysteresis: float = -0.25
    up_hysteresis: float = 0.0
    ceiling_coeff: float = 0
    batches: int = 0

    def observe(self, k: int, accepted: list[int]) -> None:
        """One batch's accepted drafts per request; a plain step (k = 0) counts as a batch, not as acceptance."""
        if not accepted:
            return
        if k > 0:
            self.ema += self.ema_alpha * (sum(accepted) / len(accepted) - self.ema)
        self.batches += 1
        after_warmup = self.batches - self.warmup_batches
        if after_warmup > 0 and after_warmup % self.update_interval == 0:
            self.current = self._target()

    def _target(self) -> int:
        c, i = self.candidates, self.candidates.index(self.current)
        if self.current == 0:  # after a plain interval, probe the smallest positive candidate
            nxt = c[min(i + 1, len(c) - 1)]
            if nxt > 0 and self.ema < 0:
                self.ema = float(nxt - 1)
            return nxt
        start = i
        while i > 0 and self.ema <= (0.5 if c[i - 1] == 0 else c[i - 1] - 0.5) + self.down_hysteresis:
            i -= 1
        if i == start:
            while i < len(c) - 1 and self.ema > c[i] - 0.5 + self.up_hysteresis:
                i += 1
        if self.ceiling_coeff > 0 and c[i] <= self.current:
            ceiling = max(1, math.ceil(self.ema * self.ceiling_coeff))
            while i > 0 and c[i] > ceiling:
                i -= 1
        return c[i]


def load_adaptive_tiers(config_path: str | None) -> dict[int, dict]:
    """batch size -> the tier's knobs (candidate_steps included), from SGLang's defaults or the JSON file."""
    if config_path is None:
        return {bs: {**ADAPTIVE_KNOB_DEFAULTS, **DEFAULT_TIER_KNOBS.get(bs, {}), "candidate_steps": list(steps)}
                for bs, steps in ADAPTIVE_TIERS.items()}
    with open(config_path) as f:
        raw = json.load(f)
    top = {k: v for k, v in raw.items() if not k.isdigit()}
    return {int(k): {**ADAPTIVE_KNOB_DEFAULTS, **top, **v} for k, v in raw.items() if k.isdigit()}


class AdaptiveSteps:
    """SGLang's adaptive speculation: the tier of the largest configured batch size <= the batch decides k."""

    def __init__(self, initial_steps: int, config_path: str | None = None):
        self.tiers: dict[int, AdaptiveTier] = {}
        for bs, knobs in sorted(load_adaptive_tiers(config_path).items()):
            candidates = sorted(set(knobs["candidate_steps"]))
            current = initial_steps if initial_steps in candidates else candidates[len(candidates) // 2]
            self.tiers[bs] = AdaptiveTier(candidates, current, float(current - 1),
                                          **{k: knobs[k] for k in ADAPTIVE_KNOB_DEFAULTS})
        self._sizes = sorted(self.tiers)
        self.max_num_steps = max(max(t.candidates) for t in self.tiers.values())

    def tier(self, batch_size: int) -> AdaptiveTier:
        return self.tiers[self._sizes[max(0, bisect.bisect_right(self._sizes, batch_size) - 1)]]

    def choose(self, batch_size: int) -> int:
        return self.tier(batch_size).current

    def draft_lengths(self) -> tuple[int, ...]:
        """Every k > 0 `choose` may return: the tiers' candidates."""
        return tuple(sorted({c for t in self.tiers.values() for c in t.candidates if c > 0}))

    def verify_widths(self) -> tuple[int, ...]:
        """k + 1 for every tier candidate k (0: a plain step)."""
        return tuple(sorted({c + 1 for t in self.tiers.values() for c in t.candidates}))

    def observe(self, batch_size: int, k: int, accepted: list[int], draft_s: float, verify_s: float,
                switch_s: float = 0.0) -> None:
        self.tier(batch_size).observe(k, accepted)


def expected_tokens(accept_rate: float, k: int) -> float:
    """Tokens one verify of a k-token chain yields when each draft is accepted with probability a (bonus included):
    1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)."""
    if accept_rate >= 1.0:
        return float(k + 1)
    return (1.0 - accept_rate ** (k + 1)) / (1.0 - accept_rate)


def best_steps(accept_rate: float, step_cost: dict[int, float]) -> int:
    """The k (a key of step_cost: seconds of a step drafting k tokens and verifying them, 0 = plain) maximising
    expected tokens per second. Ties go to the smaller k."""
    def rate(k: int) -> float:
        return expected_tokens(accept_rate, k) / max(step_cost[k], 1e-12)

    return max(sorted(step_cost), key=lambda k: (rate(k), -k))


def bucket_of(batch_size: int) -> int:
    """Batch sizes share cost estimates within powers of two (1, 2, 4, 8, ...)."""
    return 1 << max(0, batch_size - 1).bit_length()


COST_WINDOW = 8  # recent samples per cost estimate
EXPLORE_BUDGET = 0.025  # at most this share of a bucket's measured step time is spent beyond the best k's cost


@dataclass
class _Bucket:
    """One batch-size bucket's recent costs. An estimate is the minimum of its last COST_WINDOW samples: on a
    shared machine noise only ever adds time (another process, a GC pause, a cold first call), so the minimum of
    recent samples tracks the true cost (which drifts slowly as sequences grow) where a mean would chase spikes."""

    step_samples: dict[int, deque] = field(default_factory=dict)  # k -> seconds of drafting k tokens and verifying
    steps: int = 0
    explores: int = 0
    next_explore: int = 0          # the step of the next exploration (0 = not scheduled yet)
    interval: int = 0              # steps between explorations; doubles while the best k stays the same
    last_best: int | None = None
    probing: tuple[int, float] | None = None  # (probed k, the best k's estimated step cost) until the probe is observed
    measured_all: bool = False     # warmed up on its own measurements: a donor of estimates to new buckets
    total_s: float = 0.0           # every observed step's seconds (draft + verify + switch)
    explore_s: float = 0.0         # what probes cost beyond the best k's estimated step cost

    @property
    def step_cost(self) -> dict[int, float]:
        return {k: min(v) for k, v in self.step_samples.items()}


class AutoSteps:
    """Our `--spec-auto`: k in 0..max_num_steps per step, maximising expected tokens per second from online
    estimates.

    A step's cost is measured per k, draft and verify together, not as k times a draft step's cost: where the
    draft chain is one captured graph (MTP on CUDA) drafting 3 tokens costs about what drafting 1 does, and the
    linear model kept the policy at plain steps on the GPU (a k = 3 step costed at twice what it took).

    The first batch-size bucket measures every k twice (cheapest first, two passes, so one cold call cannot
    decide), skipping a k that cannot win even at the cost of a smaller one (`_dominated`), then takes
    `best_steps`. From plain steps a probe tries the most promising drafting k (`_best_draft`), from a drafting
    best k its neighbours. A later bucket starts from the nearest warmed bucket's estimates, scaled by what it has
    measured itself (`_estimates`): a rollout's batch shrinks through every bucket as requests finish, and
    re-measuring every k in each would spend its short life probing. Each bucket tries a neighbour of the best k
    every `explore_every` steps so the estimates stay fresh, doubling the interval (up to `max_explore_every`) while
    the best k does not change: each probe of a losing k costs a step, and after a run of plain steps the MTP
    drafter's catch-up too. Two bounds hold after the warm-up: probes are at most one step in `explore_every`, and a
    probe waits while what probes have cost beyond the best k's estimated step cost (catch-ups included) exceeds
    `explore_budget` of the bucket's measured time, so a draft that never pays costs at most that share. The
    per-token accept rate is the
    geometric MLE over all rows, accepted drafts / (accepted + rejections), from counts with one pseudo-count each,
    decayed by 1 - alpha per step of the largest batch seen so far, and by (1 - alpha) ** (rows / largest) for a
    step of fewer rows: the rate is evidence per row, so the one-row tail of a rollout (a few unlucky drafts of
    its last request) cannot overwrite what full batches measured and send the next rollout's first full batches
    to plain steps, where the rate is not measured again until a probe. k is chosen by the rate plus one standard
    error of that evidence (`planning_rate`): optimism while the evidence is thin, so an unlucky warm-up cannot park
    the policy at plain steps.
    """

    def __init__(self, max_num_steps: int, alpha: float = 0.05, explore_every: int = 32,
                 prior_accept_rate: float = 0.5, max_explore_every: int = 512, explore_budget: float = EXPLORE_BUDGET):
        self.max_num_steps, self.alpha, self.explore_every = max_num_steps, alpha, explore_every
        self.explore_budget = explore_budget
        self.max_explore_every = max(max_explore_every, explore_every)
        self.accept_rate = prior_accept_rate
        self._hits = self._misses = 0.0  # decayed counts of accepted / rejected drafts, one pseudo-count each
        self._widest = 1  # the most rows a drafting step has had: a step of that many decays the counts by 1 - alpha
        self.buckets: dict[int, _Bucket] = {}

    def choose(self, batch_size: int) -> int:
        key = bucket_of(batch_size)
        b = self.buckets.setdefault(key, _Bucket())
        b.steps += 1
        donor = None
        if not b.measured_all:
            donor = self._donor(key)
            if donor is None:  # nothing warmed to borrow from: warm up on its own measurements
                for passes in (1, 2):
                    unmeasured = [k for k in range(self.max_num_steps + 1)
                                  if len(b.step_samples.get(k, ())) < passes and not self._dominated(b, k)]
                    if unmeasured:
                        return unmeasured[0]
                b.measured_all = True
        cost = self._estimates(b, donor)
        best = best_steps(self.planning_rate, cost)
        if not b.next_explore:
            b.interval, b.next_explore, b.last_best = self.explore_every, b.steps + self.explore_every, best
        if b.steps < b.next_explore or b.explore_s > self.explore_budget * b.total_s:
            return best  # a probe over budget waits until the bucket's time has grown enough to afford it
        stable = best == b.last_best
        b.interval = min(2 * b.interval, self.max_explore_every) if stable else self.explore_every
        b.next_explore, b.last_best = b.steps + b.interval, best
        b.explores += 1
        probe = (self._best_draft(cost) if best == 0 else
                 min(best + 1, self.max_num_steps) if b.explores % 2 else best - 1)
        b.probing = (probe, cost[best]) if probe != best else None
        return probe

    def _best_draft(self, cost: dict[int, float]) -> int:
        """The drafting k (>= 1) with the best expected tokens per second: what a probe from plain steps tries.
        A probe of k = 1 alone measured one token of acceptance per probe; where one draft does not pay but three
        would (a GPU step whose host time dwarfs the tokens' cost), rare k = 1 probes could not lift a low
        early estimate of the accept rate out of plain steps."""
        drafting = {k: c for k, c in cost.items() if k > 0}
        return best_steps(self.planning_rate, drafting) if drafting else 1

    @property
    def planning_rate(self) -> float:
        """The accept rate k is chosen by: the estimate plus one standard error of its decayed evidence. While the
        evidence is thin (a warm-up's few drafts, a run of plain steps measuring none) it leans towards drafting, so
        an unlucky start cannot park the policy at plain steps where no evidence comes back; with plenty of
        evidence it is the estimate."""
        r, n = self.accept_rate, self._hits + self._misses + 2.0
        return min(1.0, r + math.sqrt(r * (1.0 - r) / n))

    def draft_lengths(self) -> tuple[int, ...]:
        """Every k > 0 `choose` may return: 1..max_num_steps."""
        return tuple(range(1, self.max_num_steps + 1))

    def verify_widths(self) -> tuple[int, ...]:
        """1 (a plain step) to max_num_steps + 1."""
        return tuple(range(1, self.max_num_steps + 2))

    def describe(self) -> str:
        """What the policy believes, per batch-size bucket: the accept rate, a step's ms by k (draft and verify),
        and the k it would choose now (for benchmarks and logs: why auto speculation drafts what it drafts)."""
        parts = [f"accept rate {self.accept_rate:.3f}"]
        for key, b in sorted(self.buckets.items()):
            cost = self._estimates(b, None if b.measured_all else self._donor(key))
            costs = ", ".join(f"{k}: {1e3 * c:.2f}" + ("" if k in b.step_cost else "*")
                              for k, c in sorted(cost.items()))
            parts.append(f"batch <= {key}: {b.steps} steps, step ms by k {{{costs}}} (* not measured), "
                         f"best k {best_steps(self.planning_rate, cost)}")
        return "; ".join(parts)

    def _donor(self, key: int) -> "_Bucket | None":
        """The warmed bucket nearest to `key` (in powers of two; the larger on a tie), None if there is none."""
        warmed = [k for k, b in self.buckets.items() if b.measured_all and k != key]
        if not warmed:
            return None
        return self.buckets[min(warmed, key=lambda k: (abs(k.bit_length() - key.bit_length()), -k))]

    def _estimates(self, b: "_Bucket", donor: "_Bucket | None") -> dict[int, float]:
        """Step seconds per k for bucket b: its own estimates where it has them, and for the rest the donor's,
        scaled by the median ratio of b's to the donor's costs over the k both measured (1.0 before b has measured
        anything): the shape of cost against k carries over between neighbouring batch sizes better than its level.
        A k neither has measured is costed optimistically (`_with_unmeasured`)."""
        own = b.step_cost
        if donor is None:
            return self._with_unmeasured(own)
        theirs = donor.step_cost
        ratios = sorted(own[k] / theirs[k] for k in own if k in theirs and theirs[k] > 0)
        scale = ratios[len(ratios) // 2] if ratios else 1.0
        return self._with_unmeasured({k: own.get(k, theirs.get(k, 0.0) * scale) for k in set(own) | set(theirs)})

    def _with_unmeasured(self, cost: dict[int, float]) -> dict[int, float]:
        """`cost` with each unmeasured k up to max_num_steps at the optimistic cost of the dearest smaller k measured
        (a longer draft and its verify never cost less), once a drafting step has been measured. A k the warm-up
        skipped as dominated (`_dominated`, judged on the early accept rate) is chosen, and so measured, once the
        accept rate says it could win; without this only neighbours of the best k were ever tried, so a best k of
        0, where one draft barely pays (a GPU whose plain step is cheap), never reached the k = 3 that pays well."""
        if not any(k > 0 for k in cost):
            return cost
        filled = dict(cost)
        for k in range(1, self.max_num_steps + 1):
            if k not in filled:
                filled[k] = max(c for j, c in filled.items() if j < k)
        return filled

    def _dominated(self, b: "_Bucket", k: int) -> bool:
        """Whether measuring k is pointless: even at the cost of the dearest smaller drafting k measured so far (a
        longer draft never costs less), its expected tokens per second lose to the best measured k. Saves the
        warm-up probes of long drafts that are never accepted."""
        measured = b.step_cost
        smaller = [j for j in measured if 0 < j < k]
        if not smaller:
            return False
        best = max(expected_tokens(self.planning_rate, j) / max(c, 1e-12) for j, c in measured.items())
        optimistic = expected_tokens(self.planning_rate, k) / max(max(measured[j] for j in smaller), 1e-12)
        return optimistic < best

    def observe(self, batch_size: int, k: int, accepted: list[int], draft_s: float, verify_s: float,
                switch_s: float = 0.0) -> None:
        b = self.buckets.setdefault(bucket_of(batch_size), _Bucket())
        cost = draft_s + verify_s + switch_s
        b.total_s += cost
        if b.probing is not None and b.probing[0] == k:  # not a plain step read back late, at the probe's start
            b.explore_s += max(0.0, cost - b.probing[1])
            b.probing = None
        b.step_samples.setdefault(k, deque(maxlen=COST_WINDOW)).append(draft_s + verify_s)
        if k == 0 or not accepted:
            return
        hits = sum(accepted)
        misses = sum(1 for a in accepted if a < k)
        self._widest = max(self._widest, len(accepted))
        decay = (1.0 - self.alpha) ** (len(accepted) / self._widest)  # the evidence per row, not per step
        self._hits, self._misses = decay * self._hits + hits, decay * self._misses + misses
        self.accept_rate = (self._hits + 1.0) / (self._hits + self._misses + 2.0)


def make_policy(spec, auto: bool):
    """The policy for resolved settings: AutoSteps (--spec-auto), AdaptiveSteps (speculative_adaptive), else
    FixedSteps; None without speculation."""
    if spec is None:
        return None
    if auto:
        return AutoSteps(spec.num_steps)
    if spec.speculative_adaptive:
        return AdaptiveSteps(spec.speculative_num_steps, spec.speculative_adaptive_config)
    return FixedSteps(spec.num_steps)


def check_spec_options(spec: SpecConfig | None, draft_sampling: bool, spec_auto: bool) -> None:
    """Our own speculative options (not SGLang's) against the resolved settings; ValueError naming the flag."""
    if (draft_sampling or spec_auto) and spec is None:
        flag = "--spec-draft-sampling" if draft_sampling else "--spec-auto"
        raise ValueError(f"{flag} needs speculative decoding: set --speculative-algorithm, or drop {flag}")
    if draft_sampling and spec.speculative_algorithm not in (Algorithm.EAGLE, Algorithm.STANDALONE):
        raise ValueError(f"--spec-draft-sampling with speculative_algorithm={spec.speculative_algorithm}: only "
                         "chain drafters with a distribution (EAGLE/NEXTN with MTP layers, STANDALONE) can draft by "
                         "sampling; drop --spec-draft-sampling")
    if tree_shape(spec) is not None and (draft_sampling or spec_auto):
        flag = "--spec-draft-sampling" if draft_sampling else "--spec-auto"
        raise ValueError(f"{flag} with --speculative-eagle-topk {spec.speculative_eagle_topk}: it applies to chain "
                         f"drafts only (a tree is drafted and verified as SGLang does); drop {flag} or use "
                         "--speculative-eagle-topk 1")
    if spec_auto and spec.speculative_adaptive:
        raise ValueError("--spec-auto and --speculative-adaptive both choose the draft length per step; keep one")
