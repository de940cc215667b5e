"""An idle engine's GPU memory released and resumed: SGLang's /release_memory_occupation and
/resume_memory_occupation, by tag ("kv_cache", "weights", "cuda_graph"; none given: all three, as SGLang).

Two ways, as SGLang has them:
- with the memory saver (`--enable-memory-saver`, model_executor/memory_saver.py): each tag's memory is unmapped and
  mapped again at the same addresses, in SGLang's order; captured graphs stay valid; the weights (one allocation)
  come back from a pinned host copy, which a release brings up to date first (only what a load changed since the
  rollback mirror, which shares that copy, last copied it), and which fills what the sync after a resume did not
  write once the engine is resumed whole or the values are read (model_executor/pinned_weights.py);
- without it (the default, and always on CPU): the weights move to a CPU backup, the KV caches and graphs are
  dropped, and resume allocates them again and captures the graphs again once nothing is left released.
"""

from __future__ import annotations

import gc

import torch

from slime_spec.engine.model_executor import memory_saver
from slime_spec.engine.model_executor.memory_saver import MEMORY_TAGS
from slime_spec.engine.model_executor.pinned_weights import PinnedWeightCopy


def check_tags(tags: list[str] | None) -> set[str]:
    tags = set(tags) if tags else set(MEMORY_TAGS)
    unknown = tags - set(MEMORY_TAGS)
    if unknown:
        raise ValueError(f"tags {sorted(unknown)}: known memory tags are {', '.join(map(repr, MEMORY_TAGS))}")
    return tags


class MemoryOccupation:
    """The release state of one EngineCore (`core`): which tags are released, and the plain path's weight backup."""

    def __init__(self, core, saver: bool):
        self.core, self.saver = core, saver
        self.released: set[str] = set()
        self._weight_backup: dict[int, torch.Tensor] = {}
        self.host_copy: PinnedWeightCopy | None = None  # with the saver: of the weights' one allocation
        if saver:
            memory_saver.enable(core.device)
            self._move_into_saver()

    def load(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Write `value` into the served weight `param` (the host copy keeps its account of what changed)."""
        if self.host_copy is not None:
            self.host_copy.load(param, value)
        else:
            param.copy_(value)

    def complete_weights(self) -> None:
        """Before the weights' values are read outside a decode: what a resume has not copied back yet (queued on
        the stream that reads them)."""
        if self.host_copy is not None:
            self.host_copy.complete()

    def _move_into_saver(self) -> None:
        """Weights into the saver's "weights" region as one allocation (views and ties kept), KV caches allocated
        again in its "kv_cache" region; what they occupied before goes back to the driver."""
        core = self.core
        draft = core.drafter.draft if core.drafter is not None else None
        with memory_saver.weights_region():
            weights = memory_saver.copy_into_one_allocation([core.model] + ([draft] if draft is not None else []),
                                                            core.device)
        self.host_copy = PinnedWeightCopy(weights)
        core.cache = None
        if core.drafter is not None:
            core.drafter.drop_cache()
        torch.cuda.empty_cache()
        with memory_saver.kv_cache_region():
            core.cache = core.model.new_cache(core.max_running_requests + 1, core.max_seq)
            if core.drafter is not None:
                core.drafter.new_cache()

    def release(self, tags: set[str]) -> None:
        """`tags` as check_tags returns them; the engine is idle."""
        core = self.core
        if self.saver:  # SGLang's order; addresses kept, graphs stay valid
            if "weights" in tags and "weights" not in self.released:
                self.host_copy.save(session_open=core.session_runners is not None)  # set while a session is open
            torch.cuda.synchronize(core.device)
            for tag in MEMORY_TAGS:
                if tag in tags and tag not in self.released:
                    memory_saver.pause(tag)
                    self.released.add(tag)
            torch.cuda.synchronize(core.device)
            return
        for model in core.causal_lms():
            model.graphs = {}  # they captured the storage being freed; captured again on resume
        if core.drafter is not None:
            core.drafter.drop_graphs()
        if "kv_cache" in tags and "kv_cache" not in self.released:
            core.cache = None
            if core.drafter is not None:
                core.drafter.drop_cache()
            self.released.add("kv_cache")
        if "weights" in tags and "weights" not in self.released:
            for model in core.causal_lms():
                model.unfuse_projections()
            for param in core.unique_params():
                self._weight_backup[id(param)] = param.data.to("cpu", copy=True)
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            self.released.add("weights")
        self._return_freed_memory()

    def _return_freed_memory(self) -> None:
        """Hand what release freed back to the driver: PyTorch's caching allocator keeps freed blocks (and the
        dropped graphs' private pools) reserved for this process, where a colocated trainer cannot use them. The
        cuBLAS workspaces are live allocations of that allocator, one per (handle, stream); no graph is left to use
        them, so they go too (PyTorch's own memory-leak check and inductor's CUDA graphs clear them the same way)."""
        device = self.core.device
        if device.type == "cuda":
            gc.collect()  # graphs and caches dropped above may sit in reference cycles
            torch.cuda.synchronize(device)
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
            torch.cuda.empty_cache()

    def resume(self, tags: set[str]) -> None:
        core = self.core
        if self.saver:
            for tag in reversed(MEMORY_TAGS):  # SGLang's order: graphs, weights, KV caches
                if tag in tags and tag in self.released:
                    memory_saver.resume(tag)
                    self.released.discard(tag)
                    if tag == "weights":
                        self.host_copy.restore()
            if not self.released:  # the engine generates again: every weight on the device
                self.host_copy.complete()
            torch.cuda.synchronize(core.device)
            return
        if "weights" in tags and "weights" in self.released:
            for param in core.unique_params():
                param.data = self._weight_backup.pop(id(param)).to(core.device)
            self.released.discard("weights")
            if core.device.type == "cuda":
                for model in core.causal_lms():
                    model.fuse_projections()
        if "kv_cache" in tags and "kv_cache" in self.released:
            core.cache = core.model.new_cache(core.max_running_requests + 1, core.max_seq)
            if core.drafter is not None:
                core.drafter.new_cache()
            self.released.discard("kv_cache")
        if not self.released:
            core.capture_graphs()
