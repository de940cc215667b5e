"""Per-trainer-rank colocated buckets (weight_sync/transports/colocated.py), with real gloo groups on CPU.

Every trainer rank is a process of its own (a default gloo group, as Megatron's); rank 0 runs the tensor
transport and the others `follow_sync`. The engines are test doubles for the HTTP hop: each request body is read
by SGLang 0.5.23's own code, one engine TP rank at a time (`TpModelWorker.deserialize_own_rank`, then its
FlattenedTensorBucket), so what each engine TP rank would load is what is checked. Every rank's tensors differ
by its rank (real ranks hold equal tensors), so an entry that came from the wrong rank is seen.
"""

from __future__ import annotations

import multiprocessing
import pickle
import traceback

import pytest
import torch

from slime_spec.common.net import free_port
from slime_spec.weight_sync.transports.colocated import ColocatedLayout

TENSORS = [("model.embed_tokens.weight", (64, 16), torch.float32), ("model.layers.0.mlp.up_proj.weight", (32, 16),
           torch.bfloat16), ("model.norm.weight", (16,), torch.float32), ("model.mtp_layers.0.norm.weight", (16,),
           torch.float32)]


def rank_tensors(rank: int, drift: bool = False):
    """What trainer rank `rank` holds after the TP all-gather (plus `rank`, to tell the ranks' entries apart)."""
    from slime_spec.weight_sync.gather import NamedTensor
    g = torch.Generator().manual_seed(0)
    out = []
    for name, shape, dtype in TENSORS:
        if drift and name == "model.norm.weight":
            name = "model.final_norm.weight"
        kind = "mtp" if ".mtp_layers." in name else "target"
        out.append(NamedTensor(name, (torch.randn(shape, generator=g) + rank).to(dtype), kind))
    return out


class SGLangEngine:
    """Test double for one engine's HTTP hop: its TP ranks read the body with SGLang's own code."""

    def __init__(self, url: str, tp_size: int, fail_on: int | None = None):
        self.url, self.tp_size, self.fail_on, self.loaded = url, tp_size, fail_on, []

    def post(self, path: str, body: dict) -> dict:
        from tests.conformance.test_tensor_transport import sglang_rank_loads, sglang_rank_reads

        read = sglang_rank_loads if body.get("load_format") == "flattened_bucket" else sglang_rank_reads
        assert path == "/update_weights_from_tensor" and len(body["serialized_named_tensors"]) == self.tp_size
        if self.fail_on == len(self.loaded):
            raise RuntimeError(f"{self.url} refused bucket {self.fail_on}")
        self.loaded.append([{n: t.clone() for n, t in read(body, r)} for r in range(self.tp_size)])
        return {"success": True, "message": "Success"}


def failing_after(tensors, n: int):
    for i, t in enumerate(tensors):
        if i == n:
            raise RuntimeError("this rank's conversion failed (injected)")
        yield t


def run_case(rank: int, world: int, case: dict) -> dict:
    """One sync of `case` on the group every case shares: each case must end on every rank for the next to run."""
    import torch.distributed as dist

    from slime_spec.weight_sync.gather import make_buckets, only_wanted_kinds
    from slime_spec.weight_sync.transports.colocated import RankBuckets, follow_sync
    from slime_spec.weight_sync.transports.http_transports import TensorTransport
    result = {}
    try:
        channel = RankBuckets(dist.group.WORLD, ColocatedLayout.of(world, case["engine_tp"]))
        tensors = rank_tensors(rank, drift=case.get("drift_rank") == rank)
        if case.get("stream_fails_on") == rank:
            tensors = failing_after(tensors, 2)
        channel.next_sync() if rank == 0 else None
        if rank != 0:
            result["buckets"] = follow_sync(channel, iter(tensors))
        elif case.get("abort_before_start"):
            channel.abort("pause_generation failed")
        else:
            engines = [SGLangEngine(f"http://engine-{e}", case["engine_tp"], case.get("fail_on"))
                       for e in range(channel.layout.num_engines)]
            transport = TensorTransport(engines, engine_tp_size=case["engine_tp"], rank_buckets=channel,
                                        flatten=case["flatten"])
            transport.start()
            channel.start(mtp=False, draft=False, buffer_bytes=case["buffer_bytes"], flatten=case["flatten"])
            try:
                for bucket in make_buckets(only_wanted_kinds(iter(tensors), mtp=False, draft=False),
                                           case["buffer_bytes"]):
                    transport.send(bucket, "target", "v1")
                transport.finish("v1")
            except Exception:
                channel.abort("rank 0 failed")  # what WeightSyncer.sync_report does
                raise
            finally:
                result["loaded"] = [e.loaded for e in engines]
                result["seconds"] = {"flatten": transport.flatten_s, "serialize": transport.serialize_s,
                                     "wait": channel.wait_s}
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    return result


