"""SGLang's memory saver in the embedded engine: GPU memory released and resumed at the same addresses.

With `--enable-memory-saver` (CUDA, the `torch_memory_saver` package installed) the engine's weights, KV caches and
CUDA graphs live in torch_memory_saver's tagged regions, through SGLang's own `TorchMemorySaverAdapter`, as they do in
SGLang's model runner. A release (`/release_memory_occupation`) unmaps a tag's physical memory and keeps its virtual
addresses; a resume maps new memory there, so every captured graph still points at live storage and nothing is
captured again. SGLang's launcher preloads torch_memory_saver's allocator hook into the scheduler process
(`configure_subprocess`) when the flag is set.

Weights are restored from the saver's CPU backup on resume (the embedded engine always keeps one: its weights then
serve as they did before the release, as without the saver). KV caches and graph memory come back uninitialised:
the engine is idle across a release, and a graph rewrites its buffers on every replay.

Without the saver (the default, and always on CPU) the engine moves its weights to a CPU backup and drops its KV
caches and graphs; resume allocates them again and captures the graphs again (managers/memory_occupation.py).

This process holds one saver, as it holds one torch_memory_saver: `enable()` once, before the engine allocates.
"""

from __future__ import annotations

import importlib.util
import os
from contextlib import contextmanager, nullcontext
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


def copy_keeping_views(modules: Iterable[torch.nn.Module], device: torch.device) -> int:
    """Copy every parameter, buffer and tensor attribute of `modules` (and their submodules) into fresh storage on
    `device`, one copy per storage: tensors that shared a storage (a fused projection and the parameters that are
    its views, tied embeddings) share the new one, at the same offsets. Parameters stay the same objects. Returns
    the bytes copied. Run inside `region("weights")` this moves the served weights into the saver's memory."""
    copies: dict[int, torch.UntypedStorage] = {}  # old storage's address -> its copy
    fresh: set[int] = set()  # the copies' addresses: a tensor met twice (shared by two modules) is moved once
    copied = 0

    def relocate(t: torch.Tensor) -> torch.Tensor:
        nonlocal copied
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        key = storage.data_ptr()
        if key in fresh:
            return t
        new = copies.get(key)
        if new is None:
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            new = copies[key] = whole.to(device, copy=True).untyped_storage()
            fresh.add(new.data_ptr())
            copied += storage.nbytes()
        return torch.empty(0, dtype=t.dtype, device=device).set_(new, t.storage_offset(), t.shape, t.stride())

    seen: set[int] = set()
    with torch.no_grad():
        for root in modules:
            for module in root.modules():
                if id(module) in seen:
                    continue
                seen.add(id(module))
                for param in module._parameters.values():
                    if param is not None and id(param) not in seen:
                        seen.add(id(param))
                        param.data = relocate(param.data)
                for name, buf in module._buffers.items():
                    if buf is not None:
                        module._buffers[name] = relocate(buf)
                for name, value in list(vars(module).items()):
                    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                        setattr(module, name, relocate(value))
                    elif isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value):
                        setattr(module, name, tuple(relocate(v) if isinstance(v, torch.Tensor) else v
                                                    for v in value))
    return copied


@contextmanager
def weights_region():
    """The weights' region, with the CPU backup the embedded engine keeps (see the module docstring)."""
    with region(GPU_MEMORY_TYPE_WEIGHTS, enable_cpu_backup=True):
        yield


def kv_cache_region():
    return region(GPU_MEMORY_TYPE_KV_CACHE)
