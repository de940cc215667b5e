"""One host copy of the weights for the memory release and the rollback mirror (model_executor/pinned_weights.py).

On CPU the copy runs unpinned over a CPU engine whose weights were moved into one allocation, as the memory saver
moves them on a GPU; the release's unmap and map are the saver's (CUDA only): here the block is overwritten between
`save` and `restore`, as memory mapped again holds anything. The saver's own path runs in the CUDA test at the end.
"""

import random
import subprocess
import sys
import textwrap

import pytest
import torch

from slime_spec.engine.model_executor.pinned_weights import ByteRanges, PinnedWeightCopy
from slime_spec.tools.tiny_model import make_tiny_model
from tests.helpers.engine_weights import (
    abort,
    begin,
    engine_weights,
    request,
    served_bytes,
    tensor_update,
    update_bucket,
)


def test_byte_ranges_equal_a_set_of_bytes_under_random_adds_and_removes():
    rng = random.Random(0)
    ranges, model = ByteRanges(), set()
    for _ in range(2000):
        a = rng.randrange(200)
        b = a + rng.randrange(30)
        if rng.random() < 0.5:
            ranges.add(a, b)
            model |= set(range(a, b))
        else:
            ranges.remove(a, b)
            model -= set(range(a, b))
        listed = list(ranges)
        assert all(s < e for s, e in listed) and all(e < s2 for (_, e), (s2, _) in zip(listed, listed[1:]))
        assert {i for s, e in listed for i in range(s, e)} == model
        assert ranges.nbytes == len(model)
        q = rng.randrange(200)
        assert ranges.overlaps(q, q + 5) == bool(model & set(range(q, q + 5)))


def test_a_save_copies_only_what_a_load_wrote_since_the_last_copy():
    block = torch.arange(64, dtype=torch.uint8)
    copy = PinnedWeightCopy(block)
    a = block[8:24].view(torch.float32)  # a served tensor in the block
    assert copy.view_of(a).data_ptr() == copy.host.data_ptr() + 8 and not copy.current(a)
    copy.save(session_open=False)
    assert copy.saved_bytes == 64 and copy.current(a) and torch.equal(copy.host, block)
    copy.save(session_open=False)
    assert copy.saved_bytes == 0  # nothing written since
    copy.load(a, torch.full((4,), 2.0))
    assert not copy.current(a) and copy.current(block[32:40])
    copy.save(session_open=False)
    assert copy.saved_bytes == 16 and torch.equal(copy.view_of(a), a)
    block.fill_(0xAB)  # the memory a resume maps again holds anything
    copy.restore()
    assert copy.pending.nbytes == 64 and copy.complete() == 64 and not copy.pending
    assert torch.equal(a, torch.full((4,), 2.0)) and torch.equal(block[:8], torch.arange(8, dtype=torch.uint8))
    assert copy.span(torch.zeros(4)) is None and copy.view_of(torch.zeros(4)) is None  # not in the block
    assert copy.view_of(block[:16].view(4, 4)[:, :2]) is None  # a non-contiguous tensor has no view


def test_a_release_inside_an_open_session_keeps_its_rollback_values():
    block = torch.zeros(32, dtype=torch.uint8)
    copy = PinnedWeightCopy(block)
    copy.save(session_open=False)
    copy.load(block[:16], torch.full((16,), 7, dtype=torch.uint8))  # the host keeps what a rollback restores
    copy.save(session_open=True)
    assert torch.equal(copy.host, torch.zeros(32, dtype=torch.uint8))  # untouched
    block.fill_(0xAB)
    copy.restore()  # from the release's own buffer, at once
    assert torch.equal(block[:16], torch.full((16,), 7, dtype=torch.uint8)) and not block[16:].any()
    assert copy._side is None and not copy.current(block[:16]) and not copy.pending


