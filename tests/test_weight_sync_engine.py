"""End to end into the real embedded engine: a Megatron policy (MTP included) synced over HTTP + gloo.

The headline check of issue 5: after a sync the engine serves exactly the Megatron model's weights, for the
target and for the MTP draft. The engine is a real `python -m slime_spec.engine` process (tests/helpers/
engine_server.py), read over HTTP only: SGLang's `/weights_checker` checksums of every served tensor equal those
of the tensors the policy converts to, and greedy /generate with logprobs equals the Megatron model's argmax and
log-softmax. That those weights give Megatron's logits and MTP-draft logits in the engine's own model is checked
one level down, on an in-process `EngineCore` loaded with the same tensors (`core_logits`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slime_spec.common.net import free_port
from slime_spec.config.run_config import TrainConfig, WeightSyncConfig
from slime_spec.fleet.client import EngineClient
from slime_spec.tools.tiny_model import make_tiny_model
from slime_spec.weight_sync.gather import NamedTensor, iter_hf_state, iter_hf_tensors
from slime_spec.weight_sync.protocol import SpecSetup
from slime_spec.weight_sync.sync import WeightSyncer, WeightSyncError
from tests.helpers.engine_server import EAGLE_FLAGS, TINY, EngineServer, expected_checksums
from tests.helpers.engine_server import checkpoint_config as _config
from tests.helpers.engine_server import checkpoint_state as _state


@pytest.fixture
def engine(tiny_mimo_engine):
    """The session's MiMo engine (EAGLE over its MTP layer, tests/conftest.py), back on its checkpoint."""
    tiny_mimo_engine.reset()
    return tiny_mimo_engine