def run_rank(rank: int, world: int, port: int, cases: dict, out_path: str) -> None:
    """Every case, in order, in one process per rank (one spawn for the whole module: spawns cost seconds)."""
    import torch.distributed as dist

    results = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        for name, case in cases.items():
            results[name] = run_case(rank, world, case)
    except Exception as e:
        results["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        with open(out_path, "wb") as f:
            pickle.dump(results, f)
        if dist.is_initialized():
            dist.destroy_process_group()


CASES = {
    "tp2_flat": dict(engine_tp=2, flatten=True, buffer_bytes=4096),
    "tp1_flat": dict(engine_tp=1, flatten=True, buffer_bytes=4096),
    "tp2_direct": dict(engine_tp=2, flatten=False, buffer_bytes=4096),
    "refused": dict(engine_tp=2, flatten=True, buffer_bytes=4096, fail_on=1),
    "abort": dict(engine_tp=2, flatten=True, buffer_bytes=4096, abort_before_start=True),
    "drift": dict(engine_tp=2, flatten=True, buffer_bytes=1 << 20, drift_rank=1),
    "stream_fails": dict(engine_tp=2, flatten=True, buffer_bytes=4096, stream_fails_on=1),
    "after_failures": dict(engine_tp=2, flatten=True, buffer_bytes=4096),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    """Two trainer ranks run every case of CASES in order: {case: [rank 0's result, rank 1's]}."""
    world, tmp = 2, tmp_path_factory.mktemp("colocated")
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    outs = [tmp / f"rank{r}.pkl" for r in range(world)]
    procs = [ctx.Process(target=run_rank, args=(r, world, port, CASES, str(outs[r]))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung: the exchange did not end on every rank"
    per_rank = [pickle.loads(o.read_bytes()) for o in outs]
    assert all("error" not in r for r in per_rank), [r.get("error") for r in per_rank]
    return {name: [r[name] for r in per_rank] for name in CASES}


@pytest.mark.parametrize("case,engine_tp", [("tp2_flat", 2), ("tp1_flat", 1), ("tp2_direct", 2),
                                            ("after_failures", 2)])
def test_each_engine_tp_rank_loads_the_bucket_of_the_trainer_rank_on_its_gpu(results, case, engine_tp):
    """Two trainer ranks: one engine of TP 2, or two engines of TP 1; engine e's TP rank r reads trainer rank
    e * tp + r's entry, with every name, dtype and value of that rank's tensors (also after failed syncs on the
    same group)."""
    ranks = results[case]
    assert all("error" not in r for r in ranks), [r.get("error") for r in ranks]
    loaded = ranks[0]["loaded"]  # [engine][bucket][tp rank] -> {name: tensor}
    assert len(loaded) == 2 // engine_tp and ranks[1]["buckets"] == len(loaded[0]) > 1
    for e, buckets in enumerate(loaded):
        for tp_rank in range(engine_tp):
            trainer_rank = e * engine_tp + tp_rank
            got = {n: t for bucket in buckets for n, t in bucket[tp_rank].items()}
            want = {t.name: t.tensor for t in rank_tensors(trainer_rank) if t.kind == "target"}
            assert got.keys() == want.keys()  # the MTP tensor was not wanted, on any rank
            assert all(got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]) for n in want), trainer_rank


@pytest.mark.parametrize("case,flatten", [("tp2_flat", True), ("tp2_direct", False)])
def test_rank_0_makes_its_entry_as_the_transport_does_and_reports_its_wait(results, case, flatten):
    """Rank 0's own entry is staged and serialized by the tensor transport's one path (tensor_payload.stage_bucket,
    serialize_bucket, as follow_sync does on the other ranks), so its flatten counts as flatten (it counted as
    serialize); the time it waited for the other ranks' entries is measured (weight_sync_ranks_wait_s)."""
    seconds = results[case][0]["seconds"]
    assert (seconds["flatten"] > 0) == flatten and seconds["serialize"] > 0
    assert seconds["wait"] > 0


def test_a_refused_bucket_fails_the_sync_on_every_rank(results):
    ranks = results["refused"]
    assert "refused bucket 1" in ranks[0]["error"]
    assert "bucket 1 failed" in ranks[1]["error"] and "refused bucket 1" in ranks[1]["error"]
    assert len(ranks[0]["loaded"][0]) == 1  # the first bucket landed, then the sync ended everywhere


def test_rank_0_failing_before_the_first_bucket_releases_the_other_ranks(results):
    assert "aborted by the trainer's rank 0: pause_generation failed" in results["abort"][1]["error"]


def test_ranks_whose_tensor_streams_differ_fail_instead_of_loading_a_mix(results):
    ranks = results["drift"]
    assert "streams differ" in ranks[0]["error"] and "streams differ" in ranks[1]["error"]
    assert ranks[0]["loaded"] == [[]]  # nothing reached the engine


def test_a_failing_tensor_stream_on_another_rank_fails_the_sync_on_every_rank(results):
    """Rank 1's gather or conversion raises while it makes its second bucket: rank 0 learns it in that bucket's
    exchange (naming rank 1), sends nothing more, and both ranks end the sync."""
    ranks = results["stream_fails"]
    assert "trainer rank 1 could not hand over its bucket" in ranks[0]["error"]
    assert "conversion failed (injected)" in ranks[0]["error"] and "conversion failed (injected)" in ranks[1]["error"]
    assert len(ranks[0]["loaded"][0]) == 1  # the first bucket (the embedding alone) landed, the second never left


def test_layout_needs_a_multiple_of_the_engine_tp_size():
    assert ColocatedLayout.of(4, 2).entries_of(1, ["a", "b", "c", "d"]) == ["c", "d"]
    with pytest.raises(ValueError, match="multiple of the engines' --tp-size"):
        ColocatedLayout.of(3, 2)


def test_on_gpus_an_engine_without_a_trainer_rank_on_its_gpu_is_refused_at_connect():
    """SGLang's update_weights_from_tensor opens a CUDA IPC handle only on a device the engine sees (its
    patch_torch raises "Invalid device_uuid", met on two H200s): two engines on two GPUs with one trainer rank would
    fail at the first sync, so the connect refuses it; on the CPU rank 0 sends every entry as before."""
    from slime_spec.weight_sync.transports.colocated import colocated_rank_buckets
    with pytest.raises(ValueError, match="span 2 GPUs but the trainer has 1 rank.*--rollout-num-gpus <="):
        colocated_rank_buckets(0, 1, num_engines=2, engine_tp_size=1, cuda=True)
    assert colocated_rank_buckets(0, 1, num_engines=2, engine_tp_size=1, cuda=False) == (None, 0)