def test_a_resume_copies_back_only_what_no_load_wrote_and_only_before_a_read():
    block = torch.arange(64, dtype=torch.uint8)
    copy = PinnedWeightCopy(block)
    copy.save(session_open=False)
    block.fill_(0xAB)
    copy.restore()
    assert not torch.equal(block, torch.arange(64, dtype=torch.uint8))  # nothing copied yet
    copy.load(block[0:16], torch.full((16,), 1, dtype=torch.uint8))  # the sync after the resume
    strided = block[32:48].view(4, 4)[:, :2]  # a strided write: the bytes between its elements come back first
    copy.load(strided, torch.full((4, 2), 2, dtype=torch.uint8))
    assert copy.complete(block[16:24]) == 8 and torch.equal(block[16:24], torch.arange(16, 24, dtype=torch.uint8))
    assert copy.pending.nbytes == 64 - 16 - 8 - 14  # the strided write's extent: 4 rows of 4 bytes, less 2
    assert copy.complete() == 26 and not copy.pending
    expected = torch.arange(64, dtype=torch.uint8)
    expected[0:16] = 1
    expected[32:48].view(4, 4)[:, :2] = 2
    assert torch.equal(block, expected)


def test_the_mirror_keeps_a_keys_view_until_its_tensor_moves():
    from slime_spec.engine.weights.mirror import HostMirror
    block = torch.arange(64, dtype=torch.uint8)
    copy = PinnedWeightCopy(block)
    mirror = HostMirror(copy)
    a, b = block[:16].view(torch.float32), block[16:32].view(torch.float32)
    buf, copied = mirror.backup_of(("target", "w"), a)
    assert copied and buf.data_ptr() == copy.host.data_ptr() and torch.equal(buf, a)
    assert mirror.backup_of(("target", "w"), a) == (buf, False)  # fresh: the same view
    buf, copied = mirror.backup_of(("target", "w"), b)  # the name now serves other bytes
    assert copied and buf.data_ptr() == copy.host.data_ptr() + 16 and torch.equal(buf, b)
    outside = torch.ones(4)
    buf, copied = mirror.backup_of(("target", "w"), outside)  # outside the block: a buffer of its own
    assert copied and not copy.host.data_ptr() <= buf.data_ptr() < copy.host.data_ptr() + 64


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("pinned_weights") / "mimo", arch="mimo", hidden_size=32,
                           num_layers=2, seed=5)


def core_in_one_allocation(model):
    """A CPU engine whose weights were moved into one allocation, with the copy the saver's path makes of it."""
    from slime_spec.engine.managers.engine_core import EngineCore
    from slime_spec.engine.model_executor.memory_saver import copy_into_one_allocation
    core = EngineCore(str(model), None, max_running_requests=2)
    core.memory.host_copy = PinnedWeightCopy(copy_into_one_allocation([core.model], core.device))
    return core


def engine_with_layer_names(model):
    """core_in_one_allocation's engine, its weight side, its target's tensors, four layer tensors' names and bytes."""
    core = core_in_one_allocation(model)
    target = core.named_weights("target")
    names = [n for n in target if n.startswith("model.layers.")][:4]
    return core, engine_weights(core), target, names, sum(target[n].numel() * target[n].element_size() for n in names)


def release(core, session_open: bool = False) -> int:
    """What the saver's release and resume of the weights do to them (managers/memory_occupation.py), the unmapping
    aside: the memory mapped again holds anything."""
    copy = core.memory.host_copy
    copy.save(session_open=session_open)
    copy.block.fill_(0xAB)
    copy.restore()
    return copy.saved_bytes


def release_and_resume(core, session_open: bool = False) -> int:
    """A release, and a resume of everything (the engine copies back what is left at once)."""
    saved = release(core, session_open)
    core.memory.host_copy.complete()
    return saved


