"""The trainer's GPU state moved to host memory while colocated engines generate, and back before it trains.

With `--colocate` a train rank and an engine share one GPU. slime frees the trainer's memory with
torch_memory_saver (its allocations paused in place); without it, as here, every tensor the trainer owns on the GPU
is moved: the model's parameters and buffers, their gradients, the float32 master weights of a --bf16 model and their
gradients, the optimizer's state, the KL reference weights and the online draft's model and optimizer. Each tensor
goes back to the device it came from (AdamW's `step` counters live on the CPU and stay there). The parameter
objects stay the same, so the optimizer and every other holder of a reference see the moved data.
"""

from __future__ import annotations

import gc
import time
from typing import Iterator

import torch

from slime_spec.trainer.precision import MasterParams


class TrainerOffload:
    """Moves one trainer's GPU tensors to pinned host memory (`offload`) and back (`onload`)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.offloaded = False
        self._moved: dict[tuple[int, object], tuple[object, torch.device]] = {}  # slot -> (holder, its device)

    def offload(self) -> dict[str, float]:
        """Every GPU tensor of the trainer to host memory; the freed blocks go back to the driver, so the engine
        process on this GPU can take them. Returns the seconds and GiB moved."""
        if self.offloaded:
            return {}
        start = time.perf_counter()
        moved = blocks = 0  # bytes moved; the caching allocator's blocks they held (sizes rounded up to 512 B)
        allocated = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        for holder, key in trainer_slots(self.trainer):
            t = _get(holder, key)
            if t is None or t.device.type != "cuda":
                continue
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)
            self._moved[(id(holder), key)] = (holder, t.device)  # the holder is kept alive: its id stays unique
            moved += t.nbytes
            blocks += -(-t.nbytes // 512) * 512
            _put(holder, key, host)
        t = None  # the last moved tensor's device memory is free from here
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            if torch.cuda.memory_allocated() > allocated - blocks:
                gc.collect()  # a tensor held in a reference cycle; half the offload's time when it runs for nothing
            torch.cuda.empty_cache()
        self.offloaded = True
        return {"trainer_offload_s": time.perf_counter() - start, "trainer_offload_gib": moved / 2**30}

    def onload(self) -> dict[str, float]:
        """Every tensor `offload` moved, back to the device it came from."""
        if not self.offloaded:
            return {}
        start = time.perf_counter()
        for holder, key in trainer_slots(self.trainer):
            entry = self._moved.pop((id(holder), key), None)
            if entry is not None:
                _put(holder, key, _get(holder, key).to(entry[1], non_blocking=True))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if self._moved:
            lost = len(self._moved)
            self._moved.clear()
            raise RuntimeError(f"trainer onload: {lost} offloaded tensors are no longer held by the trainer (its "
                               "parameters or optimizer state were replaced while offloaded); they stay on the host")
        self.offloaded = False
        return {"trainer_onload_s": time.perf_counter() - start}


def _get(holder, key):
    return holder[key] if isinstance(holder, dict) else getattr(holder, key)


def _put(holder, key, value) -> None:
    if isinstance(holder, dict):
        holder[key] = value
    else:
        setattr(holder, key, value)


def _param_slots(params, seen: set[int]) -> Iterator[tuple]:
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            yield p, "data"
            yield p, "grad"


def _module_slots(module: torch.nn.Module, seen: set[int]) -> Iterator[tuple]:
    yield from _param_slots(module.parameters(), seen)
    for sub in module.modules():
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and id(buf) not in seen:
                seen.add(id(buf))
                yield sub, name


def _optimizer_slots(optimizer: torch.optim.Optimizer) -> Iterator[tuple]:
    for state in optimizer.state.values():
        for key in sorted(state):
            if torch.is_tensor(state[key]):
                yield state, key


def trainer_slots(trainer) -> Iterator[tuple]:
    """(holder, key) of every tensor a trainer owns: a parameter's data or grad, a module's buffer (attributes), an
    optimizer state or KL reference entry (dict items); each once, in a fixed order."""
    seen: set[int] = set()
    yield from _module_slots(trainer.model, seen)
    master: MasterParams = trainer.master
    yield from _param_slots(master.params, seen)
    yield from _optimizer_slots(trainer.optimizer)
    if trainer.ref_state is not None:
        for name in sorted(trainer.ref_state):
            yield trainer.ref_state, name
    draft = trainer.online_draft
    if draft is not None:
        yield from _module_slots(draft.draft, seen)
        yield from _optimizer_slots(draft.optimizer)
