"""One speculative step (engine/speculative/): sampling mixed batches without reading the device, and what the
step policy and the drafters are told of each step (drained plain steps, catch-ups), once."""

import time

import pytest
import torch

from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams
from slime_spec.engine.managers.request import Row
from slime_spec.engine.model_executor import sampling
from slime_spec.engine.model_executor.cuda_graph import CudaGraphSettings
from slime_spec.engine.speculative import accept_drafts, draft_pick
from slime_spec.speculative.settings import resolve_or_raise
from slime_spec.tools.tiny_model import make_tiny_model
from tests.test_engine_sampling import MIXED, mask_reference, no_device_reads

V = 50


def masked_pick(logits, p, generator):
    """Draft sampling with the sampled rows picked by boolean masks: tokens [B] and q [B, V]."""
    sampled = ~p.greedy
    tokens, q = logits.argmax(-1), torch.zeros_like(logits)
    q[sampled] = mask_reference(logits[sampled], p.temps[sampled], p.top_ks[sampled], p.top_ps[sampled],
                                p.min_ps[sampled])
    tokens[sampled] = sampling.sample(q[sampled], generator)
    return tokens, q


def masked_accept(logits, drafts, draft_probs, p, generator):
    """accept_drafts with the greedy and sampled rows picked by boolean masks."""
    greedy, sampled, k1 = p.greedy, ~p.greedy, logits.shape[1]
    reps = [t[sampled].repeat_interleave(k1) for t in (p.temps, p.top_ks, p.top_ps, p.min_ps)]
    probs = mask_reference(logits[sampled].flatten(0, 1), *reps).view(-1, k1, logits.shape[-1])
    q = None if draft_probs is None else draft_probs[sampled]
    accept, next_token = torch.zeros_like(drafts[:, 0]), torch.zeros_like(drafts[:, 0])
    accept[sampled], next_token[sampled] = sampling.speculative_accept(probs, q, drafts[sampled], generator)
    accept[greedy], next_token[greedy] = sampling.greedy_accept(logits[greedy], drafts[greedy])
    return accept, next_token


