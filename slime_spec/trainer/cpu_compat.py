"""Let megatron-core 0.16.1 run on a machine without CUDA.

megatron-core is CUDA-first: it asks for `torch.cuda.current_device()` to place tensors and keeps
per-parallel-region RNG states through the CUDA generator. On a CPU-only machine both fail (or, worse,
`_lazy_call` queues the RNG restore forever and it silently never happens). `apply()` redirects exactly
those calls to the CPU. It does nothing when CUDA is available, and is idempotent.

Apply it before building a model or calling `model_parallel_cuda_manual_seed`.
"""

from __future__ import annotations

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
    _applied = True
    return True
