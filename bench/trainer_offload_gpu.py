"""The colocated trainer's offload and onload (trainer/offload.py), side by side in one run: the offload as it is
(Python's garbage collector runs only when a moved tensor's device memory stayed allocated) vs the same offload with a
full `gc.collect()` before the device cache is emptied, as every offload did before; interleaved round by round so
both see the same machine. Also: a single device-to-host copy of the same number of bytes, the floor.

The trainer is the GPU demo's (`python -m slime_spec.demo --device cuda`): MiMo-shaped, hidden 1024, 34 layers + one
MTP layer, --bf16 with float32 master weights, AdamW state after one GRPO step, KL reference weights; the same bytes
a colocated demo step moves.

    python bench/trainer_offload_gpu.py            # on a GPU machine (bench/gpu_env.sh first)
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch


def build_trainer(directory: Path, layers: int, hidden: int):
    from slime_spec.config.run_config import TrainConfig
    from slime_spec.rollout.sample import Sample
    from slime_spec.tools.tiny_model import make_tiny_model
    from slime_spec.trainer import parallel
    from slime_spec.trainer.trainer import Trainer

    parallel.init_single_process(seed=0)
    path = make_tiny_model(directory, arch="mimo", mtp_layers=1, num_layers=layers, hidden_size=hidden,
                           intermediate_size=4 * hidden, num_heads=16, num_kv_heads=4, seed=1)
    trainer = Trainer(TrainConfig(hf_checkpoint=str(path), mtp_num_layers=1, bf16=True, use_kl_loss=True, lr=1e-5,
                                  global_batch_size=2, micro_batch_size=1, n_samples_per_prompt=2))
    rng = random.Random(0)
    samples = []
    for g in range(2):
        prompt = [rng.randrange(5, 100) for _ in range(16)]
        for j in range(2):
            response = [rng.randrange(5, 100) for _ in range(32)]
            samples.append(Sample(index=len(samples), group_index=g, prompt="p", tokens=prompt + response,
                                  response_length=len(response), reward=float(j)))
    trainer.train_step(samples, 0)  # AdamW's state exists from here on
    return trainer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=34)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device: the offload moves GPU tensors only")
    from slime_spec.trainer.offload import TrainerOffload

    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(Path(tmp) / "model", a.layers, a.hidden)
    offload = TrainerOffload(trainer)
    offload.offload()  # the first offload pins its host memory (seconds); later ones reuse torch's cached blocks
    offload.onload()
    rows: dict[str, list[tuple[float, float]]] = {"as shipped": [], "with a full gc.collect()": []}
    gib = 0.0
    for _ in range(a.rounds):
        for label in rows:
            start = time.perf_counter()
            out = offload.offload()
            if label != "as shipped":
                gc.collect()
                torch.cuda.empty_cache()
            seconds = time.perf_counter() - start
            rows[label].append((seconds, offload.onload()["trainer_onload_s"]))
            gib = out["trainer_offload_gib"]
    nbytes = int(gib * 2**30)
    device, host = torch.empty(nbytes, dtype=torch.uint8, device="cuda"), torch.empty(nbytes, dtype=torch.uint8,
                                                                                      pin_memory=True)
    copies = []
    for _ in range(a.rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        host.copy_(device, non_blocking=True)
        torch.cuda.synchronize()
        copies.append(time.perf_counter() - start)
    copy_s = statistics.median(copies)
    base = statistics.median(o for o, _ in rows["with a full gc.collect()"])
    print(f"trainer: MiMo hidden {a.hidden}, {a.layers} layers + 1 MTP, bf16 with float32 masters, AdamW, KL "
          f"reference; {gib:.2f} GiB moved per offload; {torch.cuda.get_device_name()}; median of {a.rounds} "
          "interleaved rounds")
    print("| offload | offload s | onload s | offload GB/s | / one device-to-host copy | offload speed-up |")
    print("|---|---|---|---|---|---|")
    for label, r in rows.items():
        off, on = statistics.median(o for o, _ in r), statistics.median(b for _, b in r)
        print(f"| {label} | {off:.3f} | {on:.3f} | {nbytes / off / 1e9:.1f} | {copy_s / off:.2f} | {base / off:.2f}x |")
    print(f"| one device-to-host copy, same bytes | {copy_s:.3f} | | {nbytes / copy_s / 1e9:.1f} | 1.00 | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