def test_mixed_batches_draft_and_accept_from_host_known_rows_as_boolean_masks_would(monkeypatch):
    """Greedy and sampled rows, filtered and not: draft picks and acceptance take the sampled rows by index (no
    boolean mask, no device read) and give bitwise the tokens, q and generator state of the masked form."""
    gen = torch.Generator().manual_seed(8)
    logits, drafts = torch.randn(6, 4, V, generator=gen) * 3, torch.randint(V, (6, 3), generator=gen)
    for params in (MIXED, MIXED[1:3]):
        p = sampling.batch_params(params, V, "cpu")
        n = len(params)
        ours, ref = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
        with no_device_reads(monkeypatch):
            tokens, q = draft_pick(p, ours, draft_sampling=True)(logits[:n, 0])
            chains = [q[:, None].expand(-1, 3, -1).contiguous(), None]
            accepted = [accept_drafts(logits[:n], drafts[:n], c, p, ours) for c in chains]
        ref_tokens, ref_q = masked_pick(logits[:n, 0], p, ref)
        assert torch.equal(tokens, ref_tokens) and torch.equal(q, ref_q)
        for (accept, next_token), chain in zip(accepted, chains):
            ref_accept, ref_next = masked_accept(logits[:n], drafts[:n], chain, p, ref)
            assert torch.equal(accept, ref_accept) and torch.equal(next_token, ref_next)
        assert torch.equal(ours.get_state(), ref.get_state())  # the same draws, in the same order


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU machine)")
def test_mixed_batch_sampling_issues_no_stream_sync_on_cuda(tmp_path):
    """On CUDA a step over greedy and sampled rows with top-p / top-k / min-p filters (pick, draft pick,
    acceptance with and without q, logprobs) queues its work without waiting for the stream; the batch's
    parameters are built once before (one pinned copy per batch composition)."""
    target = make_tiny_model(tmp_path / "t", hidden_size=32, num_layers=1, seed=3)
    engine = EngineCore(str(target), None, device="cuda", cuda_graph=CudaGraphSettings(disable=True))
    vocab = engine.vocab_size
    rows = [Row(Request(f"r{i}", [5, 6], params, return_logprob=i == 1)) for i, params in enumerate(MIXED)]
    p = engine.batch_params(rows)
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(len(rows), 4, vocab, device="cuda") * 3
    drafts = torch.randint(vocab, (len(rows), 3), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine._pick_on_device(rows, logits[:, 0].clone())
        _, q = draft_pick(p, gen, draft_sampling=True)(logits[:, 0])
        accept_drafts(logits, drafts, q[:, None].expand(-1, 3, -1), p, gen)
        accept_drafts(logits, drafts, None, p, gen)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


class RecordingSteps:
    """A step policy that plays a fixed sequence of draft lengths (then repeats the last) and records every
    observation as (batch size, k, draft seconds, verify seconds, switch seconds)."""

    def __init__(self, ks: list[int]):
        self.ks, self.max_num_steps, self.i, self.seen = ks, max(ks), 0, []

    def choose(self, batch_size: int) -> int:
        self.i += 1
        return self.ks[min(self.i - 1, len(self.ks) - 1)]

    def observe(self, batch_size, k, accepted, draft_s, verify_s, switch_s=0.0) -> None:
        self.seen.append((batch_size, k, draft_s, verify_s, switch_s))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculative")
    llama = make_tiny_model(root / "llama", hidden_size=32, num_layers=2, seed=11)
    return {"llama": llama, "draft": make_tiny_model(root / "draft", hidden_size=32, num_layers=1, seed=12,
                                                     init_from=str(llama)),
            "mimo": make_tiny_model(root / "mimo", arch="mimo", hidden_size=32, num_layers=1, seed=13)}


def engine_for(models, algorithm: str, ks: list[int], **kw) -> EngineCore:
    if algorithm == "STANDALONE":
        spec = resolve_or_raise({"speculative_algorithm": "STANDALONE", "speculative_num_steps": 3,
                                 "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4,
                                 "speculative_draft_model_path": str(models["draft"])})
        engine = EngineCore(str(models["llama"]), spec, max_running_requests=4, **kw)
    else:
        spec = resolve_or_raise({"speculative_algorithm": "NEXTN", "speculative_num_steps": 3,
                                 "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4})
        engine = EngineCore(str(models["mimo"]), spec, max_running_requests=4, **kw)
    engine.spec_worker.policy = RecordingSteps(ks)
    for i in range(3):
        engine.add_request(Request(f"r{i}", engine.tokenizer(f"prompt {i} " * (i + 2))["input_ids"],
                                   SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True)))
    return engine


@pytest.mark.parametrize("algorithm", ["NEXTN", "STANDALONE"])
def test_every_plain_step_under_the_overlap_schedule_is_observed_once_in_order(models, algorithm):
    """A plain step that a speculative step reads back (a run's last, or a lone probe of k = 0) is observed there,
    as k = 0 over the rows it ran, before the speculative step itself: every chosen step is observed once."""
    ks = [2, 0, 2, 0, 0, 0, 3, 1, 0, 2]
    engine = engine_for(models, algorithm, ks, overlap_schedule=True)
    for _ in ks:
        engine.step()
    seen = engine.policy.seen
    assert [k for _, k, *_ in seen] == ks and all(batch == 3 for batch, *_ in seen)


def test_standalone_catch_up_after_plain_steps_is_switch_time_not_draft_time(models, monkeypatch):
    """After plain steps the draft model has more than a verify's one or two tokens to feed: that backlog is fed
    by catch_up_deferred (the policy's switch seconds), and each draft step feeds one token. The clock here
    advances by the tokens each draft forward feeds, so the seconds count draft tokens."""
    engine = engine_for(models, "STANDALONE", [2, 0, 0, 0, 2])
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    fed = lambda module, args: clock.__setitem__(0, clock[0] + args[0].shape[1])  # noqa: E731 (tokens [B, T])
    engine.drafter.draft.register_forward_pre_hook(fed)
    for _ in range(5):
        engine.step()
    (_, k, draft_s, _, switch_s) = engine.policy.seen[-1]
    assert (k, draft_s) == (2, 2.0)  # two draft steps of one token each
    assert switch_s >= 3  # the three plain steps' tokens (and the last accepted draft's, for some rows)
    assert engine.policy.seen[0][4] == 0.0  # after a prefill nothing is behind: no catch-up


def test_deferred_work_is_caught_up_once_per_speculative_step(models, monkeypatch):
    """The engine runs the MTP layer's catch-up once before drafting; drafting does not scan for it again."""
    engine = engine_for(models, "NEXTN", [2, 0, 0, 2, 2])
    calls = []
    catch_up = engine.drafter.mtp.catch_up_deferred
    monkeypatch.setattr(engine.drafter.mtp, "catch_up_deferred", lambda rows: calls.append(len(rows)) or catch_up(rows))
    for _ in range(5):
        engine.step()
    assert calls == [3, 3, 3]  # the three speculative steps