def test_the_mirror_and_the_release_share_one_copy_and_a_release_after_a_sync_copies_nothing(model):
    core, weights, target, names, nbytes = engine_with_layer_names(model)
    copy = core.memory.host_copy
    start = served_bytes(core)
    assert release_and_resume(core) == copy.block.numel()  # the first release copies everything
    assert all(torch.equal(served_bytes(core)[k], start[k]) for k in start)

    assert begin(weights, "target").success
    timing = update_bucket(weights, names, 7.0, target)
    assert timing["snapshot_copied_bytes"] == 0  # the release's copy held every rollback value already
    assert timing["snapshot_mirrored_bytes"] == nbytes
    assert weights.handle(request("EndWeightUpdateReqInput")).success  # the mirror copies them in the background
    synced = served_bytes(core)
    assert release_and_resume(core) == 0  # ... into the release's copy: nothing left to copy
    assert all(torch.equal(served_bytes(core)[k], synced[k]) for k in synced)
    host = copy.host
    mirror = weights.session.mirror
    assert mirror.buffers and all(host.data_ptr() <= b.data_ptr() < host.data_ptr() + host.numel()
                                  for b in mirror.buffers.values())  # no host memory of its own

    assert begin(weights, "target").success
    update_bucket(weights, names, 9.0, target)
    assert release_and_resume(core, session_open=True) == copy.block.numel()  # a release mid-session
    assert torch.equal(core.named_weights("target")[names[0]], torch.full_like(target[names[0]], 9.0))
    assert abort(weights).success  # the rollback values survived the release
    assert all(torch.equal(served_bytes(core)[k], synced[k]) for k in synced)
    assert release_and_resume(core) == nbytes  # the rollback wrote them: copied again, conservatively
    assert all(torch.equal(served_bytes(core)[k], synced[k]) for k in synced)


def test_the_sync_after_a_resume_of_the_weights_leaves_only_the_rest_to_copy_back(model):
    """slime's staged order: the weights resumed, a sync, then the KV cache and graphs. The resume copies nothing
    back; the sync writes its tensors; what it did not write comes back before a checksum reads it, and a failed
    sync rolls back to the values from before the release."""
    from slime_spec.engine.weights.checker import runner_checksums
    core, weights, target, names, nbytes = engine_with_layer_names(model)
    copy = core.memory.host_copy
    start, sums = served_bytes(core), runner_checksums(core, "target")
    release(core)
    assert copy.pending.nbytes == copy.block.numel()
    assert begin(weights, "target").success
    assert update_bucket(weights, names, 7.0, target)["snapshot_copied_bytes"] == 0
    assert weights.handle(request("EndWeightUpdateReqInput")).success
    assert copy.pending.nbytes == copy.block.numel() - nbytes
    assert copy.complete() == copy.block.numel() - nbytes
    served = served_bytes(core)
    assert all(torch.equal(served[k], start[k]) for k in start if k.split(".", 1)[1] not in names)
    assert all(torch.equal(served["target." + n], torch.full_like(target[n], 7.0)) for n in names)

    release(core)
    assert runner_checksums(core, "target") != sums and not copy.pending  # a read copies the rest back first
    release(core)
    assert begin(weights, "target").success
    update_bucket(weights, names[:2], 9.0, target)
    assert not tensor_update(weights, "target", [(names[2], torch.zeros(3))]).success  # rolled back
    assert abort(weights).success
    copy.complete()
    assert all(torch.equal(served_bytes(core)[k], served[k]) for k in served)


def test_a_load_outside_a_session_is_copied_at_the_next_release(model):
    from slime_spec.engine.weights.receive import EngineTiming
    core = core_in_one_allocation(model)
    weights = engine_weights(core)
    release_and_resume(core)
    target = core.named_weights("target")
    name = next(n for n in target if n.startswith("model.layers."))
    ok, _ = weights._load([(name, torch.full_like(target[name], 5.0))], "target", "ok", EngineTiming(), "disk")
    assert ok
    assert release_and_resume(core) == target[name].numel() * target[name].element_size()
    assert torch.equal(core.named_weights("target")[name], torch.full_like(target[name], 5.0))


