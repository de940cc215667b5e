"""Colocated weight sync (the tensor transport of --colocate) vs a plain copy of the same bytes on the same device.

Trainer and engine share one device: a Megatron model in this process, an embedded engine server
(`python -m slime_spec.engine`, a separate process) beside it. Each sync is what `--colocate` runs: gather +
convert, one `/update_weights_from_tensor` per bucket (a flattened bucket by default, as upstream slime sends;
on CUDA one IPC handle per bucket, which the engine opens and copies from into its parameters), end, flush.
The baseline copies the very tensors the sync sent into preallocated buffers on the same device
(`Tensor.copy_`, then a device sync), interleaved with the syncs: the bytes moved once, nothing else.

Split per sync: gather+convert (trainer), flatten (one device copy into the flat bucket, trainer), serialize
(pickling the handle or, on CPU, the bytes), engine receive (deserialize: opening the handle), engine load less
the snapshot (validation, the copies, the device sync before the reply), the engine's rollback snapshot in a
column of its own with its bytes (GB copied to the host on the sync's path / GB its host mirror already held),
HTTP (the rest of the update requests), flush.

The served checkpoint is the trainer's own random initialisation, written once per shape under --model-cache
and reused by later runs; the trainer then negates its weights so every sync changes what is served, and the
last sync is read back by name (`/get_weights_by_name`) to prove it landed.

    python bench/weight_sync_colocated.py --device cpu                          # CPU, small model
    python bench/weight_sync_colocated.py --preset mimo-7b --num-layers 8 --dtype bfloat16 --device cuda \\
        --bucket-mb 512 2048 --format flattened direct                         # one GPU, MiMo-7B-RL shapes
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import requests
import torch

from bench.weight_sync import PRESETS, add_shape_args, small_cache_flags, start_engine
from slime_spec.config.run_config import TrainConfig, WeightSyncConfig
from slime_spec.fleet.client import EngineClient
from slime_spec.weight_sync.gather import iter_hf_tensors
from slime_spec.weight_sync.protocol import SpecSetup
from slime_spec.weight_sync.sync import WeightSyncer
from slime_spec.weight_sync.transports.http_transports import TensorTransport, engine_timing

ENGINE_FLAGS = ("--disable-cuda-graph", *small_cache_flags(256, 2))  # start fast


def model_config(a) -> dict:
    from slime_spec.tools.tiny_model import make_config
    preset = PRESETS[a.preset]
    hidden = a.hidden_size or preset["hidden_size"]
    return make_config("mimo", vocab_size=a.vocab or preset["vocab_size"], hidden_size=hidden,
                       num_layers=a.num_layers or preset["num_layers"], num_heads=preset["num_heads"],
                       num_kv_heads=preset["num_kv_heads"], intermediate_size=preset["intermediate_size"] or 4 * hidden,
                       max_position_embeddings=preset["max_position_embeddings"], dtype=a.dtype, mtp_layers=1,
                       tie_word_embeddings=False)


def cached_checkpoint(cache: Path, config: dict, model) -> Path:
    """The checkpoint the engine starts from: written from `model` the first time this shape is asked for."""
    from safetensors.torch import save_file

    from slime_spec.tools.tiny_model import BOS_ID, EOS_ID, PAD_ID, write_tokenizer
    key = (f"mimo-h{config['hidden_size']}-l{config['num_hidden_layers']}-v{config['vocab_size']}-"
           f"i{config['intermediate_size']}-{config['torch_dtype']}")
    path = cache / key
    if (path / "model.safetensors").exists():
        return path
    tmp = cache / f"{key}.partial"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}))
    write_tokenizer(tmp, config["vocab_size"])
    state = {t.name: t.tensor.detach().cpu().contiguous() for t in iter_hf_tensors(model.named_parameters(), config)}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(path)
    return path


class SnapshotTierTransport(TensorTransport):
    """The colocated transport, also summing the engine's rollback snapshot bytes (copied on the sync's path, or
    held already by its host mirror; from its `slime_spec_engine_timing`) over one sync."""

    def start(self) -> None:
        super().start()
        self.snapshot_copied_bytes = self.snapshot_mirrored_bytes = 0

    def post(self, staged, selector, weight_version, flush_cache=False):
        return CountingInFlight(self, super().post(staged, selector, weight_version, flush_cache))


class CountingInFlight:
    """An InFlight whose replies add their snapshot bytes to the transport's sums."""

    def __init__(self, transport: SnapshotTierTransport, in_flight):
        self.transport, self.in_flight = transport, in_flight

    def wait(self) -> list[dict]:
        replies = self.in_flight.wait()
        self.transport.snapshot_copied_bytes += int(engine_timing(replies, "snapshot_copied_bytes"))
        self.transport.snapshot_mirrored_bytes += int(engine_timing(replies, "snapshot_mirrored_bytes"))
        return replies

    def settle(self, timeout_s: float) -> str | None:
        return self.in_flight.settle(timeout_s)


