"""--colocate with two trainer ranks (DP 2, gloo on CPU) and two embedded engines of TP 1: per-rank buckets
through the train actor's own path (`TrainActor.connect_engines` / `sync_weights`).

Each trainer rank is a process of its own running `TrainActor` directly (what `TrainGroup` runs inside a Ray
actor); the engines are two `python -m slime_spec.engine` server processes. Engine e is on the
GPU of trainer rank e, so it must serve rank e's bytes: after the train step, rank 1 adds 1 to its own copy of the
final norm (real DP replicas hold equal weights), so an entry that came from the wrong rank is seen. A second
sync, in which rank 1's tensor stream fails midway, must fail on both ranks (no hang) and leave both engines on
the weights of the first sync (the embedded engine rolls the session back).

The same with the two ranks as two pipeline stages: each stage broadcasts its tensors to the other, so both ranks
hold the whole model and each feeds the engine on its own GPU (SGLang opens a CUDA IPC handle only on a device the
engine sees); rank 1 holds the final norm, so both engines serve its moved copy.
"""

from __future__ import annotations

import multiprocessing
import pickle
import traceback

import pytest
import torch

from slime_spec.common.net import free_port
from tests.helpers.engine_server import EAGLE_FLAGS, EngineServer

EAGLE = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 2, "speculative_eagle_topk": 1,
         "speculative_num_draft_tokens": 3}
NORM, EMBED = "model.norm.weight", "model.embed_tokens.weight"
INJECTED = "rank 1 lost a shard (injected)"


def rollout():
    from slime_spec.rollout.sample import Sample
    gen = torch.Generator().manual_seed(0)
    out = []
    for g in range(2):
        prompt = torch.randint(5, 60, (4,), generator=gen).tolist()
        for j in range(2):
            response = torch.randint(5, 60, (5,), generator=gen).tolist()
            out.append(Sample(index=len(out), group_index=g, prompt="p", tokens=prompt + response,
                              response_length=5, reward=float(j)))
    return out


def failing_after(params, n: int):
    for i, item in enumerate(params):
        if i == n:
            raise RuntimeError(INJECTED)
        yield item


def run_trainer_rank(rank: int, port: int, model: str, urls: list[str], out_path: str, disk_dir: str,
                     pp: int = 1) -> None:
    from slime_spec.config.run_config import TrainConfig, WeightSyncConfig
    from slime_spec.trainer.actor import TrainActor
    result = {}
    actor = TrainActor(rank, 2)
    try:
        train = TrainConfig(hf_checkpoint=model, mtp_num_layers=1, enable_mtp_training=True, lr=1e-2,
                            global_batch_size=4, micro_batch_size=2, n_samples_per_prompt=2,
                            pipeline_model_parallel_size=pp)
        actor.init(train, "127.0.0.1", port)
        actor.connect_engines(urls, WeightSyncConfig(weight_sync_transport="tensor", update_weight_buffer_size=4096,
                                                     weight_sync_check_interval=1),
                              EAGLE, model, colocate=True, engine_tp_size=1, disk_dir=disk_dir)
        result["colocated_ranks"] = actor.colocated_ranks
        actor.train_step(rollout(), 0)
        trainer = actor.trainer
        result["pp"] = trainer.tp.pp_size
        if rank == 1:
            norm = next(p for n, p in trainer.model.named_parameters() if n.endswith("decoder.final_layernorm.weight"))
            with torch.no_grad():
                norm.add_(1.0)
        result["hf"] = {n: t.clone() for n, t in actor.hf_state_dict().items() if n in (NORM, EMBED)}
        result["sync"] = actor.sync_weights("1")
        if rank == 1:
            own = trainer.named_megatron_params
            trainer.named_megatron_params = lambda **kw: failing_after(own(**kw), 3)
        try:
            actor.sync_weights("2")
            result["second"] = "succeeded"
        except Exception as e:
            result["second"] = f"{type(e).__name__}: {e}"
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        with open(out_path, "wb") as f:
            pickle.dump(result, f)
        actor.shutdown()


def served(engine: EngineServer, name: str) -> torch.Tensor:
    return engine.served(name)


@pytest.mark.parametrize("pp", [1, pytest.param(2, marks=pytest.mark.nightly(
    covered_by="tests/e2e/test_colocated_rank_buckets.py::"
               "test_each_colocated_engine_serves_its_own_trainer_ranks_trained_weights[1]"))])
def test_each_colocated_engine_serves_its_own_trainer_ranks_trained_weights(tmp_path, tiny_mimo_engine, pp):
    # engine 0: the session's (tests/conftest.py), back on its checkpoint; engine 1: a fresh one of the same model
    model = tiny_mimo_engine.model_path
    engines = [tiny_mimo_engine, EngineServer(model, EAGLE_FLAGS, log_path=tmp_path / "engine1.log").launch()]
    try:
        tiny_mimo_engine.reset()
        engines[1].wait_ready()
        checkpoint = {n: served(engines[0], n) for n in (NORM, EMBED)}
        ctx = multiprocessing.get_context("spawn")
        port, outs = free_port(), [tmp_path / f"rank{r}.pkl" for r in range(2)]
        procs = [ctx.Process(target=run_trainer_rank, args=(r, port, str(model), [e.url for e in engines],
                                                            str(outs[r]), str(tmp_path / "disk"), pp))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=240)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        assert not alive, "a trainer rank hung: the sync did not end on every rank"
        ranks = [pickle.loads(o.read_bytes()) for o in outs]
        assert all("error" not in r for r in ranks), [r.get("error") for r in ranks]
        assert [r["colocated_ranks"] for r in ranks] == [2, 2] and [r["pp"] for r in ranks] == [pp, pp]
        first = ranks[0]["sync"]
        assert first["weight_sync_params"] > 0 and first["weight_sync_mtp_params"] > 0
        assert first["weight_sync_buckets"] > 1
        assert 0 < first["weight_sync_ranks_wait_s"] <= first["weight_sync_send_s"]  # rank 0 waited for rank 1
        assert ranks[1]["sync"] == {}  # rank 0 reports the sync

        if pp == 1:
            # engine e serves trainer rank e's trained tensors: the embedding both ranks trained alike, the norm
            # rank 1 moved on its own copy only
            for e, engine in enumerate(engines):
                own = ranks[e]["hf"]
                assert torch.equal(served(engine, EMBED), own[EMBED].float()), e
                assert torch.equal(served(engine, NORM), own[NORM].float()), e
            assert torch.equal(served(engines[1], NORM), served(engines[0], NORM) + 1)
        else:  # rank 0's gathered view holds every stage's: the first's embedding, the last's (moved) norm
            whole = ranks[0]["hf"]
            for e, engine in enumerate(engines):
                assert torch.equal(served(engine, EMBED), whole[EMBED].float()), e
                assert torch.equal(served(engine, NORM), whole[NORM].float()), e
        assert not torch.equal(ranks[0]["hf"][EMBED], checkpoint[EMBED])  # trained, not the checkpoint

        # rank 1's stream failed in the second sync: both ranks fail, naming it; the engines keep the first sync
        assert INJECTED in ranks[1]["second"] and INJECTED in ranks[0]["second"], [r["second"] for r in ranks]
        assert "trainer rank 1" in ranks[0]["second"]
        for e, engine in enumerate(engines):
            assert torch.equal(served(engine, NORM), ranks[e if pp == 1 else 0]["hf"][NORM].float()), e
    finally:
        engines[1].close()
