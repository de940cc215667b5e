"""SpecWorker: one speculative step of the embedded engine, as SGLang's EAGLE worker splits it.

  draft   the drafter proposes k tokens per row (`Drafter.propose`, or `sample_draft` under draft sampling)
  verify  the target runs the pending token and the k drafts of every row as one batched forward and one lm_head
          matmul over all B * (k + 1) positions
  accept  greedy rows accept while the draft equals the target's argmax, sampled rows by the lossless rule
          (accept.py); the accepted tokens are appended and the drafter is told what was kept

k is the step's `num_steps`: the step policy (spec_policy) chooses it and the worker hands it to the drafter;
k = 0 is a plain decode step that still keeps the drafter in sync.
With eagle_topk > 1 a step drafts and verifies a tree instead (`tree_step`, math in engine/speculative/tree.py). The
worker
reaches the engine that runs the target only through `TargetEngine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from slime_spec.common.phase_clock import PhaseClock
from slime_spec.engine.drafters.base import Drafter, argmax_pick
from slime_spec.engine.managers.request import NAN_FINISH, Row
from slime_spec.engine.model_executor import sampling
from slime_spec.engine.model_executor.transfer import device_tensor, start_read_back
from slime_spec.engine.speculative import tree, tree_graphs
from slime_spec.engine.speculative.accept import accept_drafts, draft_pick
from slime_spec.engine.speculative.accept_graph import chain_acceptance
from slime_spec.engine.speculative.policy import AutoSteps, StepPolicy
from slime_spec.engine.speculative.timing import StepTimes, sync

if TYPE_CHECKING:
    from slime_spec.engine.managers.overlap import InFlight, OverlapDecode
    from slime_spec.engine.model_executor.model import CausalLM, KVCache
class TargetEngine(Protocol):
    """What the worker needs of the engine that runs the target (EngineCore): the model and its KV cache, the
    batch's sampling state, and the plain decode step and token appending it shares with plain decoding."""

    device: torch.device
    model: CausalLM
    cache: KVCache | None
    generator: torch.Generator
    overlap: OverlapDecode | None

    def batch_params(self, rows: list[Row]) -> sampling.BatchParams: ...

    def decode(self, rows: list[Row]) -> torch.Tensor: ...

    def append_tokens(self, row: Row, tokens: list[int], logprobs: list[float] | None) -> None: ...

    @staticmethod
    def non_finite_rows(logits: torch.Tensor) -> tuple[torch.Tensor, set[int]]: ...


@dataclass
class Verified:
    """A chain verify's device results: the final hidden states [n, k + 1, H]; logits [n, k + 1, V] (non-finite
    rows masked and flagged in `broken`; both None where the sampling kernel's acceptance computes them from the
    hidden states); what the drafter reads of the target (`features`: the hidden states, or EAGLE3's aux states),
    and each row's first verified position and cache slot."""

    hidden: torch.Tensor
    logits: torch.Tensor | None
    broken: torch.Tensor | None
    features: torch.Tensor
    start: torch.Tensor
    slots: torch.Tensor


@dataclass
class Acceptance:
    """A chain step's accepted tokens on the device (`accept` [n], `chosen` [n, k + 1]: the accepted drafts and
    the token after them) and the step's one read-back, started."""

    accept: torch.Tensor
    chosen: torch.Tensor
    read_back: Callable[[], list[list[float]]]
    with_logprobs: bool


