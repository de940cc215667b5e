"""An embedded engine's memory release and resume, without and with SGLang's memory saver, side by side in one run.

For each mode: graph capture at start, seconds to release and to resume (median of --cycles) and then for one more
cycle a tag at a time (kv_cache, weights, cuda_graph; resumed in reverse), the GPU memory the release hands back
(the driver's free memory, which is what a colocated trainer can take), whether the resume captured graphs again, and
whether greedy output after each resume equals the output before the first release.
Then the ratio plain / saver of the resume time. The engine is the GPU demo's: a 0.5B-parameter MiMo-shaped target
(34 layers of hidden 1024, one MTP layer), NEXTN 3 steps, bfloat16, 32 running requests.

    python bench/engine_memory_saver_gpu.py                 # on a GPU machine, torch_memory_saver installed
    python bench/engine_memory_saver_gpu.py --size tiny     # 4 layers of hidden 256: a quick check

torch_memory_saver hooks the CUDA allocator through LD_PRELOAD (SGLang's launcher sets it for its scheduler
process); this script re-runs itself with it set (torch_memory_saver.configure_subprocess) when it is not.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

GIB = 2 ** 30
SIZES = {
    "demo": dict(hidden_size=1024, num_layers=34, num_heads=16, num_kv_heads=4, intermediate_size=4096),
    "tiny": dict(hidden_size=256, num_layers=4),
}


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def run_mode(model: Path, saver: bool, cycles: int) -> dict:
    from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams
    from slime_spec.engine.model_executor.memory_saver import MEMORY_TAGS
    from slime_spec.speculative.settings import SpecConfig
    from tests.helpers.engine_runs import run_to_completion

    t0 = time.perf_counter()
    core = EngineCore(str(model), SpecConfig("EAGLE", 3, 1, 4), dtype="bfloat16", device="cuda",
                      max_running_requests=32, memory_saver=saver)
    start_s = time.perf_counter() - t0
    ids = core.tokenizer("release and resume " * 4)["input_ids"]

    def greedy(rid: str) -> list[int]:
        req = Request(rid, ids, SamplingParams(temperature=0.0, max_new_tokens=48, ignore_eos=True))
        return run_to_completion(core, [req])[rid].output_ids

    before = greedy("before")
    release_s, resume_s, freed, equal = [], [], [], []
    capture_at_start = core.graph_capture_seconds
    graphs = dict(core.model.graphs)
    for i in range(cycles):
        serving = free_bytes()
        t0 = time.perf_counter()
        core.release_memory(None)
        torch.cuda.synchronize()
        release_s.append(time.perf_counter() - t0)
        freed.append(free_bytes() - serving)
        t0 = time.perf_counter()
        core.resume_memory(None)
        torch.cuda.synchronize()
        resume_s.append(time.perf_counter() - t0)
        equal.append(greedy(f"after{i}") == before)
    # one more cycle a tag at a time, in SGLang's release order and its reverse for the resume: which tag costs what
    per_tag = {}
    for tag in MEMORY_TAGS:
        t0 = time.perf_counter()
        core.release_memory([tag])
        torch.cuda.synchronize()
        per_tag[f"release {tag}"] = time.perf_counter() - t0
    for tag in reversed(MEMORY_TAGS):
        t0 = time.perf_counter()
        core.resume_memory([tag])
        torch.cuda.synchronize()
        per_tag[f"resume {tag}"] = time.perf_counter() - t0
    equal.append(greedy("after tag by tag") == before)
    row = dict(mode="memory saver" if saver else "plain", start_s=start_s, capture_s=capture_at_start,
               recaptured=any(core.model.graphs.get(name) is not g for name, g in graphs.items()),
               release_s=statistics.median(release_s), resume_s=statistics.median(resume_s),
               freed_gib=statistics.median(freed) / GIB, greedy_equal=all(equal), per_tag=per_tag)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=tuple(SIZES), default="demo")
    p.add_argument("--cycles", type=int, default=3)
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from slime_spec.engine.model_executor.memory_saver import hook_preloaded
    if not hook_preloaded():
        import torch_memory_saver
        with torch_memory_saver.configure_subprocess():
            return subprocess.call([sys.executable, *sys.argv])
    from slime_spec.tools.tiny_model import make_tiny_model

    model = make_tiny_model(Path(tempfile.mkdtemp()) / "m", arch="mimo", mtp_layers=1, max_position_embeddings=512,
                            **SIZES[args.size])
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, size {args.size}, {args.cycles} cycles",
          flush=True)
    rows = []
    for saver in (False, True):  # plain first: the saver stays on in this process once enabled
        rows.append(run_mode(model, saver=saver, cycles=args.cycles))
        gc.collect()  # the engine of the mode just measured
        torch.cuda.empty_cache()
    print("| mode | engine start s | graph capture s | release s | resume s | freed GiB | graphs captured again "
          "| greedy equal after resume |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['start_s']:.2f} | {r['capture_s']:.2f} | {r['release_s']:.3f} | "
              f"{r['resume_s']:.3f} | {r['freed_gib']:.2f} | {'yes' if r['recaptured'] else 'no'} | "
              f"{r['greedy_equal']} |")
    print(f"resume, plain / memory saver: {rows[0]['resume_s'] / rows[1]['resume_s']:.1f}x")
    for r in rows:
        print(f"{r['mode']}, a tag at a time, s: " + ", ".join(f"{k} {v:.3f}" for k, v in r["per_tag"].items()))
    return 0 if all(r["greedy_equal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
