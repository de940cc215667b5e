"""Round trip of the control requests a weight sync makes, an engine on the GPU next to one on the CPU, same run.

A sync sends five control requests besides its buckets (pause, begin, end, weight version, continue) and a flush.
At MiMo-7B's shape on an H200 they took about 7 ms each (`bench/weight_sync.py`'s "control", 0.035 s a sync). This
measures an engine on the GPU and one on the CPU side by side, request by request, interleaved (`--rounds`), with the
HTTP floor (`GET /model_info`) beside them (a tiny model on one H200: 2.2-4.6 ms a request on either, results in
docs/en/benchmarks/weight-sync-h200-2026-11.md), and with `--profile DIR` records the GPU engine's processes with
py-spy (where it is on PATH) during the same sequence, one file per run.

    python bench/engine_control.py                      # cpu, and cuda where a GPU is seen
    python bench/engine_control.py --profile /tmp/spy   # plus py-spy of the cuda engine
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

if not __package__:  # `python bench/<name>.py`: import bench as a package, from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.weight_sync import small_cache_flags, start_engine
from slime_spec.fleet.client import EngineClient
from slime_spec.tools.tiny_model import make_tiny_model
from slime_spec.weight_sync import protocol

ENGINE_FLAGS = small_cache_flags(256, 2)


def sync_sequence(selector: str) -> list[tuple[str, str, dict | None]]:
    """(label, path, payload) in the order `WeightSyncer` sends them; payload None: a GET."""
    return [("model_info (GET floor)", "/model_info", None),
            ("pause_generation", "/pause_generation", protocol.pause_payload("retract")),
            ("begin_weight_update", "/begin_weight_update", protocol.begin_payload(selector)),
            ("end_weight_update", "/end_weight_update", protocol.end_payload()),
            ("flush_cache", "/flush_cache", {}),
            ("update_weight_version", "/update_weight_version", protocol.weight_version_payload("bench")),
            ("continue_generation", "/continue_generation", protocol.continue_payload())]


def one_round(client: EngineClient, sequence, seconds: dict[str, list[float]]) -> None:
    for label, path, payload in sequence:
        t0 = time.perf_counter()
        client.get(path) if payload is None else client.post(path, payload)
        seconds[label].append(time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", nargs="+", default=None, help="engine devices (default: cpu, and cuda if seen)")
    p.add_argument("--rounds", type=int, default=30, help="sync sequences per engine, interleaved")
    p.add_argument("--profile", type=Path, default=None, help="py-spy the cuda engine into this directory")
    a = p.parse_args(argv)
    devices = a.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    work = Path(tempfile.mkdtemp(prefix="bench_engine_control_"))
    model = make_tiny_model(work / "model", seed=0, arch="mimo", vocab_size=256, hidden_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, intermediate_size=128, max_position_embeddings=256,
                            dtype="bfloat16", mtp_layers=1)
    plan = protocol.plan_selectors(protocol.SpecSetup("EAGLE", None, str(model)), has_mtp_layers=True,
                                   transport="distributed", session=True)
    sequence = sync_sequence(protocol.session_selector(plan))
    engines = {d: start_engine(model, d, None, work / f"engine_{d}.log", ENGINE_FLAGS) for d in devices}
    seconds = {d: {label: [] for label, _, _ in sequence} for d in devices}
    try:
        clients = {d: EngineClient(url) for d, (_, url) in engines.items()}
        for d in devices:  # warm-up
            one_round(clients[d], sequence, {label: [] for label, _, _ in sequence})
        for _ in range(a.rounds):
            for d in devices:
                one_round(clients[d], sequence, seconds[d])
        if a.profile and "cuda" in engines:
            profile(engines["cuda"][0].pid, clients["cuda"], sequence, a.profile)
    finally:
        for proc, _ in engines.values():
            proc.terminate()
            proc.wait(timeout=60)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    print(f"control requests, median of {a.rounds} interleaved rounds, ms; {gpu}, torch {torch.__version__}")
    ratio = "cuda" in devices and "cpu" in devices
    print("| request | " + " | ".join(devices) + (" | cuda / cpu |" if ratio else " |"))
    print("|---" * (len(devices) + 1 + ratio) + "|")
    for label, _, _ in sequence:
        med = {d: statistics.median(seconds[d][label]) * 1e3 for d in devices}
        cells = " | ".join(f"{med[d]:.2f}" for d in devices)
        print(f"| {label} | {cells}" + (f" | {med['cuda'] / med['cpu']:.2f} |" if ratio else " |"))
    total = {d: sum(statistics.median(s) for s in seconds[d].values()) * 1e3 for d in devices}
    print("| the sequence | " + " | ".join(f"{total[d]:.2f}" for d in devices)
          + (f" | {total['cuda'] / total['cpu']:.2f} |" if ratio else " |"))
    return 0


def profile(pid: int, client: EngineClient, sequence, out: Path, seconds: float = 8.0) -> None:
    """py-spy (on-CPU samples only) of the engine's processes while the sequence repeats for `seconds`."""
    if shutil.which("py-spy") is None:
        print("--profile: py-spy is not on PATH; no profile taken")
        return
    out.mkdir(parents=True, exist_ok=True)
    spy = subprocess.Popen(["py-spy", "record", "--subprocesses", "--threads", "--format", "raw", "-r", "200",
                            "-d", str(int(seconds) + 2), "-o", str(out / "engine_control_cuda.txt"),
                            "--pid", str(pid)])
    time.sleep(1.0)
    rounds, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        one_round(client, sequence, {label: [] for label, _, _ in sequence})
        rounds += 1
    spy.wait()
    print(f"--profile: {rounds} sequences in {seconds:g} s recorded in {out / 'engine_control_cuda.txt'}")


if __name__ == "__main__":
    raise SystemExit(main())
