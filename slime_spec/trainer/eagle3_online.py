"""Online EAGLE3 draft training: the draft learns from the policy's own rollouts, next to the policy.

The policy's forward exposes its aux hidden states, embeddings and logits, all detached: the draft
loss (eagle3_ttt.py) moves only the draft, which has its own AdamW and learning rate (--draft-lr) and
steps once per policy optimizer step. Data-parallel ranks average the draft's gradients (every rank
holds the whole draft). What the engines receive with selector `draft` is `synced_tensors()`: the
draft's trainable parameters under their checkpoint names; the embedding the draft shares with the
target is not the draft's and the d2t / t2d vocabulary maps never change.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slime_spec.common import eagle3_draft
from slime_spec.config.run_config import TrainConfig
from slime_spec.trainer.eagle3_ttt import TTTResult, ttt_loss

METRICS = ("draft_loss", "draft_acc_step0", "draft_acc_last")


class OnlineDraft:
    def __init__(self, train: TrainConfig, draft_model_path: str | None, num_target_layers: int,
                 device: torch.device):
        if not draft_model_path:
            raise ValueError("--enable-draft-training needs the EAGLE3 draft: set "
                             "--sglang-speculative-draft-model-path DIR (an LlamaForCausalLMEagle3 checkpoint)")
        self.train = train
        self.draft = eagle3_draft.load_draft(draft_model_path, num_target_layers).to(device)
        self.aux_layer_ids = eagle3_draft.aux_layer_ids(self.draft.config, num_target_layers)
        self.optimizer = torch.optim.AdamW(self.draft.parameters(), lr=train.draft_lr or train.lr,
                                           betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps,
                                           weight_decay=0.0)
        self._sums = torch.zeros(len(METRICS) + 1, dtype=torch.float64)

    def accumulate(self, out, position_ids: torch.Tensor, loss_mask: torch.Tensor,
                   attention_mask: torch.Tensor | None, scale: float) -> TTTResult:
        """Backward the draft loss of one micro-batch (policy outputs `out`), scaled by `scale`."""
        self.draft.train()
        result = ttt_loss(self.draft, out.embeds, out.aux_hidden, out.logits.detach(), position_ids, loss_mask,
                          self.train.draft_ttt_steps, attention_mask=attention_mask)
        (result.loss * scale).backward()
        self._sums += torch.tensor([float(result.loss.detach()), result.step_accuracy[0],
                                    result.step_accuracy[-1], 1.0], dtype=torch.float64)
        return result

    def step(self, dp_group=None, dp_size: int = 1) -> None:
        params = [p for p in self.draft.parameters() if p.grad is not None]
        if dp_size > 1:
            for p in params:
                dist.all_reduce(p.grad, group=dp_group)
                p.grad.div_(dp_size)
        if self.train.clip_grad and self.train.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, self.train.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def pop_metrics(self) -> dict[str, float]:
        n = max(float(self._sums[-1]), 1.0)
        metrics = {k: float(self._sums[i]) / n for i, k in enumerate(METRICS)}
        self._sums.zero_()
        return metrics

    def synced_tensors(self) -> dict[str, torch.Tensor]:
        """Checkpoint name -> tensor of every trainable draft parameter (what selector `draft` updates)."""
        return {n: p.detach() for n, p in self.draft.named_parameters()}

    def export(self, directory) -> None:
        """The draft as an SGLang EAGLE3 checkpoint (config.json + model.safetensors) in its config's dtype."""
        from slime_spec.common.dtypes import torch_dtype
        eagle3_draft.save_draft(self.draft, directory, torch_dtype(self.draft.config.get("torch_dtype") or "float32"))

    def state_dict(self) -> dict:
        return {"model": {k: v.detach().cpu() for k, v in self.draft.state_dict().items()},
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.draft.load_state_dict(state["model"])
        if state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