class SpecWorker:
    """Draft, verify and accept for the running rows of one engine step; owns the step policy, the speculative
    counters (accept length as SGLang's scheduler counts it) and the per-phase step times."""

    def __init__(self, engine: TargetEngine, drafter: Drafter, policy: StepPolicy, *,
                 tree_shape: tree.TreeShape | None, draft_sampling: bool):
        self.engine, self.drafter, self.policy = engine, drafter, policy
        self.tree_shape = tree_shape
        self.draft_sampling = draft_sampling  # ours, --spec-draft-sampling
        self.timed = isinstance(policy, AutoSteps)  # costs are measured (CUDA: synchronized)
        self.times = StepTimes()
        self.accept_tokens = 0  # sum over verify passes of (accepted + 1), as SGLang's avg_spec_accept_length
        self.verify_passes = 0

    @property
    def avg_accept_length(self) -> float:
        """Accepted tokens (drafts + bonus) per (request, verify pass) since start, as SGLang's scheduler counts."""
        return self.accept_tokens / self.verify_passes if self.verify_passes else 1.0

    def step(self, rows: list[Row]) -> None:
        """One step for `rows` (the engine's running rows): a tree, a plain step (k = 0) or a chain; feeds the
        step policy."""
        if self.tree_shape is not None:
            self.tree_step(rows, self.tree_shape)
            return
        k = self.policy.choose(len(rows))
        self.drafter.num_steps = k
        if k == 0:
            self.plain_step(rows)
            return
        overlap = self.engine.overlap
        if overlap is not None and overlap.in_flight is not None:
            self.drain_plain_step()
            rows = [r for r in rows if r.finish is None]
            if not rows:
                return
        self.chain_step(rows, k)

    # ------------------------------------------------------------------ a chain
    def chain_step(self, rows: list[Row], k: int) -> None:
        """Draft k tokens per row, verify them in one target forward, accept, and update the drafter."""
        switch_s = self.catch_up(rows)
        clock = PhaseClock()
        params = self.engine.batch_params(rows)
        drafts, draft_probs = self.draft(rows, params)
        draft_s = clock.lap("draft")
        fused = draft_probs is None and params.unfiltered and self.engine.model.kernels.sampling
        verified = self.verify(rows, drafts, logits=not fused)
        clock.lap("verify")
        acceptance = (self.accept_unfiltered(rows, verified, drafts, params) if fused
                      else self.accept(rows, verified, drafts, draft_probs, params))
        clock.lap("sampling")
        if self.drafter.extends_before_read_back:  # from device results, queued behind the read-back's copy
            self.drafter.verify_extend(rows, verified.features, acceptance.chosen, acceptance.accept,
                                       verified.start, verified.slots)
        clock.lap("draft")
        accepted = self.commit(rows, acceptance, k)
        clock.lap("sampling")
        if self.drafter.extends_before_read_back:
            alive = [i for i, r in enumerate(rows) if r.finish is None]
            if alive:
                self.drafter.after_verify([rows[i] for i in alive], [accepted[i] for i in alive])
        else:
            self._on_verify(rows, verified.features, accepted)
        if self.timed:
            sync(self.engine.device)
        clock.lap("draft")
        self.times.add(clock)
        self.times.draft_s += switch_s
        self.policy.observe(len(rows), k, accepted, draft_s, clock.since_start() - draft_s, switch_s)

    def draft(self, rows: list[Row], params: sampling.BatchParams) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(drafts [n, k], the distribution q they were sampled from, or None when q is one-hot)."""
        pick = draft_pick(params, self.engine.generator, self.draft_sampling)
        if pick is argmax_pick:  # SGLang's greedy drafting
            return self.drafter.propose(rows), None
        return self.drafter.sample_draft(rows, pick)

    def verify(self, rows: list[Row], drafts: torch.Tensor, logits: bool = True) -> Verified:
        """The target over each row's pending token and its k drafts, one batched forward and one lm_head matmul.
        logits=False: no lm_head here; the sampling kernel's acceptance runs it (`accept_unfiltered`)."""
        e, dev = self.engine, self.engine.device
        n, k = drafts.shape
        meta = device_tensor([(r.tokens[-1], r.kv_len, r.slot) for r in rows], dev)  # one host-to-device copy
        ids = torch.cat((meta[:, :1], drafts), dim=1)
        positions = meta[:, 1:2] + torch.arange(k + 1, device=dev)[None]
        aux_ids = self.drafter.aux_layer_ids  # EAGLE3 drafts from the target's aux states
        out = e.model(ids, positions, e.cache, meta[:, 2], max(r.kv_len for r in rows) + k + 1, aux_layer_ids=aux_ids)
        hidden, features = out if aux_ids else (out, out)
        if not logits:
            return Verified(hidden, None, None, features, meta[:, 1], meta[:, 2])
        # broken: read back with the result, not synced on here; such a row is finished at commit
        logits, broken = sampling.mask_non_finite(e.model.logits(hidden.flatten(0, 1)).view(n, k + 1, -1))
        return Verified(hidden, logits, broken, features, meta[:, 1], meta[:, 2])

    def accept(self, rows: list[Row], verified: Verified, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
               params: sampling.BatchParams) -> Acceptance:
        """Accept drafts on the device and start the step's one read-back (accepted count, broken flag, tokens and,
        when a row asks for them, logprobs)."""
        n, k = drafts.shape
        logits = verified.logits
        accept, next_token = accept_drafts(logits, drafts, draft_probs, params, self.engine.generator)
        chosen = torch.cat((drafts, drafts.new_zeros(n, 1)), dim=1)
        chosen[torch.arange(n, device=drafts.device), accept] = next_token
        columns = [accept[:, None], verified.broken[:, None], chosen]
        if any(r.req.return_logprob for r in rows):
            columns.append(sampling.token_logprobs(logits.flatten(0, 1), params.temps.repeat_interleave(k + 1),
                                                   params.greedy.repeat_interleave(k + 1),
                                                   chosen.flatten()).view(n, k + 1))
        read_back = start_read_back(torch.cat([c.double() for c in columns], dim=1))
        return Acceptance(accept, chosen, read_back, len(columns) == 4)

    def accept_unfiltered(self, rows: list[Row], verified: Verified, drafts: torch.Tensor,
                          params: sampling.BatchParams) -> Acceptance:
        """`accept` for a batch the sampling kernel serves (every row sampled at its temperature alone, greedy
        drafts): the lm_head, one pass of the kernel and the lossless rule from the verify's hidden states, replayed
        as one captured graph where one serves the batch (engine/speculative/accept_graph.py); the logprobs are
        always computed."""
        e = self.engine
        graph = e.model.graphs.get("chain_accept")
        if graph is not None and graph.serves(*verified.hidden.shape[:2]):
            accept, chosen, packed = graph(verified.hidden, drafts, params.temps)
        else:
            accept, chosen, packed = chain_acceptance(e.model, e.generator, verified.hidden, drafts, params.temps)
        return Acceptance(accept, chosen, start_read_back(packed), any(r.req.return_logprob for r in rows))

    def commit(self, rows: list[Row], acceptance: Acceptance, k: int) -> list[int]:
        """Read the step back, count it, and append each row's accepted tokens; returns the accepted drafts per
        row. A row whose logits were not finite ends with NAN_FINISH."""
        result = acceptance.read_back()
        accepted = [int(v[0]) for v in result]
        for row, a, values in zip(rows, accepted, result):
            self._count_verify(row, a, k)
            row.kv_len += a + 1
            self.engine.append_tokens(row, [int(t) for t in values[2: a + 3]],
                                      values[k + 3: k + 4 + a] if acceptance.with_logprobs else None)
            if values[1]:
                row.finish = dict(NAN_FINISH)
        return accepted

    def catch_up(self, rows: list[Row]) -> float:
        """Run a drafter's deferred work of earlier plain steps (MTP's extends, the tokens a STANDALONE draft has not
        seen) before drafting; its seconds are the price of switching from k = 0 back to drafting, which the policy
        keeps apart from the draft step's cost (StepTimes counts them as draft time)."""
        if not self.drafter.defers_plain_steps:
            return 0.0
        clock = PhaseClock()
        if self.drafter.catch_up_deferred(rows) and self.timed:  # nothing deferred: nothing launched to wait for
            sync(self.engine.device)
        return clock.lap("switch")

    # ------------------------------------------------------------------ plain steps (k = 0)
    def plain_step(self, rows: list[Row]) -> None:
        """k = 0: the engine's plain decode step (no speculative bookkeeping on the hot path); the drafter gets the
        step's hidden states to keep in sync, and the policy the step's cost. With the overlap schedule (CUDA) a run
        of plain steps overlaps as plain decoding does (`overlapped_plain_step`)."""
        clock = PhaseClock()
        if self.engine.overlap is not None:
            self.overlapped_plain_step(rows, clock)
            return
        hidden = self.engine.decode(rows)
        self._count_plain(rows)
        self._on_verify(rows, hidden, [0] * len(rows))
        if self.timed:
            sync(self.engine.device)
        seconds = clock.lap("plain")
        self.times.add(clock)
        self.policy.observe(len(rows), 0, [0] * len(rows), 0.0, seconds)

    def overlapped_plain_step(self, rows: list[Row], clock: PhaseClock) -> None:
        """Launch this plain step, then read the previous one back (engine/managers/overlap.py). A run's first step
        puts the
        rows' last tokens, known on the host after a speculative step, where the launch reads them. Its cost for the
        policy is the whole call once a step was in flight (then launch to launch: one step of the run's rhythm), so
        no sync is needed to measure it."""
        overlap = self.engine.overlap
        steady = overlap.in_flight is not None
        if not steady:
            overlap.after_prefill(rows)
        overlap.step(rows)
        seconds = clock.lap("plain")
        self.times.add(clock)
        if steady:
            self.policy.observe(len(rows), 0, [0] * len(rows), 0.0, seconds)

    def after_overlapped_step(self, step: InFlight, live: list[int]) -> None:
        """A plain step read back by the overlap schedule (its on_appended): count it as a verify pass of no drafts
        for the rows that got a token, and hand the rows still running to the drafter's deferred extend (MTP's
        `defer`; a STANDALONE draft catches up from the tokens at its next draft)."""
        self._count_plain([step.rows[i] for i in live])
        alive = [i for i in live if step.rows[i].finish is None]
        if alive:
            hidden = step.hidden if len(alive) == len(step.rows) else \
                step.hidden[device_tensor(alive, self.engine.device)]
            self.drafter.defer([step.rows[i] for i in alive], hidden, [step.positions[i] for i in alive])

    def drain_plain_step(self) -> None:
        """Read back the plain step in flight before a speculative step (its tokens decide what is drafted from), and
        observe it as a k = 0 step: from when the device turned to it (overlap.InFlight.since) to its read-back, one
        step of the run's rhythm as `overlapped_plain_step` measures the others. A run's last plain step, or a lone
        one (a probe of k = 0), is read back here, so without this the policy's k = 0 cost went stale."""
        overlap = self.engine.overlap
        step = overlap.in_flight
        clock = PhaseClock()
        overlap.drain()
        clock.lap("plain")
        self.times.add(clock)
        n = len(step.rows)
        self.policy.observe(n, 0, [0] * n, 0.0, clock.last - step.since)

    # ------------------------------------------------------------------ a tree (eagle_topk > 1)
    def tree_step(self, rows: list[Row], shape: tree.TreeShape) -> None:
        """The drafter drafts a tree per row (engine/speculative/tree.py), the target verifies the root and its
        num_draft_tokens - 1 nodes in one forward (each node at its own cache location, RoPE position = row length +
        depth, attending to the context and its ancestors; a captured graph on CUDA,
        engine/speculative/tree_graphs.py), the longest
        accepted path is taken, and its keys/values are moved to contiguous positions. A verify counts
        num_draft_tokens - 1 drafts, as SGLang's."""
        e, dev = self.engine, self.engine.device
        n, width = len(rows), shape.num_draft_tokens
        clock = PhaseClock()
        params = e.batch_params(rows)
        drafted = self.drafter.tree_draft(rows, shape)
        draft_s = clock.lap("draft")
        base = [r.kv_len for r in rows]
        hidden, features = tree_graphs.verify_tree(e.model, e.cache, drafted, device_tensor(base, dev),
                                                   device_tensor([r.slot for r in rows], dev), max(base) + width,
                                                   self.drafter.aux_layer_ids)
        logits, broken = e.non_finite_rows(e.model.logits(hidden.flatten(0, 1)).view(n, width, -1))
        probs = None
        if not params.all_greedy:
            probs = params.sampled_probs(params.of_sampled(logits).flatten(0, 1), reps=width) \
                .view(-1, width, logits.shape[-1])
        paths, next_tokens = tree.accept(drafted, logits, params.greedy, probs, e.generator)
        tokens = drafted.tokens.tolist()
        chosen = [[tokens[i][node] for node in paths[i][1:]] + [next_tokens[i]] for i in range(n)]
        logprobs = self._path_logprobs(rows, logits, paths, chosen, params, width)
        tree.move_accepted_kv(e.cache.k + e.cache.v, [r.slot for r in rows], base, paths)
        accepted = [len(p) - 1 for p in paths]
        alive = []
        for i, row in enumerate(rows):
            self._count_verify(row, accepted[i], width - 1)
            row.kv_len += accepted[i] + 1
            e.append_tokens(row, chosen[i], None if logprobs is None else logprobs[i])
            if i in broken:
                row.finish = dict(NAN_FINISH)
            if row.finish is None:
                alive.append(i)
        if alive:
            # The accepted path's target states, contiguous from the root (padded with the root to the longest path,
            # steps + 1 nodes: the drafter's extend graph has that width), as a chain verify hands them over.
            longest = shape.steps + 1
            path_nodes = device_tensor([paths[i] + [0] * (longest - len(paths[i])) for i in alive], dev)
            path_features = features[device_tensor(alive, dev)[:, None], path_nodes]
            self.drafter.on_tree_verify([rows[i] for i in alive], path_features, [accepted[i] for i in alive])
        verify_s = clock.lap("verify")  # the tree's accept walk included
        self.times.add(clock)
        self.policy.observe(n, width - 1, accepted, draft_s, verify_s)

    def _path_logprobs(self, rows: list[Row], logits: torch.Tensor, paths: list[list[int]], chosen: list[list[int]],
                       params: sampling.BatchParams, width: int) -> list[list[float]] | None:
        """Each row's logprobs of its accepted path's tokens, when any row asks for logprobs."""
        if not any(r.req.return_logprob for r in rows):
            return None
        dev = self.engine.device
        at = device_tensor([i * width + node for i in range(len(rows)) for node in paths[i]], dev)
        lens = device_tensor([len(p) for p in paths], dev)
        lp = sampling.token_logprobs(logits.flatten(0, 1)[at], params.temps.repeat_interleave(lens),
                                     params.greedy.repeat_interleave(lens),
                                     device_tensor([t for c in chosen for t in c], dev)).tolist()
        out, offset = [], 0
        for p in paths:
            out.append(lp[offset: offset + len(p)])
            offset += len(p)
        return out

    # ------------------------------------------------------------------ bookkeeping
    def _on_verify(self, rows: list[Row], features: torch.Tensor, accepted: list[int]) -> None:
        """Hand a verify (or a plain step) to the drafter for the rows still running."""
        alive = [i for i, r in enumerate(rows) if r.finish is None]
        if len(alive) == len(rows):
            self.drafter.on_verify(rows, features, accepted)
        elif alive:
            self.drafter.on_verify([rows[i] for i in alive], features[device_tensor(alive, self.engine.device)],
                                   [accepted[i] for i in alive])

    def _count_verify(self, row: Row, accepted: int, k: int) -> None:
        """A target forward that committed accepted + 1 tokens. A plain step (k = 0, chosen by adaptive or auto
        speculation) counts as a verify pass of no drafts, so accept length stays tokens per target forward."""
        row.verify_ct += 1
        row.accept_num += accepted
        row.draft_num += k
        self.accept_tokens += accepted + 1
        self.verify_passes += 1

    def _count_plain(self, rows: list[Row]) -> None:
        """A plain step's rows: each a verify pass of no drafts that committed one token."""
        for row in rows:
            self._count_verify(row, 0, 0)
