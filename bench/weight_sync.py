"""Weight-sync throughput: a full sync vs a raw torch.distributed broadcast of the same bytes, same run.

Full sync = gather (Megatron parameters) + convert (Megatron -> HF names/layouts, MTP included) + bucket +
transfer (`/update_weights_from_distributed` + broadcast) + load into a real embedded engine server
(`python -m slime_spec.engine`, a separate process) + flush, timed by `WeightSyncer` (`weight_sync_s`,
without the verification read-back). The raw baseline broadcasts the very tensors the sync sent, one by
one, from this process to a bare receiver process: the wire cost alone.

The sync's split (SyncSplit) is printed beside it: trainer-side gather+convert, HTTP control, send
(update requests, as the trainer waits on them) and inside it what the engine reports of itself
(`slime_spec_engine_timing`): receive (wire, and waiting for the sender) and load (validation, holding the
rollback values, copies), inside the load the rollback snapshot alone (a copy only where the engine's host mirror
does not hold the value already), the rest being HTTP and queueing; then flush, and the coverage check (run every
--weight-sync-check-interval syncs). `--format per-tensor flattened` adds rows with one broadcast per bucket
(`load_format: "flattened_bucket"`) beside one per tensor; `--sync pipelined serial` adds rows of the sync before
2026-12-01 (no bucket gathered while another is on the wire, separate /flush_cache and /update_weight_version).

    .venv/bin/python bench/weight_sync.py                                   # CPU, gloo
    python bench/weight_sync.py --backend nccl --device cuda --engine-gpu 1 # two GPUs: trainer 0, engine 1
    python bench/weight_sync.py --preset mimo-7b --num-layers 4 --dtype bfloat16 \
        --backend nccl --device cuda --engine-gpu 1 --bucket-mb 512 1024    # MiMo-7B-RL shapes, cut by layers
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
import torch

from slime_spec.common.net import free_port
from slime_spec.config.run_config import TrainConfig, WeightSyncConfig
from slime_spec.fleet.client import EngineClient
from slime_spec.tools.tiny_model import make_tiny_model
from slime_spec.weight_sync.gather import iter_hf_tensors
from slime_spec.weight_sync.protocol import SpecSetup
from slime_spec.weight_sync.sync import WeightSyncer


def small_cache_flags(context_length: int, max_running_requests: int) -> tuple[str, ...]:
    """The engine's KV cache is sized by slots x context length: a small cache, where a bench moves weights only."""
    return "--context-length", str(context_length), "--max-running-requests", str(max_running_requests)


ENGINE_FLAGS = small_cache_flags(512, 4)


