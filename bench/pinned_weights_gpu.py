"""The memory release after a weight sync, with the release's host copy shared by the rollback mirror, side by side
with a release that copies the whole weights (what every release did before they shared it), in one run.

The GPU demo's engine (bench/engine_memory_saver_gpu.py's SIZES, NEXTN 3 steps, bfloat16) with SGLang's memory
saver. Each cycle: a weight-update session loads every served tensor (scaled by 0.99, then back: new values each
time), ends (the mirror copies what it wrote into the host copy in the background), a greedy decode runs (the
rollout), then the weights are released and resumed twice, the shared way (only what no copy has caught up with) and
the old way (the whole allocation marked stale first), in alternating order. Then slime's staged resume (the weights,
a full sync, the KV cache and graphs), the weights copied back at their own resume (as before) or only what the sync
did not write, at the last resume (now), alternating. Printed: median seconds and bytes copied per way and their
ratios, the pinned host bytes the engine holds against two copies, and whether every served tensor after each resume
equals what it should (and the greedy output, where the values were kept).

    python bench/pinned_weights_gpu.py                 # on a GPU machine, torch_memory_saver installed
    python bench/pinned_weights_gpu.py --size tiny     # a quick check
    python bench/pinned_weights_gpu.py --size mimo-7b  # MiMo-7B-RL's shapes (bench/weight_sync.py's preset)
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

if not __package__:  # `python bench/<name>.py`: import bench as a package, from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.engine_memory_saver_gpu import SIZES
from bench.memory_saver_allocations_gpu import timed
from bench.weight_sync import PRESETS

SHAPES = {**SIZES, "mimo-7b": {**PRESETS["mimo-7b"], "max_position_embeddings": 512}}

GB = 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=tuple(SHAPES), default="demo")
    p.add_argument("--cycles", type=int, default=5)
    args = p.parse_args()
    from slime_spec.engine.model_executor.memory_saver import hook_preloaded
    if not hook_preloaded():
        import torch_memory_saver
        with torch_memory_saver.configure_subprocess():
            return subprocess.call([sys.executable, *sys.argv])
    from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams
    from slime_spec.engine.weights.receive import EngineTiming
    from slime_spec.speculative.settings import SpecConfig
    from slime_spec.tools.tiny_model import make_tiny_model
    from tests.helpers.engine_runs import run_to_completion
    from tests.helpers.engine_weights import begin, engine_weights, request, served_bytes

    model = make_tiny_model(Path(tempfile.mkdtemp()) / "m", arch="mimo", mtp_layers=1, dtype="bfloat16",
                            **{"max_position_embeddings": 512, **SHAPES[args.size]})
    core = EngineCore(str(model), SpecConfig("EAGLE", 3, 1, 4), dtype="bfloat16", device="cuda",
                      max_running_requests=32, memory_saver=True)
    weights = engine_weights(core, "cuda")
    copy = core.memory.host_copy
    ids = core.tokenizer("release and resume " * 4)["input_ids"]

    def greedy(rid: str) -> list[int]:
        req = Request(rid, ids, SamplingParams(temperature=0.0, max_new_tokens=48, ignore_eos=True))
        return run_to_completion(core, [req])[rid].output_ids

    def new_values(scale: float) -> dict[str, torch.Tensor]:
        """Every served tensor (the target's and the MTP layer's) scaled: what a full sync sends."""
        return {n: t * scale for role in ("target", "draft") for n, t in core.named_weights(role).items()}

    def sync(values: dict[str, torch.Tensor]) -> None:
        assert begin(weights, "all").success
        ok, message = weights._load(list(values.items()), "all", "ok", EngineTiming(), "bench")
        assert ok, message
        assert weights.handle(request("EndWeightUpdateReqInput")).success

    def serves(values: dict[str, torch.Tensor]) -> bool:
        named = {n: t for role in ("target", "draft") for n, t in core.named_weights(role).items()}
        return named.keys() == values.keys() and all(torch.equal(named[n], values[n]) for n in values)

    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, size {args.size}, {args.cycles} cycles, "
          f"weights {copy.block.numel() / GB:.3f} GB", flush=True)
    core.release_memory(["weights"])  # the first release copies everything: the host copy starts empty
    core.resume_memory(["weights"])
    rows = {"shared": dict(release=[], resume=[], copied=[]), "whole": dict(release=[], resume=[], copied=[])}
    equal = []
    for cycle in range(args.cycles):
        sync(new_values(0.99 if cycle % 2 == 0 else 1 / 0.99))
        before, tokens = served_bytes(core), greedy(f"c{cycle}")
        for way in (("shared", "whole") if cycle % 2 == 0 else ("whole", "shared")):
            if way == "whole":
                copy.stale.add(0, copy.block.numel())
            rows[way]["release"].append(timed(lambda: core.release_memory(["weights"])))
            rows[way]["copied"].append(copy.saved_bytes)
            rows[way]["resume"].append(timed(lambda: core.resume_memory(["weights"])))
            after = served_bytes(core)
            equal.append(all(torch.equal(after[k], before[k]) for k in before) and greedy(f"c{cycle}{way}") == tokens)
    # slime's staged resume: the weights, the sync, then the KV cache and graphs; the weights copied back at the
    # first resume (before) or only what the sync did not write, at the last (now)
    staged = {"at once": dict(weights=[], sync=[], rest=[]), "deferred": dict(weights=[], sync=[], rest=[])}
    for cycle in range(args.cycles):
        for way in (("deferred", "at once") if cycle % 2 == 0 else ("at once", "deferred")):
            values = new_values(0.99 if len(equal) % 2 == 0 else 1 / 0.99)
            core.release_memory(None)
            staged[way]["weights"].append(timed(lambda: (core.resume_memory(["weights"]),
                                                         way == "at once" and copy.complete())))
            staged[way]["sync"].append(timed(lambda: sync(values)))
            staged[way]["rest"].append(timed(lambda: core.resume_memory(["kv_cache", "cuda_graph"])))
            equal.append(serves(values) and len(greedy(f"s{cycle}{way}")) == 48)
            values = None  # noqa: F841  (its memory, before the next cycle's)
    mirror = weights.session.mirror
    host = copy.host
    own = {id(b): b for b in mirror.buffers.values()
           if not host.data_ptr() <= b.data_ptr() < host.data_ptr() + host.numel()}
    own_bytes = sum(b.numel() * b.element_size() for b in own.values())
    print("| release | release s | resume s | GB copied at the release |")
    print("|---|---|---|---|")
    for way, label in (("whole", "the whole weights copied (before)"), ("shared", "the shared copy (now)")):
        r = rows[way]
        print(f"| {label} | {statistics.median(r['release']):.4f} | {statistics.median(r['resume']):.4f} | "
              f"{statistics.median(r['copied']) / GB:.3f} |")
    ratio = statistics.median(rows["whole"]["release"]) / statistics.median(rows["shared"]["release"])
    print(f"release, whole / shared: {ratio:.2f}x")
    print(f"pinned host memory: {(host.numel() + own_bytes) / GB:.3f} GB (the release's copy {host.numel() / GB:.3f}, "
          f"the mirror's own buffers {own_bytes / GB:.3f}; its {mirror.host_bytes_held / GB:.3f} GB of rollback "
          f"values are views into the copy); two copies: {(host.numel() + mirror.host_bytes_held) / GB:.3f} GB")
    print("| staged resume | weights s | sync s | KV cache and graphs s | total s |")
    print("|---|---|---|---|---|")
    totals = {}
    for way, label in (("at once", "weights copied back at their resume (before)"),
                       ("deferred", "only what the sync did not write, at the last resume (now)")):
        r = {k: statistics.median(v) for k, v in staged[way].items()}
        totals[way] = statistics.median([sum(t) for t in zip(*staged[way].values())])
        print(f"| {label} | {r['weights']:.4f} | {r['sync']:.4f} | {r['rest']:.4f} | {totals[way]:.4f} |")
    print(f"staged resume and sync, before / now: {totals['at once'] / totals['deferred']:.2f}x")
    print(f"served tensors equal after every resume, greedy output too where the values were kept: {all(equal)}")
    return 0 if all(equal) else 1


if __name__ == "__main__":
    raise SystemExit(main())
