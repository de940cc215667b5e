"""SGLang's memory saver releasing and resuming the GPU demo engine's weights, four ways side by side in one run:
one allocation per parameter storage or one allocation for all (memory_saver.copy_into_one_allocation), with the
saver's own CPU backup (SGLang's --enable-weights-cpu-backup), with none (SGLang's default: a weight sync must follow
the resume), or with a host copy pinned once and reused.

Each variant holds its own copy of the same weights (the 0.5B-parameter MiMo-shaped demo target, bfloat16, projections
fused as the engine serves them) in its own region of the saver. Each cycle releases and resumes every variant in
turn (the order reversed every other cycle); it prints the median seconds of each, the ratios against the first, and
whether every weight came back bit for bit where a backup promises it.

    python bench/memory_saver_allocations_gpu.py              # on a GPU machine, torch_memory_saver installed
    python bench/memory_saver_allocations_gpu.py --size tiny   # 4 layers of hidden 256: a quick check
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

VARIANTS = (  # name, one allocation, CPU backup
    ("per storage, saver's backup", False, "saver"),
    ("one allocation, saver's backup", True, "saver"),
    ("one allocation, no backup", True, "none"),
    ("one allocation, pinned host copy", True, "pinned"),
)


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.engine_memory_saver_gpu import SIZES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=tuple(SIZES), default="demo")
    p.add_argument("--cycles", type=int, default=5)
    args = p.parse_args()
    from slime_spec.engine.model_executor import memory_saver
    if not memory_saver.hook_preloaded():
        import torch_memory_saver
        with torch_memory_saver.configure_subprocess():
            return subprocess.call([sys.executable, *sys.argv])
    from slime_spec.engine.model_executor.model import load_model
    from slime_spec.tools.tiny_model import make_tiny_model

    path = make_tiny_model(Path(tempfile.mkdtemp()) / "m", arch="mimo", mtp_layers=1, max_position_embeddings=512,
                           **SIZES[args.size])
    device = torch.device("cuda")
    memory_saver.enable(device)
    variants = {}  # name -> (model, weights before, allocations, backup)
    for name, one, backup in VARIANTS:
        model, _ = load_model(path, dtype="bfloat16", device="cuda")
        model.fuse_projections()
        with memory_saver.region(name, enable_cpu_backup=backup == "saver"):
            if one:
                memory_saver.copy_into_one_allocation([model], device)
            else:  # as the loaded model holds them: a storage per parameter, q/k/v and gate/up views of fused ones
                copies = {}
                for param in model.parameters():
                    old = param.untyped_storage()
                    if old.data_ptr() not in copies:
                        copies[old.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=device).set_(old).clone()
                    param.data = torch.empty(0, dtype=param.dtype, device=device).set_(
                        copies[old.data_ptr()].untyped_storage(), param.storage_offset(), param.shape, param.stride())
        storages = {q.untyped_storage().data_ptr(): q.untyped_storage() for q in model.parameters()}
        variants[name] = (model, {n: q.detach().clone() for n, q in model.named_parameters()}, storages, backup)
    torch.cuda.empty_cache()
    gib = sum(q.numel() * q.element_size() for q in variants[VARIANTS[1][0]][0].parameters()) / 2 ** 30
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, size {args.size}, {gib:.2f} GiB of "
          f"weights, {args.cycles} cycles", flush=True)

    def release(name: str) -> None:
        _, _, storages, backup = variants[name]
        if backup == "pinned":  # one host buffer per storage, pinned once, reused by every release
            host = pinned.setdefault(name, [torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=True)
                                            for s in storages.values()])
            for buf, storage in zip(host, storages.values()):
                buf.copy_(torch.empty(0, dtype=torch.uint8, device=device).set_(storage), non_blocking=True)
            torch.cuda.synchronize()
        memory_saver.pause(name)

    def resume(name: str) -> None:
        _, _, storages, backup = variants[name]
        memory_saver.resume(name)
        if backup == "pinned":
            for buf, storage in zip(pinned[name], storages.values()):
                torch.empty(0, dtype=torch.uint8, device=device).set_(storage).copy_(buf, non_blocking=True)

    pinned: dict[str, list[torch.Tensor]] = {}
    seconds = {name: {"release": [], "resume": []} for name in variants}
    for cycle in range(args.cycles):
        order = list(variants) if cycle % 2 == 0 else list(variants)[::-1]
        for name in order:
            seconds[name]["release"].append(timed(lambda: release(name)))
            seconds[name]["resume"].append(timed(lambda: resume(name)))
    print("| weights held as | allocations | CPU backup | release s | resume s | bit for bit after resume |")
    print("|---|---|---|---|---|---|")
    median = {name: {k: statistics.median(v) for k, v in s.items()} for name, s in seconds.items()}
    equal = {}
    for name, (model, before, storages, backup) in variants.items():
        equal[name] = all(torch.equal(q, before[n]) for n, q in model.named_parameters())
        shown = "-" if backup == "none" else str(equal[name])  # nothing promised without a backup
        print(f"| {name} | {len(storages)} | {backup} | {median[name]['release']:.4f} | "
              f"{median[name]['resume']:.4f} | {shown} |")
    base = VARIANTS[0][0]
    for name in list(variants)[1:]:
        print(f"{name}: release {median[base]['release'] / median[name]['release']:.1f}x, resume "
              f"{median[base]['resume'] / median[name]['resume']:.1f}x faster than {base}")
    return 0 if all(equal[name] for name, (*_, backup) in variants.items() if backup != "none") else 1

if __name__ == "__main__":
    raise SystemExit(main())
