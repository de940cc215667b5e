"""Where a decode step's time goes on one GPU: wall time per step against the device's busy time, for plain decoding
and a speculative chain (NEXTN, the MTP layer drafting), from torch's profiler.

    python bench/step_profile_gpu.py                   # the 0.7B shape of bench/engine_gpu.py, batch 1, k = 5
    python bench/step_profile_gpu.py --batch 8 --steps 3

The target is random (the MTP layer too), so drafts are rarely accepted: the point is each step's structure (k draft
steps, one verify of k + 1 tokens, its read-back and the host's bookkeeping), not its yield. Per engine it prints
wall ms per step, the sum of the kernels' durations per step (device busy), the difference (the device idle: host
work the device waits for), and the kernels that take the most device time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from slime_spec.engine.core import EngineCore, Request, SamplingParams
from slime_spec.engine.cuda_graph import CudaGraphSettings
from slime_spec.spec import SpecConfig
from slime_spec.tiny_model import make_tiny_model

SHAPE = dict(hidden_size=1536, num_layers=24, num_heads=12, num_kv_heads=2, intermediate_size=4096, vocab_size=32000)


def decode(core: EngineCore, batch: int, tokens: int, seed: int) -> int:
    """Decode `batch` random prompts `tokens` tokens each; returns the engine steps taken."""
    g = torch.Generator().manual_seed(seed)
    for i, ids in enumerate(torch.randint(10, SHAPE["vocab_size"], (batch, 32), generator=g).tolist()):
        core.add_request(Request(rid=f"{seed}-{i}", input_ids=ids, params=SamplingParams(
            temperature=0.0, max_new_tokens=tokens, ignore_eos=True)))
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
    return steps


def profile_engine(core: EngineCore, batch: int, tokens: int, top: int) -> list[str]:
    decode(core, batch, tokens, seed=0)  # warm: graphs captured, kernels compiled
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        steps = decode(core, batch, tokens, seed=1)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    busy, count, by_name = 0.0, 0, defaultdict(float)
    for e in prof.events():
        if e.device_type.name == "CUDA":
            busy += e.device_time
            count += 1
            by_name[e.name[:70]] += e.device_time
    ms = lambda us: us / 1e3 / steps  # noqa: E731
    lines = [f"{steps} steps: wall {wall * 1e3 / steps:.3f} ms/step, device busy {ms(busy):.3f} ms/step "
             f"({busy / 1e6 / wall:.0%}), idle {wall * 1e3 / steps - ms(busy):.3f} ms/step, {count / steps:.0f} kernels/step"]
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {ms(us):7.3f} ms/step  {name}")
    ops = [e for e in prof.key_averages() if e.key.startswith(("aten::", "cuda")) and e.count >= steps]
    lines.append("host: the ops launched most often (calls per step, host ms per step)")
    for e in sorted(ops, key=lambda e: -e.count)[:top]:
        lines.append(f"  {e.count / steps:6.1f}  {e.self_cpu_time_total / 1e3 / steps:7.3f} ms  {e.key}")
    return lines


def host_profile(core: EngineCore, batch: int, tokens: int, top: int) -> list[str]:
    """cProfile of the host's Python over a decode: the functions with the most time of their own."""
    prof = cProfile.Profile()
    prof.enable()
    steps = decode(core, batch, tokens, seed=2)
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    lines = [f"cProfile over {steps} steps (tottime / cumtime are per run; divide by steps):"]
    return lines + [line for line in out.getvalue().splitlines() if line.strip()][-top - 1:]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=5, help="the chain's draft steps k")
    p.add_argument("--tokens", type=int, default=96, help="new tokens per request")
    p.add_argument("--top", type=int, default=12, help="kernels and host ops listed per engine")
    p.add_argument("--cprofile", action="store_true", help="also profile the speculative engine's Python")
    a = p.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(Path(tmp) / "mimo", arch="mimo", mtp_layers=1, dtype="bfloat16",
                               max_position_embeddings=1024, **SHAPE)
        graphs = CudaGraphSettings(batch_sizes=(a.batch,))
        for name, spec in (("plain", None), (f"NEXTN k={a.steps}", SpecConfig("EAGLE", a.steps, 1, a.steps + 1))):
            core = EngineCore(str(path), spec, dtype="bfloat16", device="cuda", max_running_requests=a.batch,
                              context_length=32 + a.tokens + a.steps + 8, cuda_graph=graphs)
            print(f"\n{name}, batch {a.batch}:")
            print("\n".join(profile_engine(core, a.batch, a.tokens, a.top)), flush=True)
            if spec is not None and a.cprofile:
                print("\n".join(host_profile(core, a.batch, a.tokens, 3 * a.top)), flush=True)
            del core


if __name__ == "__main__":
    main()