def engine_logits(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The engine model's target logits, and its MTP draft logits for `ids` [B, T].

    The draft runs the engine's own MTP modules in SGLang's alignment (position p reads token p+1 and
    the target's hidden state at p), as `CausalLM.mtp_forward` does, including SGLang's rule that the token
    embedding at position 0 is zeroed (the trainer applies the same rule for MiMo).
    """
    from slime_spec.engine.model_executor.model import DecoderLayer, causal_mask, rope_cos_sin
    B, T = ids.shape
    positions = torch.arange(T)[None].expand(B, T)
    slots = torch.arange(B)
    with torch.no_grad():
        hidden = model(ids, positions, model.new_cache(B, T), slots)
        logits = model.logits(hidden)
        if not model.args.mtp_layers:
            return logits, None
        mtp, pos = model.model.mtp_layers[0], positions[:, :-1]
        embeds = model.model.embed_tokens(ids[:, 1:]).masked_fill((pos == 0)[..., None], 0.0)
        x = mtp.input_proj(torch.cat((mtp.hidden_layernorm(hidden[:, :-1]), mtp.token_layernorm(embeds)), -1))
        cos, sin = rope_cos_sin(pos, model.args.head_dim, model.args.rope_theta, x.dtype)
        cache = model.new_mtp_cache(B, T)
        x = DecoderLayer.forward(mtp, x, cos, sin, cache.k[0], cache.v[0], slots, pos, causal_mask(pos, T - 1), T - 1)
        return logits, model.logits(mtp.final_layernorm(x))


def core_logits(tensors: dict[str, torch.Tensor], like: Path, flags: list[str], ids: torch.Tensor, out: Path):
    """`engine_logits` of an in-process EngineCore serving `tensors` (HF names) in checkpoint `like`'s config."""
    import shutil

    from safetensors.torch import save_file

    from slime_spec.engine.managers.scheduler_process import make_core_factory
    from slime_spec.engine.server_args import parse_server_args
    shutil.copytree(like, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    args = parse_server_args(["--model-path", str(out), *flags])
    return engine_logits(make_core_factory(args)().model, ids)


def assert_serves(engine: EngineServer, tensors: dict[str, torch.Tensor], hf_config: dict, mtp: bool) -> None:
    """Every tensor the engine's runners serve (target, and the MTP draft when `mtp`) is the one `tensors` gives."""
    served = engine.checksums()[0]["checksums"]
    expected = expected_checksums(tensors.items(), hf_config, engine, mtp_draft=mtp)
    assert sorted(served) == sorted(expected)
    assert {n: (served[n], expected[n]) for n in expected if served[n] != expected[n]} == {}
    assert any(n.startswith("draft.") for n in served) == mtp


@pytest.fixture(scope="module")
def megatron():
    from slime_spec.trainer import parallel
    parallel.init_single_process(seed=0)


def megatron_policy(path: Path, mtp_layers: int):
    from slime_spec.trainer import model as M
    hf_config, hf_state = M.read_hf_config(path), M.read_hf_state(path)
    train = TrainConfig(hf_checkpoint=str(path), mtp_num_layers=mtp_layers)
    model = M.build_gpt_model(hf_config, train)
    M.load_hf_weights(model, hf_state, hf_config, tp_rank=0, tp_size=1)
    return model.eval(), hf_config


@pytest.mark.parametrize("arch,transport,flags", [
    ("mimo", "distributed", EAGLE_FLAGS),
    ("llama", "tensor", []),
    ("qwen2", "disk", ["--speculative-algorithm", "NGRAM"]),
])
def test_engine_serves_megatron_weights_after_sync(request, megatron, tmp_path, arch, transport, flags):
    from slime_spec.trainer import model as M
    mtp = 1 if arch == "mimo" else 0
    if arch == "mimo":  # the session's engine serves exactly this checkpoint with these flags
        engine, own = request.getfixturevalue("engine"), None
        served = engine.model_path
    else:
        served = make_tiny_model(tmp_path / "served", arch=arch, seed=0, mtp_layers=1, **TINY)
        engine = own = EngineServer(served, flags, log_path=tmp_path / "engine.log").start()
    trained = make_tiny_model(tmp_path / "trained", arch=arch, seed=1, mtp_layers=max(mtp, 1), **TINY)
    policy, hf_config = megatron_policy(trained, mtp)
    try:
        before = engine.generate([5, 6, 7, 8, 9])["output_ids"]
        syncer = WeightSyncer([engine.client], WeightSyncConfig(update_weight_buffer_size=16 * 1024,
                                                                check_weight_sync=True),
                              hf_config=hf_config, hf_checkpoint=served,
                              spec=SpecSetup.from_server_args(_spec_args(flags), str(served)),
                              has_mtp_layers=bool(mtp), transport=transport,
                              disk_dir=tmp_path / "sync")
        metrics = syncer.sync(iter_hf_tensors(policy.named_parameters(), hf_config), weight_version="1")
        syncer.close()
        assert metrics["weight_sync_params"] > 0 and (metrics["weight_sync_mtp_params"] > 0) == bool(mtp)
        # the engine's own seconds ride in SGLang's reply message (EngineTiming.tagged) and reach the split; the
        # disk transport's one update is sent at the end of the sync, outside the timed buckets
        engine_s = metrics["weight_sync_engine_load_s"] + metrics["weight_sync_engine_receive_s"]
        assert (engine_s > 0) == (transport != "disk")
        reply = engine.generate([5, 6, 7, 8, 9], logprobs=True)
        assert reply["meta_info"]["weight_version"] == "1" and reply["output_ids"] != before

        # the engine serves the policy's tensors, MTP ones in the draft runner included
        sent = {t.name: t.tensor.detach().clone() for t in iter_hf_tensors(policy.named_parameters(), hf_config)}
        assert_serves(engine, sent, hf_config, bool(mtp))
        # its greedy tokens and their logprobs are the Megatron model's
        seq = torch.tensor([[5, 6, 7, 8, 9, *reply["output_ids"]]])
        with torch.no_grad():
            logp = M.forward(policy, seq, hf_config["vocab_size"], mtp_zero_first_token=True).logits[0].log_softmax(-1)
        steps = logp[4:-1]
        assert steps.argmax(-1).tolist() == reply["output_ids"]
        engine_lp = torch.tensor([e[0] for e in reply["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(engine_lp, steps.gather(-1, seq[0, 5:, None])[:, 0], atol=1e-4, rtol=0)

        # one level down: the engine's model on those tensors gives Megatron's logits and MTP-draft logits
        ids = torch.randint(0, hf_config["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))
        ours, ours_mtp = core_logits(sent, served, flags, ids, tmp_path / "synced")
        with torch.no_grad():
            ref = M.forward(policy, ids, hf_config["vocab_size"], mtp_zero_first_token=True)
        torch.testing.assert_close(ours, ref.logits, atol=1e-4, rtol=0)
        if mtp:  # Megatron's MTP position i predicts token i+2 from hidden i and token i+1, as the engine's
            torch.testing.assert_close(ours_mtp, ref.mtp_logits[0][:, :-1], atol=1e-4, rtol=0)
    finally:
        if own is not None:
            own.close()


def _spec_args(flags: list[str]) -> dict:
    return {"speculative_algorithm": flags[flags.index("--speculative-algorithm") + 1]} if flags else {}


@pytest.mark.parametrize("buffer_bytes,transport,flatten", [(1 << 30, "tensor", None), (4096, "tensor", None),
                                                            (4096, "distributed", False), (4096, "distributed", True)])
def test_failed_sync_leaves_the_engine_serving_previous_weights(engine, tmp_path, buffer_bytes, transport, flatten):
    """One bucket, or many small ones of which the first ones land before the bad one: either way the
    engine ends up serving exactly the weights it had before the sync (checksums), and keeps generating. Over
    distributed, tensor by tensor (received into the parameters) and one flattened bucket per broadcast."""
    served = engine.model_path
    new = make_tiny_model(tmp_path / "new", arch="mimo", seed=1, **TINY)
    before = engine.generate([5, 6, 7, 8, 9])
    sums_before = engine.client.post("/weights_checker", {"action": "checksum", "selector": "all"})["ranks"]
    # every tensor new, but the final norm of a wrong shape: the engine refuses that request
    good = list(iter_hf_state(_state(new), _config(new)))
    bad = [t for t in good if t.name != "model.norm.weight"] + \
        [NamedTensor("model.norm.weight", torch.zeros(3), "target")]  # last: earlier buckets land first
    syncer = WeightSyncer([engine.client], WeightSyncConfig(update_weight_buffer_size=buffer_bytes),
                          hf_config=_config(served), hf_checkpoint=served,
                          spec=SpecSetup("EAGLE", None, str(served)),
                          has_mtp_layers=True, transport=transport)
    syncer.prepare()
    if transport == "distributed":
        syncer.transport.flatten = flatten
    with pytest.raises(WeightSyncError, match="previous weights") as err:
        syncer.sync(iter(bad), weight_version="2")
    assert err.value.engines_serve_previous_weights
    if buffer_bytes < 1 << 30:
        assert "rolled the session back" in str(err.value)
    after = engine.generate([5, 6, 7, 8, 9])
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"]
    assert engine.client.post("/weights_checker", {"action": "checksum", "selector": "all"})["ranks"] == sums_before
    syncer.sync(iter(good), weight_version="3")  # the same syncer recovers with a clean sync
    assert engine.generate([5, 6, 7, 8, 9])["meta_info"]["weight_version"] == "3"
    syncer.close()


def test_check_interval_reads_the_checksums_every_nth_sync(engine, tmp_path):
    """--weight-sync-check-interval 3: syncs 1 and 2 are not checked (SGLang has no cheaper listing of what a
    runner serves than its checksums), sync 3 reads the checksums; a checked sync that misses a served weight
    fails naming it."""
    served = engine.model_path
    new = make_tiny_model(tmp_path / "new", arch="mimo", seed=1, **TINY)
    syncer = WeightSyncer([engine.client], WeightSyncConfig(weight_sync_check_interval=3),
                          hf_config=_config(served), hf_checkpoint=served, spec=SpecSetup("EAGLE", None, str(served)),
                          has_mtp_layers=True, transport="distributed")
    good = list(iter_hf_state(_state(new), _config(new)))
    flags = [(m["weight_sync_checked"], m["weight_sync_covered"])
             for m in (syncer.sync(iter(good), weight_version=str(i)) for i in range(5))]
    assert flags == [(0, 0), (0, 0), (1, 1), (0, 0), (0, 0)]
    with pytest.raises(WeightSyncError, match=r"model\.norm\.weight.*not written|not written.*model\.norm"):
        syncer.sync(iter([t for t in good if t.name != "model.norm.weight"]), weight_version="6")
    syncer.close()


def test_failure_on_one_engine_of_two_rolls_back_the_other(engine, tmp_path):
    """Engine B refuses a bucket that engine A already loaded: the syncer aborts the session everywhere,
    so A too serves exactly its previous weights (no mix across engines), and generation continues."""
    served = engine.model_path
    wider = make_tiny_model(tmp_path / "wider", arch="mimo", seed=0, **{**TINY, "intermediate_size": 96})
    new = make_tiny_model(tmp_path / "new", arch="mimo", seed=1, **TINY)
    a, b = engine, EngineServer(wider, EAGLE_FLAGS, log_path=tmp_path / "wider.log").start()
    try:
        before = a.generate([5, 6, 7, 8, 9])
        sums_before = a.client.post("/weights_checker", {"action": "checksum", "selector": "all"})["ranks"]
        syncer = WeightSyncer([a.client, b.client], WeightSyncConfig(update_weight_buffer_size=4096),
                              hf_config=_config(served), hf_checkpoint=served,
                              spec=SpecSetup("EAGLE", None, str(served)), has_mtp_layers=True, transport="tensor")
        with pytest.raises(WeightSyncError, match="rolled the session back") as err:
            syncer.sync(iter_hf_state(_state(new), _config(new)), weight_version="2")
        assert err.value.engines_serve_previous_weights
        assert a.client.post("/weights_checker", {"action": "checksum", "selector": "all"})["ranks"] == sums_before
        after = a.generate([5, 6, 7, 8, 9])
        assert after["output_ids"] == before["output_ids"] and after["meta_info"]["weight_version"] == "default"
        syncer.close()
    finally:
        b.close()


def _tp_worker(rank: int, tp_size: int, port: int, trained: str, engine_url: str, out: str) -> None:
    """One of `tp_size` train processes: Megatron TP shards, gathered and synced by rank 0 (collective)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from slime_spec.trainer import model as M
    from slime_spec.trainer import parallel
    parallel.init_parallel(rank, tp_size, "127.0.0.1", port, tp_size=tp_size, seed=0)
    hf_config, hf_state = M.read_hf_config(trained), M.read_hf_state(trained)
    model = M.build_gpt_model(hf_config, TrainConfig(hf_checkpoint=trained, mtp_num_layers=1,
                                                     tensor_model_parallel_size=tp_size))
    M.load_hf_weights(model, hf_state, hf_config, tp_rank=rank, tp_size=tp_size)
    model.eval()
    tensors = iter_hf_tensors(model.named_parameters(), hf_config,
                              tp_group=parallel_state.get_tensor_model_parallel_group(), tp_size=tp_size)
    if rank == 0:
        syncer = WeightSyncer([EngineClient(engine_url)], WeightSyncConfig(check_weight_sync=True),
                              hf_config=hf_config, hf_checkpoint=trained, spec=SpecSetup("EAGLE", None, trained),
                              has_mtp_layers=True, transport="distributed")
        metrics = syncer.sync(tensors, weight_version="tp")
        syncer.close()
    else:
        metrics = {"gathered": sum(1 for _ in tensors)}
    ids = torch.randint(0, hf_config["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = M.forward(model, ids, hf_config["vocab_size"], mtp_zero_first_token=True)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    sent = {t.name: t.tensor.detach().clone() for t in iter_hf_tensors(  # collective: every rank gathers
        model.named_parameters(), hf_config, tp_group=tp_group, tp_size=tp_size)}
    if rank == 0:
        torch.save({"ids": ids, "logits": ref.logits, "mtp_logits": ref.mtp_logits[0], "metrics": metrics,
                    "sent": sent}, out)
    dist.barrier()
    parallel.destroy_parallel()


def test_engine_serves_megatron_tp2_weights_after_sync(engine, tmp_path):
    """Tensor parallel size 2 over gloo: the TP shards are all-gathered before conversion."""
    import torch.multiprocessing as mp

    served = engine.model_path
    trained = make_tiny_model(tmp_path / "trained", arch="mimo", seed=1, **TINY)
    out = tmp_path / "megatron_tp2.pt"
    mp.start_processes(_tp_worker, args=(2, free_port(), str(trained), engine.url, str(out)), nprocs=2,
                       start_method="spawn")
    ref = torch.load(out)
    assert ref["metrics"]["weight_sync_mtp_params"] > 0
    assert_serves(engine, ref["sent"], _config(trained), mtp=True)
    # one level down: the engine's model on those tensors gives Megatron's logits and MTP-draft logits
    ours, ours_mtp = core_logits(ref["sent"], served, EAGLE_FLAGS, ref["ids"], tmp_path / "synced")
    torch.testing.assert_close(ours, ref["logits"], atol=1e-4, rtol=0)
    torch.testing.assert_close(ours_mtp, ref["mtp_logits"][:, :-1], atol=1e-4, rtol=0)


def test_standalone_draft_survives_syncs_and_canary_tracks_acceptance(tmp_path):
    """An untrained external draft keeps its weights through every sync (selector "target"); the canary reads
    accept length after each sync and after a release/resume cycle."""
    from slime_spec.weight_sync.verify.canary import AcceptanceCanary
    served = make_tiny_model(tmp_path / "served", arch="llama", seed=0, **TINY)
    draft = make_tiny_model(tmp_path / "draft", arch="llama", seed=0, **TINY)  # drafts exactly what the target says
    flags = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(draft),
             "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    spec = SpecSetup("STANDALONE", str(draft), str(served))
    engine = EngineServer(served, flags, log_path=tmp_path / "engine.log").start()
    try:
        canary = AcceptanceCanary(spec, max_new_tokens=16)
        canary.set_probe_from_samples([[5, 6, 7, 8, 9], [20, 21, 22], [30, 31, 32, 33]])
        draft_before = engine.client.post("/weights_checker", {"action": "checksum", "selector": "draft"})
        aligned = canary.run([engine.client], "sync")["spec_canary_accept_length"]
        assert aligned > 2.0 and canary.last_verdict.level == "ok"

        engine.client.post("/release_memory_occupation", {})
        engine.client.post("/resume_memory_occupation", {})
        assert canary.run([engine.client], "resume")["spec_canary_accept_length"] == aligned

        syncer = WeightSyncer([engine.client], WeightSyncConfig(check_weight_sync=True), hf_config=_config(served),
                              hf_checkpoint=served, spec=spec, has_mtp_layers=False, transport="tensor")
        for seed in (1, 2):
            new = make_tiny_model(tmp_path / f"new{seed}", arch="llama", seed=seed, **TINY)
            syncer.sync(iter_hf_state(_state(new), _config(new)), weight_version=str(seed))
        draft_after = engine.client.post("/weights_checker", {"action": "checksum", "selector": "draft"})
        assert draft_after["ranks"][0]["checksums"] == draft_before["ranks"][0]["checksums"]
        # the policy moved away from the frozen draft: acceptance collapses and the canary says why
        drifted = canary.run([engine.client], "sync")["spec_canary_accept_length"]
        assert drifted < aligned and canary.last_verdict.level in ("warning", "error")
        assert "STANDALONE" in canary.last_verdict.message
    finally:
        engine.close()


@pytest.mark.parametrize("flatten", [True, False])
def test_colocated_sync_lands_and_reports_its_split(engine, tmp_path, flatten):
    """The tensor transport of --colocate, flattened buckets (upstream slime's form) or one tensor at a time: every
    served tensor equals the sent one, and the split the colocated bench prints is measured, not zero."""
    from slime_spec.weight_sync.transports.http_transports import TensorTransport
    served = engine.model_path
    new = make_tiny_model(tmp_path / "new", arch="mimo", seed=1, **TINY)
    syncer = WeightSyncer([engine.client], WeightSyncConfig(update_weight_buffer_size=4096, check_weight_sync=True),
                          hf_config=_config(served), hf_checkpoint=served,
                          spec=SpecSetup("EAGLE", None, str(served)), has_mtp_layers=True, transport="tensor")
    syncer.prepare()
    syncer.transport = TensorTransport(syncer.clients, session=syncer.protocol.session, flatten=flatten)
    report = syncer.sync_report(iter_hf_state(_state(new), _config(new)), weight_version="2")
    assert report.buckets > 1 and report.served_written["target"] > 0  # check_weight_sync compared the values
    t = syncer.transport
    assert t.serialize_s > 0 and (t.flatten_s > 0) == flatten
    # the engine's own seconds ride in SGLang's reply message; its rollback snapshot is inside its load
    assert 0 < report.split.engine_snapshot_s <= report.split.engine_load_s
    assert report.metrics()["weight_sync_engine_snapshot_s"] == report.split.engine_snapshot_s
    assert torch.equal(engine.served("model.norm.weight"), _state(new)["model.norm.weight"].float())
    syncer.close()
