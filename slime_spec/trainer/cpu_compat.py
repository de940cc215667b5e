"""Let megatron-core 0.16.1 run on a machine without CUDA.

megatron-core is CUDA-first: it asks for `torch.cuda.current_device()` to place tensors and keeps
per-parallel-region RNG states through the CUDA generator. On a CPU-only machine both fail (or, worse,
`_lazy_call` queues the RNG restore forever and it silently never happens). Its pipeline schedules also
synchronise the CUDA device after each point-to-point exchange, count tokens in a tensor made with
`device="cuda"`, and copy the embedding shared by the first and last stages to the GPU before summing it
over them; under context parallelism its RoPE tables pick a rank's chunks through an index made in pinned
memory and copied to the GPU. `apply()` redirects exactly those calls to the CPU. It does nothing when CUDA is
available, and is idempotent.

Apply it before building a model or calling `model_parallel_cuda_manual_seed`.
"""

from __future__ import annotations

import types

import torch

_applied = False


def needed() -> bool:
    return not torch.cuda.is_available()


def apply() -> bool:
    """Redirect the CUDA-only calls megatron-core makes to the CPU; returns whether anything was patched."""
    global _applied
    if _applied or not needed():
        return False
    from megatron.core.tensor_parallel import random as mp_random

    # Tensors megatron places "on the current device" go to the CPU.
    torch.cuda.current_device = lambda: "cpu"
    # The RNG tracker seeds, saves and restores "the CUDA generator": use the CPU generator instead.
    torch.cuda.manual_seed = torch.manual_seed
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    # megatron's own state helpers read torch.cuda.random and restore through a lazy CUDA callback.
    mp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    _pipeline_on_cpu()
    _rope_chunks_on_cpu()
    _applied = True
    return True


class _TorchOnCpu(types.ModuleType):
    """`torch` as megatron-core's schedules module sees it: `torch.zeros(..., device="cuda")` (its token counter)
    made on the CPU; every other name is torch's own."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _pipeline_on_cpu() -> None:
    from megatron.core.models.common.language_module import language_module
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _TorchOnCpu("torch")
    # p2p_communication calls it after each batch of point-to-point ops (a guard for NCCL streams; gloo's waits
    # are synchronous): nothing to wait for on the CPU
    torch.cuda.synchronize = lambda device=None: None
    setup = language_module.LanguageModule.setup_embeddings_and_output_layer
    if getattr(setup, "_on_cpu", False):
        return

    def setup_on_cpu(self, *args, **kwargs):
        # `weight.data = weight.data.cuda()` before the first / last stage sum their embedding copies
        cuda, torch.Tensor.cuda = torch.Tensor.cuda, lambda tensor, *a, **k: tensor
        try:
            return setup(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda

    setup_on_cpu._on_cpu = True
    language_module.LanguageModule.setup_embeddings_and_output_layer = setup_on_cpu


def _rope_chunks_on_cpu() -> None:
    """megatron-core's `get_pos_emb_on_this_cp_rank` (rope_utils; imported by name into the RoPE modules): the same
    two chunks of the table, chunks cp_rank and 2 x CP - 1 - cp_rank, picked on the CPU."""
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    from slime_spec.trainer.context_parallel import row_positions

    def on_cpu(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
        held = row_positions(pos_emb.shape[seq_dim], cp_group.size(), cp_group.rank(), pos_emb.device)
        return pos_emb.index_select(seq_dim, held)

    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = on_cpu