class DeviceCopy:
    """The baseline: copy the sent tensors into buffers of their own on the same device, once per round."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.src = tensors
        self.dst = [torch.empty_like(t) for t in tensors]
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def round(self) -> float:
        sync = torch.cuda.synchronize if self.src[0].is_cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for d, s in zip(self.dst, self.src):
            d.copy_(s)
        sync()
        return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"],
                   help="the one device trainer and engine share")
    p.add_argument("--bucket-mb", type=int, nargs="+", default=None,
                   help="--update-weight-buffer-size in MiB; several values: one row each (default 512 on cuda; 16 "
                        "on cpu, where the bytes travel inline in the request body, which the engine caps at 32 MiB)")
    p.add_argument("--format", nargs="+", default=["flattened"], choices=["flattened", "direct"],
                   help="flattened: one flat tensor per bucket (load_format flattened_bucket, the default of the "
                        "tensor transport); direct: every tensor as it is; several: one row each")
    p.add_argument("--sync", nargs="+", default=["pipelined"], choices=["pipelined", "serial"],
                   help="pipelined: the product's sync (the next bucket gathered and flattened while one is in "
                        "flight, the last update labelling and flushing); serial: each bucket after the last one's "
                        "reply, then /flush_cache and /update_weight_version (before 2026-12-01); several: one row "
                        "each, interleaved")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--between-syncs-s", type=float, default=1.0,
                   help="idle seconds before each sync, as rollouts would take in a run: the engine copies what the "
                        "last sync wrote to its host mirror (its rollback values) in the background meanwhile")
    p.add_argument("--model-cache", type=Path, default=Path("outputs/bench_models"),
                   help="where the served checkpoint of each shape is written once and reused")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a GPU; use --device cpu")
    a.bucket_mb = a.bucket_mb or ([512] if a.device == "cuda" else [16])

    from slime_spec.trainer import model as M
    from slime_spec.trainer import parallel
    parallel.init_single_process(seed=0)
    config = model_config(a)
    t0 = time.perf_counter()
    model = M.build_gpt_model(config, TrainConfig(hf_checkpoint="", mtp_num_layers=1, bf16=a.dtype == "bfloat16"))
    model = model.to(a.device)
    served = cached_checkpoint(a.model_cache, config, model)
    with torch.no_grad():
        for param in model.parameters():
            param.neg_()  # every sync changes what the engine serves
    sent = [t.tensor for t in iter_hf_tensors(model.named_parameters(), config)]
    copy = DeviceCopy(sent)
    proc, url = start_engine(served, a.device, None, served.parent / f"{served.name}.engine.log", ENGINE_FLAGS)
    print(f"set-up (model, checkpoint, engine) {time.perf_counter() - t0:.1f} s; engine log "
          f"{served.parent / f'{served.name}.engine.log'}", flush=True)
    rows, copy_s = {}, []
    try:
        for fmt in a.format:
            for mb in a.bucket_mb:
                syncer = WeightSyncer([EngineClient(url)], WeightSyncConfig(update_weight_buffer_size=mb << 20,
                                                                            weight_sync_check_interval=10 ** 6),
                                      hf_config=config, hf_checkpoint=served, has_mtp_layers=True,
                                      spec=SpecSetup("EAGLE", None, str(served)), transport="tensor")
                syncer.prepare()  # then the transport of this row's format (prepare builds the default, flattened)
                syncer.transport = SnapshotTierTransport(syncer.clients, session=syncer.protocol.session,
                                                         flatten=fmt == "flattened")
                syncer.sync_report(iter_hf_tensors(model.named_parameters(), config), "warm-up")  # + baseline read
                for i in range(a.repeats):  # interleaved, so every row sees the same machine load
                    for mode in a.sync:
                        syncer.overlap_buckets = syncer.close_with_last_update = mode == "pipelined"
                        copy_s.append(copy.round())
                        time.sleep(a.between_syncs_s)
                        report = syncer.sync_report(iter_hf_tensors(model.named_parameters(), config),
                                                    f"{fmt}-{mb}-{mode}-{i}")
                        t = syncer.transport
                        rows.setdefault((fmt, mb, mode), []).append(
                            (report, t.flatten_s, t.serialize_s, t.snapshot_copied_bytes, t.snapshot_mirrored_bytes))
                syncer.close()
        served_norm = requests.post(url + "/get_weights_by_name", timeout=60,
                                    json={"name": "model.norm.weight", "truncate_size": 1 << 30}).json()
        expected = [t for t in iter_hf_tensors(model.named_parameters(), config) if t.name == "model.norm.weight"][0]
        if not torch.allclose(torch.tensor(served_norm), expected.tensor.float().cpu()):
            raise RuntimeError("the engine does not serve the synced model.norm.weight: the sync did not land")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print_table(a, config, rows, copy_s, copy.nbytes)
    return 0


def print_table(a, config: dict, rows: dict, copy_s: list[float], nbytes: int) -> None:
    copy_med = sorted(copy_s)[len(copy_s) // 2]
    copy_gbps = nbytes / copy_med / 1e9
    device = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"model: mimo hidden {config['hidden_size']}, {config['num_hidden_layers']} layers + 1 MTP, vocab "
          f"{config['vocab_size']}, {a.dtype}; trainer and engine on {device}; median of {a.repeats} syncs, each "
          "next to a device copy of the same tensors")
    print("| sync | format | bucket MiB | buckets | GB | seconds | GB/s | / copy | gather+convert | flatten | "
          "serialize | HTTP | engine receive | engine load, less snapshot | engine snapshot | "
          "snapshot GB copied / mirrored | flush | control |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (fmt, mb, mode), reports in rows.items():
        report, flatten_s, serialize_s, copied_bytes, mirrored_bytes = sorted(
            reports, key=lambda r: r[0].transfer_seconds)[len(reports) // 2]
        sp = report.split
        http = max(0.0, sp.http_s - flatten_s - serialize_s)  # SyncSplit's, less the sender's own work
        print(f"| {mode} | {fmt} | {mb} | {report.buckets} | {report.bytes / 1e9:.2f} | "
              f"{report.transfer_seconds:.3f} | {report.gbps:.2f} | {report.gbps / copy_gbps:.3f} | "
              f"{sp.gather_convert_s:.3f} | {flatten_s:.3f} | "
              f"{serialize_s:.3f} | {http:.3f} | {sp.engine_receive_s:.3f} | "
              f"{sp.engine_load_s - sp.engine_snapshot_s:.3f} | {sp.engine_snapshot_s:.3f} | "
              f"{copied_bytes / 1e9:.2f} / {mirrored_bytes / 1e9:.2f} | {sp.flush_s:.3f} | {sp.control_s:.3f} |")
    print(f"| device copy, same tensors | - | - | - | {nbytes / 1e9:.2f} | {copy_med:.4f} | {copy_gbps:.2f} | 1.000 "
          "| | | | | | | | | | |")
    print("copy rounds (s): " + ", ".join(f"{x:.4f}" for x in copy_s))


if __name__ == "__main__":
    raise SystemExit(main())