CUDA_CHECK = textwrap.dedent("""
    import sys, torch
    from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams
    from slime_spec.engine.weights.receive import EngineTiming
    from slime_spec.speculative.settings import SpecConfig
    from tests.helpers.engine_runs import run_to_completion
    from tests.helpers.engine_weights import abort, begin, engine_weights, request, served_bytes

    core = EngineCore(sys.argv[1], SpecConfig("EAGLE", 3, 1, 4), dtype="bfloat16", device="cuda",
                      max_running_requests=4, memory_saver=True)
    weights = engine_weights(core, "cuda")
    copy = core.memory.host_copy
    ids = core.tokenizer("release and resume")["input_ids"]

    def greedy(rid):
        req = Request(rid, ids, SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True))
        return run_to_completion(core, [req])[rid].output_ids

    before = greedy("a")
    core.release_memory(None)
    assert copy.saved_bytes == copy.block.numel(), copy.saved_bytes
    core.resume_memory(None)
    assert greedy("b") == before
    target = core.named_weights("target")
    names = [n for n in target if n.startswith("model.layers.")][:6]

    def load(value):
        timing = EngineTiming()
        assert weights._load([(n, torch.full_like(target[n], value)) for n in names], "target", "ok", timing,
                             "test")[0]
        return timing

    assert begin(weights, "target").success
    assert load(0.01).snapshot_copied_bytes == 0  # the release's copy held every rollback value
    assert weights.handle(request("EndWeightUpdateReqInput")).success
    synced = served_bytes(core)
    core.release_memory(["weights"])
    assert copy.saved_bytes == 0, copy.saved_bytes  # the mirror's background copy caught the host up
    core.resume_memory(["weights"])
    assert all(torch.equal(served_bytes(core)[k], synced[k]) for k in synced)
    assert begin(weights, "target").success
    load(0.02)
    core.release_memory(["weights"])  # inside the session: its rollback values stay in the shared copy
    core.resume_memory(["weights"])
    assert torch.equal(core.named_weights("target")[names[0]], torch.full_like(target[names[0]], 0.02))
    assert abort(weights).success
    assert all(torch.equal(served_bytes(core)[k], synced[k]) for k in synced)
    host = copy.host
    assert host.is_pinned() and all(host.data_ptr() <= b.data_ptr() < host.data_ptr() + host.numel()
                                    for b in weights.session.mirror.buffers.values())
    core.release_memory(None)  # slime's staged order: the weights, a sync, then the KV cache and graphs
    core.resume_memory(["weights"])
    assert copy.pending.nbytes == copy.block.numel()  # nothing copied back yet
    assert begin(weights, "target").success
    load(0.03)
    assert weights.handle(request("EndWeightUpdateReqInput")).success
    written = sum(target[n].numel() * target[n].element_size() for n in names)
    assert copy.pending.nbytes == copy.block.numel() - written
    core.resume_memory(["kv_cache", "cuda_graph"])
    assert not copy.pending
    served = served_bytes(core)
    assert all(torch.equal(served["target." + n], torch.full_like(target[n], 0.03)) for n in names)
    assert all(torch.equal(served[k], synced[k]) for k in synced if k.split(".", 1)[1] not in names)
    assert len(greedy("c")) == 24
    print("ok")
""")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU machine)")
def test_the_memory_savers_release_shares_the_mirrors_pinned_copy_on_cuda(tmp_path):
    torch_memory_saver = pytest.importorskip("torch_memory_saver")
    cuda_model = make_tiny_model(tmp_path / "m", arch="mimo", mtp_layers=1, dtype="bfloat16", hidden_size=64,
                                 num_layers=2)
    with torch_memory_saver.configure_subprocess():  # the allocator hook, preloaded as SGLang's launcher does
        out = subprocess.run([sys.executable, "-c", CUDA_CHECK, str(cuda_model)], capture_output=True, text=True,
                             timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-3000:] + out.stderr[-3000:]
