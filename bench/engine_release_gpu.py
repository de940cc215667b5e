"""What an embedded engine still holds on the GPU after `release_memory`: the caching allocator's segments (by pool
and stream, allocated or only cached) and the live CUDA tensors (by shape, with what refers to them).

tests/test_gpu_memory.py asserts the release hands (almost) all of it back; this prints where the rest sits when it
does not. Same engine as that test (tiny MiMo, hidden 256, 4 layers, one MTP layer, EAGLE 3 steps, bf16).

    python bench/engine_release_gpu.py            # on a GPU machine (bench/gpu_env.sh first)
"""

from __future__ import annotations

import gc
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

MIB = 2 ** 20


def segments_summary(label: str) -> None:
    """The allocator's segments by (pool, stream): total and allocated MiB, so cached-but-free shows apart."""
    rows: dict[tuple, list[float]] = {}
    for seg in torch.cuda.memory_snapshot():
        key = (str(seg.get("segment_pool_id")), seg.get("stream"), seg.get("segment_type"))
        row = rows.setdefault(key, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += seg["total_size"] / MIB
        row[2] += seg["allocated_size"] / MIB
    print(f"[{label}] allocated {torch.cuda.memory_allocated() / MIB:.1f} MiB, reserved "
          f"{torch.cuda.memory_reserved() / MIB:.1f} MiB; segments by (pool, stream, type):")
    for key, (n, total, alloc) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        print(f"    {key}: {n} segments, {total:.1f} MiB, allocated {alloc:.1f} MiB")


def live_cuda_tensors(top: int = 15) -> None:
    """Live CUDA tensors by (shape, dtype) and bytes, and the types that refer to the largest ones."""
    seen, by_shape, total = set(), Counter(), 0
    examples = {}
    for obj in gc.get_objects():
        try:
            if not (isinstance(obj, torch.Tensor) and obj.is_cuda):
                continue
        except Exception:
            continue
        ptr = obj.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        nbytes = obj.untyped_storage().nbytes()
        key = (tuple(obj.shape), str(obj.dtype))
        by_shape[key] += nbytes
        total += nbytes
        examples.setdefault(key, obj)
    print(f"live CUDA storages: {len(seen)}, {total / MIB:.1f} MiB")
    for key, nbytes in by_shape.most_common(top):
        refs = [type(r).__name__ + (f"{{{','.join(map(str, list(r)[:4]))}}}" if isinstance(r, dict) else "")
                for r in gc.get_referrers(examples[key]) if r is not examples and r is not sys._getframe()]
        print(f"    {key}: {nbytes / MIB:.2f} MiB; referred to by {refs[:4]}")


def main() -> int:
    from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams
    from slime_spec.speculative.settings import SpecConfig
    from slime_spec.tools.tiny_model import make_tiny_model
    from tests.helpers.engine_runs import run_to_completion

    tmp = Path(tempfile.mkdtemp())
    model = make_tiny_model(tmp / "m", arch="mimo", mtp_layers=1, hidden_size=256, num_layers=4,
                            max_position_embeddings=512)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    core = EngineCore(str(model), SpecConfig("EAGLE", 3, 1, 4), dtype="bfloat16", device="cuda",
                      max_running_requests=16)
    ids = core.tokenizer("release release")["input_ids"]
    req = lambda rid: Request(rid, ids, SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True))  # noqa
    before = run_to_completion(core, [req("a")])["a"].output_ids
    held = torch.cuda.memory_reserved() - base
    print(f"held after a request: {held / MIB:.1f} MiB (base {base / MIB:.1f} MiB)")
    segments_summary("serving")
    core.release_memory(None)
    left = torch.cuda.memory_reserved() - base
    print(f"left after release_memory: {left / MIB:.1f} MiB of {held / MIB:.1f} MiB ({left / max(held, 1):.2f})")
    segments_summary("released")
    live_cuda_tensors()
    core.resume_memory(None)
    after = run_to_completion(core, [req("b")])["b"].output_ids
    print(f"greedy output after resume equals before: {after == before}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
