"""float32 master weights for a bfloat16 model (--bf16), the scheme of Megatron's
Float16OptimizerWithFloat16Params and of its distributed optimizer, on any device.

The model computes in bfloat16; each bfloat16 gradient is added into the float32 `.grad` of its float32 master
copy as soon as a backward pass has produced it (a post-accumulate-grad hook: gradient accumulation in float32
over micro-batches, as Megatron's DDP buffers do, whatever order the pipeline schedule runs them in); the
optimizer updates the masters; `copy_to_model` rounds them back into the model. Without --bf16 the
masters *are* the model's float32 parameters and every step here is a no-op.

Why not Megatron's own class: it accepts CUDA tensors only (`param.type()` checks) and expects its DDP
wrapper's `main_grad` buffers; this trainer runs on CPU too and reduces gradients itself.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel


class MasterParams:
    def __init__(self, params: list[torch.nn.Parameter]):
        self.model_params = list(params)
        self.mixed = any(p.dtype != torch.float32 for p in self.model_params)
        self.params = [self._master_of(p) for p in self.model_params] if self.mixed else self.model_params
        if self.mixed:
            for model_param, master in zip(self.model_params, self.params):
                model_param.register_post_accumulate_grad_hook(self._into_master(master))

    @staticmethod
    def _master_of(param: torch.nn.Parameter) -> torch.nn.Parameter:
        master = torch.nn.Parameter(param.detach().clone().float())
        tensor_parallel.copy_tensor_model_parallel_attributes(master, param)  # the clip counts TP shards once
        # allreduce: False on an EP-split expert (grads.py reduces it over its own group); shared,
        # shared_embedding: a pipeline's embedding and its last-stage copy (pipeline.py)
        for mark in ("allreduce", "shared", "shared_embedding"):
            if hasattr(param, mark):
                setattr(master, mark, getattr(param, mark))
        return master

    @staticmethod
    def _into_master(master: torch.nn.Parameter):
        @torch.no_grad()
        def add(model_param: torch.Tensor) -> None:
            """The model's (bfloat16) gradient added into the master's float32 one, and freed."""
            if master.grad is None:
                master.grad = model_param.grad.float()
            else:
                master.grad.add_(model_param.grad)
            model_param.grad = None
        return add

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """The updated masters, rounded into the model's parameters."""
        if self.mixed:
            for model_param, master in zip(self.model_params, self.params):
                model_param.copy_(master)

    def state_dict(self) -> list[torch.Tensor] | None:
        """The float32 masters for a checkpoint (None without --bf16: the model holds them exactly)."""
        return [m.detach().clone() for m in self.params] if self.mixed else None

    @torch.no_grad()
    def load_state_dict(self, masters: list[torch.Tensor] | None) -> None:
        """Restore saved masters; a checkpoint saved without --bf16 has none: the masters stay the loaded
        weights (as rounded into the bfloat16 model)."""
        if not self.mixed or masters is None:
            return
        if len(masters) != len(self.params):
            raise ValueError(f"--load: the checkpoint holds {len(masters)} float32 master weights, this --bf16 "
                             f"model trains {len(self.params)} parameters; resume with the --mtp-num-layers and "
                             f"--enable-mtp-training it was saved with")
        for master, saved in zip(self.params, masters):
            master.copy_(saved)
