"""One speculative step of EngineCore: draft k tokens per row, verify all rows in one target forward, accept.

The target verifies the pending token and the k drafts of every row as one batched forward and one lm_head
matmul over all B * (k + 1) positions. Greedy rows accept while the draft equals the target's argmax; sampled
rows use the standard lossless rule (sampling.speculative_accept), with q one-hot for SGLang's greedy drafting
or, with draft sampling (`--spec-draft-sampling`), the distribution each draft token was sampled from.
k comes from the step policy (spec_policy); k = 0 is a plain decode step that still keeps the drafter in sync.
With eagle_topk > 1 a step drafts and verifies a tree instead (`tree_step`, math in engine/tree.py).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from slime_spec.engine import sampling, tree, tree_graphs
from slime_spec.engine.drafters.base import DraftPick, argmax_pick
from slime_spec.engine.transfer import device_tensor, start_read_back


@dataclass
class StepTimes:
    """Seconds the speculative engine's steps spent per phase since start, for the time shares the rollout reports:
    draft (the drafter proposing, its catch-up after plain steps and the prefill (`catch_up`) and its update after
    each verify), verify (the target forward and lm_head over every drafted position), sampling (acceptance,
    sampling, appending tokens) and plain (whole k = 0 steps that adaptive or auto speculation chose, an overlapped
    one's read-back at the next speculative step included). On CUDA these are host-side times: a chain step waits for the device
    only at its one read-back, in the sampling phase, so the device time of drafting and of the verify forward
    lands in sampling. Under --spec-auto a step also syncs once
    at its end, so each step's total (what the policy compares per k) holds its own device work and no other
    step's (a sync between phases would leave the device idle while the host launches the next phase)."""

    draft_s: float = 0.0
    verify_s: float = 0.0
    sampling_s: float = 0.0
    plain_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def draft_pick(params: sampling.BatchParams, generator: torch.Generator, draft_sampling: bool) -> DraftPick:
    """Greedy rows (and every row without draft sampling) take the draft's argmax; with draft sampling a sampled
    row draws from the draft's own temperature/filter-adjusted distribution q, returned for verification."""
    p = params
    if not draft_sampling or p.all_greedy:
        return argmax_pick

    if p.all_sampled:  # the RL case: every row sampled, no per-row copies
        def pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q = p.sampled_probs(logits.float())
            return sampling.sample(q, generator), q

        return pick

    def pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_sampled = p.sampled_probs(p.of_sampled(logits).float())
        tokens = logits.argmax(-1).index_copy_(0, p.sampled, sampling.sample(q_sampled, generator))
        return tokens, q_sampled.new_zeros(logits.shape).index_copy_(0, p.sampled, q_sampled)

    return pick


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _count_verify(engine, row, accepted: int, k: int) -> None:
    """A target forward that committed accepted + 1 tokens. A plain step (k = 0, chosen by adaptive or auto
    speculation) counts as a verify pass of no drafts, so accept length stays tokens per target forward."""
    row.verify_ct += 1
    row.accept_num += accepted
    row.draft_num += k
    engine._accept_tokens += accepted + 1
    engine._verify_passes += 1


def _count_plain(engine, rows: list) -> None:
    """A plain step's rows: each a verify pass of no drafts that committed one token."""
    for row in rows:
        _count_verify(engine, row, 0, 0)


def plain_step(engine, rows: list, t0: float) -> None:
    """k = 0: the engine's plain decode step (no speculative bookkeeping on the hot path); the drafter gets the
    step's hidden states to keep in sync, and the policy the step's cost. With the overlap schedule (CUDA) a run
    of plain steps overlaps as plain decoding does (`overlapped_plain_step`)."""
    if engine.overlap is not None:
        overlapped_plain_step(engine, rows, t0)
        return
    hidden = engine._decode(rows)
    _count_plain(engine, rows)
    alive = [i for i, r in enumerate(rows) if r.finish is None]
    if len(alive) == len(rows):
        engine.drafter.on_verify(rows, hidden, [0] * len(rows))
    elif alive:
        engine.drafter.on_verify([rows[i] for i in alive], hidden[device_tensor(alive, engine.device)],
                                 [0] * len(alive))
    if engine.timed:
        _sync(engine.device)
    seconds = time.perf_counter() - t0
    engine.step_times.plain_s += seconds
    engine.policy.observe(len(rows), 0, [0] * len(rows), 0.0, seconds)


def overlapped_plain_step(engine, rows: list, t0: float) -> None:
    """Launch this plain step, then read the previous one back (engine/overlap.py). A run's first step puts the
    rows' last tokens, known on the host after a speculative step, where the launch reads them. Its cost for the
    policy is the whole call once a step was in flight (then launch to launch: one step of the run's rhythm), so
    no sync is needed to measure it."""
    overlap = engine.overlap
    steady = overlap.in_flight is not None
    if not steady:
        overlap.after_prefill(rows)
    overlap.step(rows)
    seconds = time.perf_counter() - t0
    engine.step_times.plain_s += seconds
    if steady:
        engine.policy.observe(len(rows), 0, [0] * len(rows), 0.0, seconds)


def after_overlapped_step(engine, step, live: list[int]) -> None:
    """A plain step read back by the overlap schedule (its on_appended): count it as a verify pass of no drafts
    for the rows that got a token, and hand the rows still running to the drafter's deferred extend (MTP's
    `defer`; a STANDALONE draft catches up from the tokens at its next draft)."""
    _count_plain(engine, [step.rows[i] for i in live])
    alive = [i for i in live if step.rows[i].finish is None]
    defer = getattr(engine.drafter, "defer", None)
    if defer is not None and alive:
        hidden = step.hidden if len(alive) == len(step.rows) else step.hidden[device_tensor(alive, engine.device)]
        defer([step.rows[i] for i in alive], hidden, [step.positions[i] for i in alive])


def drain_plain_step(engine) -> None:
    """Read back the plain step in flight before a speculative step (its tokens decide what is drafted from), and
    observe it as a k = 0 step: from when the device turned to it (overlap.InFlight.since) to its read-back, one
    step of the run's rhythm as `overlapped_plain_step` measures the others. A run's last plain step, or a lone
    one (a probe of k = 0), is read back here, so without this the policy's k = 0 cost went stale."""
    step = engine.overlap.in_flight
    t0 = time.perf_counter()
    engine.overlap.drain()
    t1 = time.perf_counter()
    engine.step_times.plain_s += t1 - t0
    n = len(step.rows)
    engine.policy.observe(n, 0, [0] * n, 0.0, t1 - step.since)


def catch_up(engine, rows: list) -> float:
    """Run a drafter's deferred work of earlier plain steps (MTP's extends, the tokens a STANDALONE draft has not
    seen) before drafting; its seconds are the price of switching from k = 0 back to drafting, which the policy
    keeps apart from the draft step's cost (StepTimes counts them as draft time)."""
    deferred = getattr(engine.drafter, "catch_up_deferred", None)
    if deferred is None:
        return 0.0
    t0 = time.perf_counter()
    if deferred(rows) and engine.timed:  # nothing deferred: nothing launched to wait for
        _sync(engine.device)
    return time.perf_counter() - t0


def accept_drafts(logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                  params: sampling.BatchParams, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts [n], the token after them [n]) per row: greedy rows by argmax equality, sampled rows by
    the lossless rule. A batch of one kind (the usual case: all sampled in RL) skips the per-kind row copies."""
    p = params
    if p.all_greedy:
        return sampling.greedy_accept(logits, drafts)
    k1, vocab = logits.shape[1:]
    probs = p.sampled_probs(p.of_sampled(logits).flatten(0, 1), reps=k1).view(-1, k1, vocab)
    q = None if draft_probs is None else p.of_sampled(draft_probs)
    sampled_accept = sampling.speculative_accept(probs, q, p.of_sampled(drafts), generator)
    if p.all_sampled:
        return sampled_accept
    accept, next_token = sampling.greedy_accept(logits, drafts)  # every row; the sampled rows' are replaced
    return accept.index_copy_(0, p.sampled, sampled_accept[0]), next_token.index_copy_(0, p.sampled, sampled_accept[1])


def spec_step(engine, rows: list) -> None:
    """Draft, verify, accept and append for `rows` (EngineCore's running rows); feeds the step policy."""
    shape = tree.tree_shape(engine.spec)
    if shape is not None:
        tree_step(engine, rows, shape)
        return
    dev = engine.device
    n = len(rows)
    k = engine.policy.choose(n)
    engine.drafter.k = k
    if k == 0:
        plain_step(engine, rows, time.perf_counter())
        return
    if engine.overlap is not None and engine.overlap.in_flight is not None:
        drain_plain_step(engine)
        rows = [r for r in rows if r.finish is None]
        if not rows:
            return
        n = len(rows)
    switch_s = catch_up(engine, rows)
    t0 = time.perf_counter()
    params = engine._params(rows)
    draft_probs = None
    pick = draft_pick(params, engine.generator, engine.draft_sampling)
    sample_draft = getattr(engine.drafter, "sample_draft", None)
    if pick is not argmax_pick and sample_draft is not None:
        drafts, draft_probs = sample_draft(rows, pick)
    else:  # SGLang's greedy drafting, or a drafter without a distribution (NGRAM)
        drafts = engine.drafter.propose(rows)
    t1 = time.perf_counter()
    meta = device_tensor([(r.tokens[-1], r.kv_len, r.slot) for r in rows], dev)  # one host-to-device copy
    ids = torch.cat((meta[:, :1], drafts), dim=1)
    positions = meta[:, 1:2] + torch.arange(k + 1, device=dev)[None]
    aux_ids = getattr(engine.drafter, "aux_layer_ids", None)  # EAGLE3 drafts from the target's aux states
    out = engine.model(ids, positions, engine.cache, meta[:, 2], max(r.kv_len for r in rows) + k + 1,
                       aux_layer_ids=aux_ids)
    hidden, features = out if aux_ids else (out, out)
    # broken: read back with the result, not synced on here; such a row is finished below
    logits, broken = sampling.mask_non_finite(engine.model.logits(hidden.flatten(0, 1)).view(n, k + 1, -1))
    t2 = time.perf_counter()
    accept, next_token = accept_drafts(logits, drafts, draft_probs, params, engine.generator)
    chosen = torch.cat((drafts, drafts.new_zeros(n, 1)), dim=1)
    chosen[torch.arange(n, device=dev), accept] = next_token
    columns = [accept[:, None], broken[:, None], chosen]
    if any(r.req.return_logprob for r in rows):
        columns.append(sampling.token_logprobs(logits.flatten(0, 1), params.temps.repeat_interleave(k + 1),
                                               params.greedy.repeat_interleave(k + 1), chosen.flatten()).view(n, k + 1))
    read_back = start_read_back(torch.cat([c.double() for c in columns], dim=1))  # the step's one read-back
    verify_extend = getattr(engine.drafter, "verify_extend", None)
    t_extend = time.perf_counter()
    if verify_extend is not None:  # the drafter's extend from device results, queued behind the read-back's copy
        verify_extend(rows, features, chosen, accept, meta[:, 1], meta[:, 2])
    t_extend = time.perf_counter() - t_extend
    result = read_back()
    accept_list = [int(v[0]) for v in result]
    alive = []
    for i, row in enumerate(rows):
        a, values = accept_list[i], result[i]
        _count_verify(engine, row, a, k)
        row.kv_len += a + 1
        engine._append(row, [int(t) for t in values[2: a + 3]],
                       values[k + 3: k + 4 + a] if len(columns) == 4 else None)
        if values[1]:
            row.finish = dict(engine.nan_finish)
        if row.finish is None:
            alive.append(i)
    t3 = time.perf_counter()
    if verify_extend is not None:
        after_verify = getattr(engine.drafter, "after_verify", None)
        if after_verify is not None and alive:
            after_verify([rows[i] for i in alive], [accept_list[i] for i in alive])
    elif len(alive) == n:
        engine.drafter.on_verify(rows, features, accept_list)
    elif alive:
        engine.drafter.on_verify([rows[i] for i in alive], features[device_tensor(alive, dev)],
                                 [accept_list[i] for i in alive])
    if engine.timed:
        _sync(dev)
    t4 = time.perf_counter()
    times = engine.step_times
    times.draft_s += switch_s + (t1 - t0) + (t4 - t3) + t_extend
    times.verify_s += t2 - t1
    times.sampling_s += t3 - t2 - t_extend
    engine.policy.observe(n, k, accept_list, t1 - t0, t4 - t1, switch_s)


def tree_step(engine, rows: list, shape: tree.TreeShape) -> None:
    """eagle_topk > 1: the drafter drafts a tree per row (engine/tree.py), the target verifies the root and its
    num_draft_tokens - 1 nodes in one forward (each node at its own cache location, RoPE position = row length +
    depth, attending to the context and its ancestors; a captured graph on CUDA, tree_graphs.py), the longest
    accepted path is taken, and its keys/values are moved to contiguous positions. A verify counts
    num_draft_tokens - 1 drafts, as SGLang's."""
    dev = engine.device
    n, width = len(rows), shape.num_draft_tokens
    t0 = time.perf_counter()
    params = engine._params(rows)
    greedy, temps = params.greedy, params.temps
    drafted = engine.drafter.tree_draft(rows, shape)
    t1 = time.perf_counter()
    base = [r.kv_len for r in rows]
    start = device_tensor(base, dev)
    slots = device_tensor([r.slot for r in rows], dev)
    aux_ids = getattr(engine.drafter, "aux_layer_ids", None)  # EAGLE3 drafts from the target's aux states
    hidden, features = tree_graphs.verify_tree(engine.model, engine.cache, drafted, start, slots, max(base) + width,
                                               aux_ids)
    logits, broken = engine._non_finite_rows(engine.model.logits(hidden.flatten(0, 1)).view(n, width, -1))
    probs = None
    if not params.all_greedy:
        probs = params.sampled_probs(params.of_sampled(logits).flatten(0, 1), reps=width) \
            .view(-1, width, logits.shape[-1])
    paths, next_tokens = tree.accept(drafted, logits, greedy, probs, engine.generator)
    tokens = drafted.tokens.tolist()
    chosen = [[tokens[i][node] for node in paths[i][1:]] + [next_tokens[i]] for i in range(n)]
    logprobs = None
    if any(r.req.return_logprob for r in rows):
        at = device_tensor([i * width + node for i in range(n) for node in paths[i]], dev)
        lens = device_tensor([len(p) for p in paths], dev)
        lp = sampling.token_logprobs(logits.flatten(0, 1)[at], temps.repeat_interleave(lens),
                                     greedy.repeat_interleave(lens),
                                     device_tensor([t for c in chosen for t in c], dev)).tolist()
        logprobs, offset = [], 0
        for p in paths:
            logprobs.append(lp[offset: offset + len(p)])
            offset += len(p)
    tree.move_accepted_kv(engine.cache.k + engine.cache.v, [r.slot for r in rows], base, paths)
    accepted = [len(p) - 1 for p in paths]
    alive = []
    for i, row in enumerate(rows):
        _count_verify(engine, row, accepted[i], width - 1)
        row.kv_len += accepted[i] + 1
        engine._append(row, chosen[i], None if logprobs is None else logprobs[i])
        if i in broken:
            row.finish = dict(engine.nan_finish)
        if row.finish is None:
            alive.append(i)
    if alive:
        # The accepted path's target states, contiguous from the root (padded with the root to the longest path,
        # steps + 1 nodes: the drafter's extend graph has that width), as a chain verify hands them to the drafter.
        longest = shape.steps + 1
        path_nodes = device_tensor([paths[i] + [0] * (longest - len(paths[i])) for i in alive], dev)
        idx = device_tensor(alive, dev)
        path_features = features[idx[:, None], path_nodes]
        on_verify = getattr(engine.drafter, "on_tree_verify", engine.drafter.on_verify)
        on_verify([rows[i] for i in alive], path_features, [accepted[i] for i in alive])
    t2 = time.perf_counter()
    engine.step_times.draft_s += t1 - t0
    engine.step_times.verify_s += t2 - t1  # the tree's accept walk included
    engine.policy.observe(n, width - 1, accepted, t1 - t0, t2 - t1)