def start_engine(model_path: Path, device: str, gpu: str | None, log: Path,
                 extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`python -m slime_spec.engine` on `model_path` (EAGLE with the MTP layer), `extra` flags appended."""
    port = free_port()
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    argv = [sys.executable, "-m", "slime_spec.engine", "--model-path", str(model_path), "--host", "127.0.0.1",
            "--port", str(port), "--device", device, "--speculative-algorithm", "EAGLE",
            "--speculative-num-steps", "1", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2",
            *extra]
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode}; see {log}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"engine did not answer /health in 300 s; see {log}")


@contextlib.contextmanager
def visible_gpus(gpus: str | None):
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def receiver(port: int, specs: list[tuple[list[int], str]], backend: str, device: str, rounds: int) -> None:
    """The raw baseline's other end: join the group and receive each tensor, `rounds` times."""
    from slime_spec.common.dist_group import WeightUpdateGroup
    group = WeightUpdateGroup("127.0.0.1", port, rank=1, world_size=2, group_name="raw", backend=backend)
    buffers = [torch.empty(shape, dtype=getattr(torch, dtype), device=device) for shape, dtype in specs]
    for _ in range(rounds):
        for b in buffers:
            group.broadcast(b, src=0)
        group.barrier()


class RawBroadcast:
    """Rank 0 of a two-process group whose other end only receives: the wire cost of the same tensors."""

    def __init__(self, tensors: list[torch.Tensor], backend: str, device: str, recv_gpu: str | None, rounds: int):
        import torch.multiprocessing as mp

        from slime_spec.common.dist_group import WeightUpdateGroup
        port = free_port()
        specs = [(list(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors]
        recv_device = "cuda:0" if backend == "nccl" else "cpu"
        self.proc = mp.get_context("spawn").Process(target=receiver,
                                                     args=(port, specs, backend, recv_device, rounds))
        with visible_gpus(recv_gpu):  # read by the spawned receiver at start
            self.proc.start()
        self.group = WeightUpdateGroup("127.0.0.1", port, rank=0, world_size=2, group_name="raw", backend=backend)
        self.tensors = [t.to(device) for t in tensors]
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.device = device

    def round(self) -> float:
        t0 = time.perf_counter()
        for t in self.tensors:
            self.group.broadcast(t, src=0)
        self.group.barrier()
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.proc.join(timeout=60)


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The model-shape flags both weight-sync benches take: a preset, overridden field by field."""
    p.add_argument("--preset", choices=sorted(PRESETS), default="small",
                   help="model shape; mimo-7b is MiMo-7B-RL's (hidden 4096, vocab 151680, 36 layers + 1 MTP)")
    p.add_argument("--hidden-size", type=int, default=None, help="overrides the preset")
    p.add_argument("--num-layers", type=int, default=None, help="overrides the preset (cut a large model by layers)")
    p.add_argument("--vocab", type=int, default=None, help="overrides the preset")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the checkpoints' (and so the engine's) dtype")
    p.add_argument("--bf16", action="store_true",
                   help="the trainer's --bf16 (the GPU demo's default): bfloat16 parameters, so the sync sends "
                        "bfloat16; without it the trainer holds float32 and the engine converts as it loads")
    p.add_argument("--bucket-mb", type=int, nargs="+", default=[128],
                   help="--update-weight-buffer-size in MiB; several values: one row each, to size it by measurement")
    p.add_argument("--check-interval", type=int, default=1, help="--weight-sync-check-interval of the syncer")
    p.add_argument("--between-syncs-s", type=float, default=1.0,
                   help="idle seconds before each sync, as rollouts would take in a run: the engine copies what the "
                        "last sync wrote to its host mirror (its rollback values) in the background meanwhile")
    p.add_argument("--format", nargs="+", default=["per-tensor"], choices=["per-tensor", "flattened"],
                   help="per-tensor: one broadcast per tensor (into the engine's parameters); flattened: one per "
                        "bucket (load_format flattened_bucket, one copy on each side); several: one row each")
    p.add_argument("--sync", nargs="+", default=["pipelined"], choices=["pipelined", "serial"],
                   help="pipelined: the product's sync (the next bucket gathered while one is on the wire, the last "
                        "update labelling and flushing); serial: each bucket gathered after the last one's reply, "
                        "then /flush_cache and /update_weight_version (the sync before 2026-12-01); several: one row "
                        "each, interleaved")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--device", default="cpu", help="trainer device: cpu, or cuda with --backend nccl")
    p.add_argument("--engine-gpu", default=None, help="CUDA_VISIBLE_DEVICES of the engine (nccl: another GPU)")
    a = p.parse_args(argv)
    if a.backend == "nccl" and not a.device.startswith("cuda"):
        p.error("--backend nccl needs --device cuda (and --engine-gpu for a second GPU)")
    # as the trainer actors run (trainer/group.py), before this process's first NCCL communicator; the engine
    # and the raw receiver inherit it
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")

    from slime_spec.trainer import model as M
    from slime_spec.trainer import parallel
    work = Path(tempfile.mkdtemp(prefix="bench_weight_sync_"))
    preset = PRESETS[a.preset]
    hidden = a.hidden_size or preset["hidden_size"]
    shape = dict(preset, arch="mimo", mtp_layers=1, dtype=a.dtype, hidden_size=hidden,
                 vocab_size=a.vocab or preset["vocab_size"], num_layers=a.num_layers or preset["num_layers"],
                 intermediate_size=preset["intermediate_size"] or 4 * hidden)
    served = make_tiny_model(work / "served", seed=0, **shape)
    trained = make_tiny_model(work / "trained", seed=1, **shape)
    parallel.init_single_process(seed=0)
    hf_config = M.read_hf_config(trained)
    model = M.build_gpt_model(hf_config, TrainConfig(hf_checkpoint=str(trained), mtp_num_layers=1, bf16=a.bf16))
    M.load_hf_weights(model, M.read_hf_state(trained), hf_config, tp_rank=0, tp_size=1)
    sent = [t.tensor.clone() for t in iter_hf_tensors(model.named_parameters(), hf_config)]
    raw = RawBroadcast(sent, a.backend, a.device, a.engine_gpu,
                       rounds=a.repeats * len(a.bucket_mb) * len(a.format) * len(a.sync) + 1)
    raw.round()  # warm-up
    engine_device = "cuda" if a.backend == "nccl" else "cpu"
    try:
        proc, url = start_engine(served, engine_device, a.engine_gpu, work / "engine.log", ENGINE_FLAGS)
    except BaseException:
        raw.proc.kill()  # it waits for rounds that will not come
        raise
    rows, raw_s = {(fmt, mb, mode): [] for fmt in a.format for mb in a.bucket_mb for mode in a.sync}, []
    try:
        for fmt, mb in dict.fromkeys((fmt, mb) for fmt, mb, _ in rows):
            config = WeightSyncConfig(update_weight_buffer_size=mb << 20, weight_sync_check_interval=a.check_interval)
            syncer = WeightSyncer([EngineClient(url)], config, hf_config=hf_config, hf_checkpoint=served,
                                  spec=SpecSetup("EAGLE", None, str(served)), has_mtp_layers=True,
                                  transport="distributed", backend=a.backend)
            syncer.prepare()
            syncer.transport.flatten = fmt == "flattened"  # the group forms at the first sync
            for i in range(a.repeats):  # interleaved, so every row sees the same machine load
                for mode in a.sync:
                    syncer.overlap_buckets = syncer.close_with_last_update = mode == "pipelined"
                    raw_s.append(raw.round())
                    time.sleep(a.between_syncs_s)
                    rows[(fmt, mb, mode)].append(syncer.sync_report(
                        iter_hf_tensors(model.named_parameters(), hf_config), weight_version=f"{fmt}-{mb}-{mode}-{i}"))
            syncer.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        raw.close()
    raw_med = sorted(raw_s)[len(raw_s) // 2]
    raw_gbps = raw.nbytes / raw_med / 1e9
    print(f"model: mimo hidden {hidden}, {shape['num_layers']} layers + 1 MTP, vocab {shape['vocab_size']}, "
          f"{a.dtype}, trainer {'bfloat16' if a.bf16 else 'float32'}; backend {a.backend}, trainer {a.device}; "
          f"median of {a.repeats} rounds, each next to a raw one")
    print("| path | bucket MiB | buckets | MB | seconds | GB/s | / raw | gather+convert | control | send | "
          "engine receive | engine load | engine snapshot | HTTP rest | flush | check |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (fmt, mb, mode), reports in rows.items():
        med = sorted(reports, key=lambda r: r.transfer_seconds)[len(reports) // 2]
        sp = med.split
        print(f"| full sync, {mode}, {fmt} | {mb} | {med.buckets} | {med.bytes / 1e6:.1f} | "
              f"{med.transfer_seconds:.3f} | {med.gbps:.3f} | {med.gbps / raw_gbps:.2f} | {sp.gather_convert_s:.3f} | "
              f"{sp.control_s:.3f} | "
              f"{sp.send_s:.3f} | {sp.engine_receive_s:.3f} | {sp.engine_load_s:.3f} | {sp.engine_snapshot_s:.3f} | "
              f"{sp.http_s:.3f} | {sp.flush_s:.3f} | {sp.check_s:.3f} |")
    print(f"| raw {a.backend} broadcast, same tensors | - | - | {raw.nbytes / 1e6:.1f} | {raw_med:.3f} | "
          f"{raw_gbps:.3f} | 1.00 | | | | | | | | | |")
    for (fmt, mb, mode), reports in rows.items():  # the first sync of a syncer also reads the baseline: left out
        checksum = [r.split.check_s for r in reports[1:] if r.checked]
        names = [r.split.check_s for r in reports[1:] if r.covered and not r.checked]
        print(f"check, {mode}, {fmt}, bucket {mb} MiB: checksum read-back {_median_text(checksum)}; names only "
              f"{_median_text(names)}")
    print("raw rounds (s): " + ", ".join(f"{x:.3f}" for x in raw_s))
    return 0


def _median_text(xs: list[float]) -> str:
    return f"median {sorted(xs)[len(xs) // 2]:.3f} s of {len(xs)}" if xs else "none ran"


PRESETS = {
    "small": dict(hidden_size=512, num_layers=8, vocab_size=8192, num_heads=8, num_kv_heads=4,
                  intermediate_size=None, max_position_embeddings=512),
    "mimo-7b": dict(hidden_size=4096, num_layers=36, vocab_size=151680, num_heads=32, num_kv_heads=8,
                    intermediate_size=11008, max_position_embeddings=32768),
}


if __name__ == "__main__":
    raise SystemExit(main())
