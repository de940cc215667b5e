"""End to end into the real embedded engine: a Megatron policy (MTP included) synced over HTTP + gloo.

The headline check of issue 5: after a sync, the engine's logits for the target and for the MTP draft
equal the Megatron model's on the same input (float32). The engine server runs in this process (uvicorn
in a thread, exactly the app `python -m slime_spec.engine` serves) so the test can run the engine's own
model after the sync; every weight still travels through the HTTP routes and the gloo group.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from slime_spec.config import TrainConfig, WeightSyncConfig
from slime_spec.tiny_model import make_tiny_model
from slime_spec.engines.client import EngineClient
from slime_spec.weight_sync.gather import NamedTensor, iter_hf_state, iter_hf_tensors
from slime_spec.weight_sync.protocol import SpecSetup
from slime_spec.weight_sync.sync import WeightSyncer, WeightSyncError
from slime_spec.net import free_port

TINY = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
            max_position_embeddings=256)
EAGLE_FLAGS = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
               "--speculative-num-draft-tokens", "3"]




class InProcessEngine:
    """The embedded engine's HTTP app on 127.0.0.1, served from a thread of this process."""

    def __init__(self, model_path: Path, flags: list[str]):
        import uvicorn

        from slime_spec.engine.__main__ import make_core_factory
        from slime_spec.engine.http_server import create_app
        from slime_spec.engine.server_args import parse_server_args
        from slime_spec.engine.scheduler import EngineLoop
        from slime_spec.engine.weight_updater import WeightUpdater

        port = free_port()
        args = parse_server_args(["--model-path", str(model_path), "--host", "127.0.0.1", "--port", str(port),
                                  *flags])
        self.loop = EngineLoop(make_core_factory(args))
        self.loop.start()
        app = create_app(args, self.loop, WeightUpdater(args.weight_version, args.model_path, args.device,
                                                        args.has_draft_model))
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the in-process engine server did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{port}"
        self.client = EngineClient(self.url)

    @property
    def model(self):
        return self.loop.core.model

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.loop.stop()

    def generate(self, ids: list[int], n: int = 12) -> dict:
        return self.client.post("/generate", {"input_ids": ids, "sampling_params": {
            "temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}})


def engine_logits(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The engine model's target logits, and its MTP draft logits for `ids` [B, T].

    The draft runs the engine's own MTP modules in SGLang's alignment (position p reads token p+1 and
    the target's hidden state at p), as `CausalLM.mtp_forward` does, including SGLang's rule that the token
    embedding at position 0 is zeroed (the trainer applies the same rule for MiMo).
    """
    from slime_spec.engine.model import DecoderLayer, causal_mask, rope_cos_sin

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
def test_engine_logits_equal_megatron_after_sync(megatron, tmp_path, arch, transport, flags):
    from slime_spec.trainer import model as M

    mtp = 1 if arch == "mimo" else 0
    served = make_tiny_model(tmp_path / "served", arch=arch, seed=0, mtp_layers=max(mtp, 1), **TINY)
    trained = make_tiny_model(tmp_path / "trained", arch=arch, seed=1, mtp_layers=max(mtp, 1), **TINY)
    policy, hf_config = megatron_policy(trained, mtp)
    engine = InProcessEngine(served, flags)
    try:
        before = engine.generate([5, 6, 7, 8, 9])["output_ids"]
        syncer = WeightSyncer([engine.client], WeightSyncConfig(update_weight_buffer_size=16 * 1024,
                                                                check_weight_sync=True),
                              hf_config=hf_config, hf_checkpoint=served,
                              spec=SpecSetup.from_server_args(_spec_args(flags), str(served)),
                              has_mtp_layers=bool(mtp), transport=transport, master_port=free_port(),
                              disk_dir=tmp_path / "sync")
        metrics = syncer.sync(iter_hf_tensors(policy.named_parameters(), hf_config), weight_version="1")
        syncer.close()
        assert metrics["weight_sync_params"] > 0 and (metrics["weight_sync_mtp_params"] > 0) == bool(mtp)
        if transport != "disk":  # the engine's own seconds (slime_spec_engine_timing), inside the send time
            assert 0 < metrics["weight_sync_engine_load_s"] + metrics["weight_sync_engine_receive_s"] \
                <= metrics["weight_sync_send_s"]
        reply = engine.generate([5, 6, 7, 8, 9])
        assert reply["meta_info"]["weight_version"] == "1" and reply["output_ids"] != before

        ids = torch.randint(0, hf_config["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))
        ours, ours_mtp = engine_logits(engine.model, ids)
        with torch.no_grad():
            ref = M.forward(policy, ids, hf_config["vocab_size"], mtp_zero_first_token=True)
        torch.testing.assert_close(ours, ref.logits, atol=1e-4, rtol=0)
        if mtp:  # Megatron's MTP position i predicts token i+2 from hidden i and token i+1, as the engine's
            torch.testing.assert_close(ours_mtp, ref.mtp_logits[0][:, :-1], atol=1e-4, rtol=0)
    finally:
        engine.close()


def _spec_args(flags: list[str]) -> dict:
    return {"speculative_algorithm": flags[flags.index("--speculative-algorithm") + 1]} if flags else {}


@pytest.mark.parametrize("buffer_bytes,transport", [(1 << 30, "tensor"), (4096, "tensor"), (4096, "distributed")])
def test_failed_sync_leaves_the_engine_serving_previous_weights(tmp_path, buffer_bytes, transport):
    """One bucket, or many small ones of which the first ones land before the bad one: either way the
    engine ends up serving exactly the weights it had before the sync (checksums), and keeps generating."""
    served = make_tiny_model(tmp_path / "served", arch="mimo", seed=0, **TINY)
    new = make_tiny_model(tmp_path / "new", arch="mimo", seed=1, **TINY)
    engine = InProcessEngine(served, EAGLE_FLAGS)
    try:
        before = engine.generate([5, 6, 7, 8, 9])
        sums_before = engine.client.post("/weights_checker", {"action": "checksum", "selector": "all"})["ranks"]
        # every tensor new, but the final norm of a wrong shape: the engine refuses that request
        good = list(iter_hf_state(_state(new), _config(new)))
        bad = [t for t in good if t.name != "model.norm.weight"] + \
            [NamedTensor("model.norm.weight", torch.zeros(3), "target")]  # last: earlier buckets land first
        syncer = WeightSyncer([engine.client], WeightSyncConfig(update_weight_buffer_size=buffer_bytes),
                              hf_config=_config(served), hf_checkpoint=served,
                              spec=SpecSetup("EAGLE", None, str(served)),
                              has_mtp_layers=True, transport=transport, master_port=free_port())
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
    finally:
        engine.close()


def test_between_checksum_syncs_the_embedded_engine_is_covered_by_names(tmp_path):
    """--weight-sync-check-interval 3: syncs 1 and 2 check coverage by names only (no hashing), sync 3 reads the
    checksums; a sync that misses a served weight fails its names check."""
    served = make_tiny_model(tmp_path / "served", arch="mimo", seed=0, **TINY)
    new = make_tiny_model(tmp_path / "new", arch="mimo", seed=1, **TINY)
    engine = InProcessEngine(served, EAGLE_FLAGS)
    try:
        syncer = WeightSyncer([engine.client], WeightSyncConfig(weight_sync_check_interval=3),
                              hf_config=_config(served), hf_checkpoint=served, spec=SpecSetup("EAGLE", None, str(served)),
                              has_mtp_layers=True, transport="distributed", master_port=free_port())
        good = list(iter_hf_state(_state(new), _config(new)))
        flags = [(m["weight_sync_checked"], m["weight_sync_covered"])
                 for m in (syncer.sync(iter(good), weight_version=str(i)) for i in range(3))]
        assert flags == [(0, 1), (0, 1), (1, 1)]
        with pytest.raises(WeightSyncError, match=r"model\.norm\.weight.*not written|not written.*model\.norm"):
            syncer.sync(iter([t for t in good if t.name != "model.norm.weight"]), weight_version="4")
        syncer.close()
    finally:
        engine.close()


def test_failure_on_one_engine_of_two_rolls_back_the_other(tmp_path):
    """Engine B refuses a bucket that engine A already loaded: the syncer aborts the session everywhere,
    so A too serves exactly its previous weights (no mix across engines), and generation continues."""
    served = make_tiny_model(tmp_path / "served", arch="mimo", seed=0, **TINY)
    wider = make_tiny_model(tmp_path / "wider", arch="mimo", seed=0, **{**TINY, "intermediate_size": 96})
    new = make_tiny_model(tmp_path / "new", arch="mimo", seed=1, **TINY)
    a, b = InProcessEngine(served, EAGLE_FLAGS), InProcessEngine(wider, EAGLE_FLAGS)
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
        a.close()
        b.close()


def _state(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _config(path: Path) -> dict:
    import json

    return json.loads((path / "config.json").read_text())


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
                              has_mtp_layers=True, transport="distributed", master_port=free_port())
        metrics = syncer.sync(tensors, weight_version="tp")
        syncer.close()
    else:
        metrics = {"gathered": sum(1 for _ in tensors)}
    ids = torch.randint(0, hf_config["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = M.forward(model, ids, hf_config["vocab_size"], mtp_zero_first_token=True)
    if rank == 0:
        torch.save({"ids": ids, "logits": ref.logits, "mtp_logits": ref.mtp_logits[0], "metrics": metrics}, out)
    dist.barrier()
    parallel.destroy_parallel()


def test_engine_logits_equal_megatron_tp2_after_sync(tmp_path):
    """Tensor parallel size 2 over gloo: the TP shards are all-gathered before conversion."""
    import torch.multiprocessing as mp

    served = make_tiny_model(tmp_path / "served", arch="mimo", seed=0, **TINY)
    trained = make_tiny_model(tmp_path / "trained", arch="mimo", seed=1, **TINY)
    engine = InProcessEngine(served, EAGLE_FLAGS)
    try:
        out = tmp_path / "megatron_tp2.pt"
        mp.start_processes(_tp_worker, args=(2, free_port(), str(trained), engine.url, str(out)), nprocs=2,
                           start_method="spawn")
        ref = torch.load(out)
        assert ref["metrics"]["weight_sync_mtp_params"] > 0
        ours, ours_mtp = engine_logits(engine.model, ref["ids"])
        torch.testing.assert_close(ours, ref["logits"], atol=1e-4, rtol=0)
        torch.testing.assert_close(ours_mtp, ref["mtp_logits"][:, :-1], atol=1e-4, rtol=0)
    finally:
        engine.close()


def test_standalone_draft_survives_syncs_and_canary_tracks_acceptance(tmp_path):
    """An untrained external draft keeps its weights through every sync (selector "target"); the canary reads
    accept length after each sync and after a release/resume cycle."""
    from slime_spec.weight_sync.canary import AcceptanceCanary

    served = make_tiny_model(tmp_path / "served", arch="llama", seed=0, **TINY)
    draft = make_tiny_model(tmp_path / "draft", arch="llama", seed=0, **TINY)  # drafts exactly what the target says
    flags = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(draft),
             "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    spec = SpecSetup("STANDALONE", str(draft), str(served))
    engine = InProcessEngine(served, flags)
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
def test_colocated_sync_lands_and_reports_its_split(tmp_path, flatten):
    """The tensor transport of --colocate, flattened buckets (upstream slime's form) or one tensor at a time: every
    served tensor equals the sent one, and the split the colocated bench prints is measured, not zero."""
    from slime_spec.weight_sync.transports import TensorTransport

    served = make_tiny_model(tmp_path / "served", arch="mimo", seed=0, **TINY)
    new = make_tiny_model(tmp_path / "new", arch="mimo", seed=1, **TINY)
    engine = InProcessEngine(served, EAGLE_FLAGS)
    try:
        syncer = WeightSyncer([engine.client], WeightSyncConfig(update_weight_buffer_size=4096, check_weight_sync=True),
                              hf_config=_config(served), hf_checkpoint=served,
                              spec=SpecSetup("EAGLE", None, str(served)), has_mtp_layers=True, transport="tensor")
        syncer.prepare()
        syncer.transport = TensorTransport(syncer.clients, session=syncer.protocol.session, flatten=flatten)
        report = syncer.sync_report(iter_hf_state(_state(new), _config(new)), weight_version="2")
        assert report.buckets > 1 and report.served_written["target"] > 0  # check_weight_sync compared the values
        t = syncer.transport
        assert t.serialize_s > 0 and (t.flatten_s > 0) == flatten
        assert 0 < report.split.engine_snapshot_s <= report.split.engine_load_s  # the rollback copies, in the load
        assert report.metrics()["weight_sync_engine_snapshot_s"] == report.split.engine_snapshot_s
        norm = engine.client.post("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 1 << 20})
        norm = norm.get("result") if isinstance(norm, dict) else norm  # the client wraps a bare list
        assert torch.equal(torch.tensor(norm), _state(new)["model.norm.weight"].float())
        syncer.close()
    finally:
        engine.close()
