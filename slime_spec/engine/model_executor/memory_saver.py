"""SGLang's memory saver in the embedded engine: GPU memory released and resumed at the same addresses.

With `--enable-memory-saver` (CUDA, the `torch_memory_saver` package installed) the engine's weights, KV caches and
CUDA graphs live in torch_memory_saver's tagged regions, through SGLang's own `TorchMemorySaverAdapter`, as they do in
SGLang's model runner. A release (`/release_memory_occupation`) unmaps a tag's physical memory and keeps its virtual
addresses; a resume maps new memory there, so every captured graph still points at live storage and nothing is
captured again. SGLang's launcher preloads torch_memory_saver's allocator hook into the scheduler process
(`configure_subprocess`) when the flag is set.

Weights come back on resume as they were: before the release the engine copies them into a pinned host buffer
(allocated at the first release, reused) and after the resume copies them back (managers/memory_occupation.py). The
saver's own CPU backup (SGLang's `--enable-weights-cpu-backup`) does the same, ~27x slower on the GPU demo's 1 GiB
(bench/memory_saver_allocations_gpu.py); SGLang keeps none by default, and a weight sync must follow its resume. KV
caches and graph memory come back uninitialised: the engine is idle across a release, and a graph rewrites its
buffers on every replay.

Without the saver (the default, and always on CPU) the engine moves its weights to a CPU backup and drops its KV
caches and graphs; resume allocates them again and captures the graphs again (managers/memory_occupation.py).

This process holds one saver, as it holds one torch_memory_saver: `enable()` once, before the engine allocates.
"""

from __future__ import annotations

import importlib.util
import os
from contextlib import nullcontext
from typing import Iterable

import torch
from sglang.srt.constants import (
    GPU_MEMORY_ALL_TYPES,
    GPU_MEMORY_TYPE_CUDA_GRAPH,
    GPU_MEMORY_TYPE_KV_CACHE,
    GPU_MEMORY_TYPE_WEIGHTS,
)

MEMORY_TAGS = tuple(GPU_MEMORY_ALL_TYPES)  # SGLang's tags, in its release order: kv_cache, weights, cuda_graph

_adapter = None  # SGLang's TorchMemorySaverAdapter, once enabled


class MemorySaverError(RuntimeError):
    pass


def unavailable_reason(device: str, flag: str = "--enable-memory-saver") -> str | None:
    """Why `flag` (the engine's --enable-memory-saver, as the caller's command line spells it) cannot run on
    `device` here, or None."""
    if not str(device).startswith("cuda"):
        return (f"{flag} needs a CUDA device (--device {device}): on CPU /release_memory_occupation moves the weights "
                "to a CPU backup without it; drop the flag")
    if importlib.util.find_spec("torch_memory_saver") is None:
        return (f"{flag} needs the torch_memory_saver package (SGLang's memory saver): pip install "
                "torch_memory_saver, or drop the flag")
    return None


def hook_preloaded() -> bool:
    """Whether this process started with torch_memory_saver's allocator hook in LD_PRELOAD (its preload mode)."""
    return "torch_memory_saver" in os.environ.get("LD_PRELOAD", "")


def enable(device: torch.device) -> None:
    """Turn the saver on for this process (`--enable-memory-saver`), before the engine allocates anything."""
    global _adapter
    if _adapter is not None:
        return
    reason = unavailable_reason(str(device))
    if reason:
        raise MemorySaverError(reason)
    if not hook_preloaded():
        raise MemorySaverError("--enable-memory-saver: this process did not start with torch_memory_saver's allocator "
                               "hook preloaded (SGLang's launcher preloads it into the scheduler process; elsewhere "
                               "start the process inside torch_memory_saver.configure_subprocess())")
    from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter
    _adapter = TorchMemorySaverAdapter.create(enable=True)


def enabled() -> bool:
    return _adapter is not None


def region(tag: str, enable_cpu_backup: bool = False):
    """Allocations inside go to `tag`'s pausable memory (a no-op context when the saver is off)."""
    return _adapter.region(tag, enable_cpu_backup=enable_cpu_backup) if _adapter is not None else nullcontext()


def graph_capture(graph: torch.cuda.CUDAGraph, pool, stream: torch.cuda.Stream):
    """`torch.cuda.graph(...)`, with the graph's memory in the "cuda_graph" tag when the saver is on."""
    if _adapter is None:
        return torch.cuda.graph(graph, pool=pool, stream=stream)
    return _adapter.cuda_graph(cuda_graph=graph, pool=pool, stream=stream, tag=GPU_MEMORY_TYPE_CUDA_GRAPH)


def pause(tag: str) -> None:
    _adapter.pause(tag)


def resume(tag: str) -> None:
    _adapter.resume(tag)


SLOT_ALIGN = 256  # bytes: every tensor's storage starts as aligned as the CUDA allocator's own blocks


def _visit_tensors(modules: Iterable[torch.nn.Module], move) -> None:
    """Replace every parameter's data, buffer and tensor attribute (bare or in a tuple) of `modules` and their
    submodules by `move(tensor)`; parameters stay the same objects, a module or parameter met twice is moved once."""
    seen: set[int] = set()
    for root in modules:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for param in module._parameters.values():
                if param is not None and id(param) not in seen:
                    seen.add(id(param))
                    param.data = move(param.data)
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = move(buf)
            for name, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                    setattr(module, name, move(value))
                elif isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value):
                    setattr(module, name, tuple(move(v) if isinstance(v, torch.Tensor) else v for v in value))


def copy_into_one_allocation(modules: Iterable[torch.nn.Module], device: torch.device) -> torch.Tensor:
    """Copy every parameter, buffer and tensor attribute of `modules` (and their submodules) into one fresh
    allocation on `device`, each old storage at its own aligned offset: tensors that shared a storage (a fused
    projection and the parameters that are its views, tied embeddings) still share bytes, at the same relative
    offsets. Parameters stay the same objects. Returns the allocation, as uint8 (its tail past the last tensor is
    alignment padding).

    Run inside `region("weights")` this moves the served weights into the saver's memory as one allocation, which
    the engine backs up and restores with one copy each way."""
    slots: dict[int, tuple[torch.UntypedStorage, int]] = {}  # old storage's address -> (storage, byte offset)
    total = 0

    def plan(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in slots:
            slots[storage.data_ptr()] = (storage, total)
            total += -(-storage.nbytes() // SLOT_ALIGN) * SLOT_ALIGN
        return t

    with torch.no_grad():
        _visit_tensors(modules, plan)
        block = torch.empty(total, dtype=torch.uint8, device=device)
        for storage, offset in slots.values():
            whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            block[offset:offset + storage.nbytes()].copy_(whole)
        new_storage = block.untyped_storage()

        def move(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.nbytes() == 0:
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            if storage.data_ptr() == new_storage.data_ptr():  # met before, through another module
                return t
            offset = slots[storage.data_ptr()][1] // t.element_size() + t.storage_offset()
            return torch.empty(0, dtype=t.dtype, device=device).set_(new_storage, offset, t.shape, t.stride())

        _visit_tensors(modules, move)
    return block


def weights_region():
    """The weights' region, without the saver's CPU backup: the engine keeps its own (see the module docstring)."""
    return region(GPU_MEMORY_TYPE_WEIGHTS)


def kv_cache_region():
    return region(GPU_MEMORY_TYPE_KV_CACHE)
