"""One train process: the Megatron policy (+ MTP layers), its optimizer, and the GRPO / SFT steps.

`TrainActor` (actor.py) is a thin Ray wrapper around this; tests drive it in-process.
Megatron's parallel state must be initialised first (`parallel.init_parallel`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from slime_spec.config import online_draft_layout
from slime_spec.config.run_config import TrainConfig
from slime_spec.rollout.sample import Sample, Status
from slime_spec.trainer import checkpoint, grads, initial_weights, losses, mtp_loss, pipeline, step_metrics, step_plan
from slime_spec.trainer import model as M
from slime_spec.trainer.batch import TokenBatch, collate, response_mask
from slime_spec.trainer.context_parallel import ContextSplit, LocalRows
from slime_spec.trainer.eagle3_online import OnlineDraft
from slime_spec.trainer.finite_guard import (
    SkipTracker,
    check_weights_finite,
    grpo_advantages_without,
    reward_left_out,
    step_skip_reason,
)
from slime_spec.trainer.packing import ModelRows, equal_rows, model_rows
from slime_spec.trainer.parallel import TPInfo, current_tp_info
from slime_spec.trainer.precision import MasterParams
from slime_spec.trainer.step_plan import PreparedStep
from slime_spec.trainer.timing import PartTimer
from slime_spec.weight_sync import convert, fp8

logger = logging.getLogger(__name__)
EAGLE3_DRAFT_DIR = "eagle3_draft"  # in each --save iteration: the online draft as an SGLang checkpoint


class Trainer:
    def __init__(self, train: TrainConfig, draft_model_path: str | None = None):
        """draft_model_path: the engines' draft (--sglang-speculative-draft-model-path), trained online with
        --enable-draft-training."""
        if train.loss_type not in ("policy_loss", "sft"):
            raise ValueError(f"--loss-type {train.loss_type!r}: choose policy_loss or sft")
        if train.loss_type == "policy_loss" and train.advantage_estimator != "grpo":
            raise ValueError(f"--advantage-estimator {train.advantage_estimator!r}: only grpo is implemented")
        if train.use_kl_loss:
            losses.approx_kl(torch.zeros(1), torch.zeros(1), train.kl_loss_type)  # validates the type early
        if train.use_dynamic_batch_size and not train.max_tokens_per_gpu:
            raise ValueError("--use-dynamic-batch-size needs --max-tokens-per-gpu N (the token budget of a "
                             "packed micro-batch)")
        if train.max_tokens_per_gpu is not None and train.max_tokens_per_gpu < 1:
            raise ValueError(f"--max-tokens-per-gpu {train.max_tokens_per_gpu}: give a positive token count")
        refusal = online_draft_layout.refusal(train.pipeline_model_parallel_size, train.context_parallel_size,
                                              train.enable_draft_training)
        if refusal:
            raise ValueError(refusal)
        self.train = train
        self.packed = bool(train.max_tokens_per_gpu)
        self.tp: TPInfo = current_tp_info()
        self.cp = ContextSplit.current()  # this rank's part of every row (context_parallel.py)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        self.hf_config = M.read_hf_config(train.hf_checkpoint)
        # the engines serve this checkpoint: an FP8 one gets its weights quantized as it holds them (weight_sync/fp8.py)
        self.fp8 = fp8.Fp8BlockScheme.from_hf_config(self.hf_config)
        self.vocab_size = self.hf_config["vocab_size"]
        # SGLang serves MiMo's MTP layer with the position-0 token embedding zeroed; train it the same way.
        self.mtp_zero_first_token = convert.family_of(self.hf_config) == "mimo"
        self.model = M.build_gpt_model(self.hf_config, train)
        resumed = initial_weights.load_initial(self.model, train, self.hf_config, self.tp)
        self.start_rollout_id = 0 if resumed is None else resumed["rollout_id"] + 1
        # --enable-draft-training: an EAGLE3 draft trained next to the policy; without it none is built,
        # so the engines' draft stays as loaded (frozen) and nothing ever overwrites it.
        self.online_draft = OnlineDraft(train, draft_model_path, self.hf_config["num_hidden_layers"],
                                        self.device) \
            if train.enable_draft_training else None
        if self.online_draft is not None and resumed is not None:
            if resumed.get("draft") is None:
                raise ValueError(f"--load {train.load}: the checkpoint has no draft state, but "
                                 f"--enable-draft-training is on; resume without it or from a draft-training run")
            self.online_draft.load_state_dict(resumed["draft"])
        for name, p in self.model.named_parameters():
            if convert.is_mtp_param(name):
                p.requires_grad_(train.enable_mtp_training)  # a frozen draft gets no gradient and no decay
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.master = MasterParams(trainable)  # float32 copies of a --bf16 model; the model's own params otherwise
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in self.master.params if p.dim() > 1], "weight_decay": train.weight_decay},
             {"params": [p for p in self.master.params if p.dim() <= 1], "weight_decay": 0.0}],  # norms, biases
            lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps)
        if resumed is not None and resumed.get("optimizer") is not None:
            state = dict(resumed["optimizer"])
            self.master.load_state_dict(state.pop("master_params", None))
            self.optimizer.load_state_dict(state)
        self.ref_state = initial_weights.reference_weights(self.model, train, self.hf_config, self.tp,
                                                           resumed is not None) if train.use_kl_loss else None
        self.timer = PartTimer()  # bench/trainer.py enables it for the per-part split
        self.skips = SkipTracker(train.max_consecutive_skipped_steps)

    # ---------------------------------------------------------------- weights
    def named_megatron_params(self, stage_copies: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(Megatron name, this rank's TP shard) for every weight of this pipeline stage, in a fixed order. Each on
        the trainer's device: while the trainer is offloaded (--colocate syncs after the offload, as slime does),
        one tensor at a time is copied back from host memory, never the whole trainer. `stage_copies=False` leaves
        out the last stage's copy of the embedding (the weight sync sends the first stage's)."""
        for name, p in M.named_weights(self.model):
            if stage_copies or not pipeline.is_stage_copy(p):
                yield name, p.detach().to(self.device, non_blocking=True)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full HF-named weights on the CPU: TP shards and EP ranks' experts all-gathered, and under pipeline
        parallelism every stage's sent to global rank 0 (collective: every rank must call it; the other stages'
        ranks return their own stage's). Without a gather the weights are read where they lie (an offloaded
        trainer's from host memory, with no round trip through the GPU)."""
        from slime_spec.weight_sync.gather import iter_hf_tensors
        groups = self.gather_groups()
        gathers = groups["tp_size"] > 1 or groups["ep_size"] > 1 or groups["etp_size"] > 1 or self.tp.pp_size > 1
        named = (self.named_megatron_params(stage_copies=False) if gathers
                 else ((n, p.detach()) for n, p in M.named_weights(self.model)))
        tensors = pipeline.weights_to_first_stage(iter_hf_tensors(named, self.hf_config, **groups), self.device)
        return {t.name: t.tensor.cpu() for t in tensors}

    def gather_groups(self) -> dict:
        """The process groups `gather.iter_hf_tensors` gathers whole tensors over (TP shards, EP ranks' experts)."""
        from megatron.core import parallel_state as ps

        return dict(tp_group=ps.get_tensor_model_parallel_group() if self.tp.tp_size > 1 else None,
                    tp_size=self.tp.tp_size, ep_size=self.tp.ep_size,
                    ep_group=ps.get_expert_model_parallel_group() if self.tp.ep_size > 1 else None,
                    etp_group=ps.get_expert_tensor_parallel_group() if self.tp.etp_size > 1 else None,
                    etp_size=self.tp.etp_size)

    @torch.no_grad()
    def forward_logits(self, input_ids: list[list[int]]) -> dict[str, torch.Tensor]:
        """Policy and MTP logits (CPU, [b, s, vocab]) for equal-length token lists: for checks against engines.
        Under pipeline parallelism every stage returns the last stage's."""
        self.model.eval()
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        seq = ids.shape[1]
        ids = F.pad(ids, (0, -seq % self._row_multiple))  # the padding comes after the tokens (causal)

        def forward(_m_idx, rows_ids):
            inputs = self._local_rows(equal_rows(rows_ids))
            trunk = self._trunk(inputs)
            if trunk.logits is None:  # not the last pipeline stage
                return trunk.hidden, None
            mtp = M.mtp_logits(self.model, inputs.input_ids, trunk, self.vocab_size, self.mtp_zero_first_token)
            whole = [self.cp.gather(x, dim=1)[:, :seq].float().cpu() for x in [trunk.logits, *mtp]]
            return trunk.hidden, {"logits": whole[0], "mtp_logits": whole[1:]}

        results = pipeline.run_forward(self.model, [ids], forward)
        return pipeline.from_last_stage(results[0] if results else None)

    def named_draft_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) of the online EAGLE3 draft's own parameters, for selector `draft`;
        nothing without --enable-draft-training (the engines' draft stays frozen). On the trainer's device, as
        `named_megatron_params`."""
        if self.online_draft is not None:
            for name, t in self.online_draft.synced_tensors().items():
                yield name, t.to(self.device, non_blocking=True)

    def get_tp_info(self) -> dict:
        return dict(self.tp.__dict__)

    def save(self, rollout_id: int, data_position: dict | None = None) -> Path | None:
        """Every rank's shard of iteration `rollout_id`, the data position (rollout/data.py) beside it, then the
        marker: an iteration is loadable only once all of it is written."""
        if not self.train.save:
            raise ValueError("save() needs --save DIR")
        self.check_weights_finite(f"saved as iteration {rollout_id} in --save {self.train.save} (the iterations "
                                  "saved before stay as they are)")
        path = None
        if self.tp.edp_rank == 0:  # one replica of each (TP, EP) shard writes it
            optimizer_state = self.optimizer.state_dict()
            if self.master.mixed:
                optimizer_state["master_params"] = self.master.state_dict()
            path = checkpoint.save_shard(self.train.save, rollout_id, self.tp.tp_rank, self.tp.tp_size,
                                         self.hf_config, dict(self.named_megatron_params()), optimizer_state,
                                         draft_state=None if self.online_draft is None
                                         else self.online_draft.state_dict(), **initial_weights.shard_of(self.tp))
            # servable as is: SGLang's EAGLE3 layout (written once: by global rank 0)
            if self.online_draft is not None and self.tp.tp_rank == 0 and self.tp.ep_rank == 0:
                self.online_draft.export(path.parent / EAGLE3_DRAFT_DIR)
        if self.tp.rank == 0 and data_position is not None:
            checkpoint.write_data_position(self.train.save, rollout_id, data_position)
        dist.barrier()
        if self.tp.rank == 0:
            checkpoint.mark_latest(self.train.save, rollout_id)
        return path

    # ---------------------------------------------------------------- steps
    @property
    def _row_multiple(self) -> int:
        """Model rows' lengths are a multiple of this: 2 chunks per context-parallel rank, each split over the TP
        ranks under sequence parallelism."""
        return self.cp.row_multiple * (self.tp.tp_size if self.model.config.sequence_parallel else 1)

    def _trunk(self, inputs: LocalRows, with_aux: bool = False) -> M.TrunkOutput:
        """The policy's pass over this rank's part of the rows (`ContextSplit.local_rows`). `with_aux`: also the
        online draft's inputs (its aux layers' outputs and the embeddings, detached)."""
        aux_ids = self.online_draft.aux_layer_ids if with_aux and self.online_draft is not None else None
        return M.trunk_forward(self.model, inputs.input_ids, self.vocab_size, position_ids=inputs.position_ids,
                               attention_mask=inputs.attention_mask, aux_layer_ids=aux_ids)

    def _token_log_probs(self, rows: ModelRows, inputs: LocalRows, trunk: M.TrunkOutput,
                         with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[n, S] log-probs of the samples' tokens (and the entropies of the distributions that predict them), from
        this rank's logits, gathered over the context-parallel ranks."""
        lp, entropy = losses.next_token_log_probs(trunk.logits, inputs.next_ids, self.train.rollout_temperature,
                                                  with_entropy)
        if entropy is not None and self.cp.size > 1:  # one collective for the two
            lp, entropy = self.cp.gather(torch.stack((lp, entropy), dim=-1), dim=1).unbind(-1)
        else:
            lp = self.cp.gather(lp, dim=1)
        return tuple(None if x is None else rows.to_samples(losses.to_token_positions(x)) for x in (lp, entropy))

    @torch.no_grad()
    def _log_probs(self, batches: list[TokenBatch]) -> list[torch.Tensor | None]:
        """Each micro-batch's token log-probs under the current weights (None on a stage before the last, where
        they are never read)."""
        self.model.eval()

        def forward(_m_idx, batch):
            rows = model_rows(batch, self.packed, batch.min_row_len)
            inputs = self._local_rows(rows)
            trunk = self._trunk(inputs)
            if trunk.logits is None:
                return trunk.hidden, None
            return trunk.hidden, {"log_probs": self._token_log_probs(rows, inputs, trunk)[0]}

        results = pipeline.run_forward(self.model, batches, forward)
        return [r["log_probs"] for r in results] if self.model.post_process else [None] * len(batches)

    def _local_rows(self, rows: ModelRows) -> LocalRows:
        return self.cp.local_rows(rows.input_ids, rows.position_ids, rows.attention_mask)

    def _mtp_loss(self, rows: ModelRows, inputs: LocalRows, trunk: M.TrunkOutput,
                  loss_mask: torch.Tensor) -> torch.Tensor:
        """[n] MTP loss of a micro-batch; with a graph only for --enable-mtp-training (a frozen draft's
        loss is a metric)."""
        from megatron.core import parallel_state as ps

        with torch.set_grad_enabled(self.train.enable_mtp_training and torch.is_grad_enabled()):
            with self.timer("MTP forward"):
                hidden = M.mtp_hidden_states(self.model, inputs.input_ids, trunk, self.mtp_zero_first_token,
                                              self.train.mtp_unroll_steps)
            if self.model.config.sequence_parallel:  # each rank holds a slice of the sequence: the loss reads all
                from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
                # the loss's hidden-state gradient is already summed over the vocabulary shards: each rank keeps
                # its own slice of it, unsummed
                hidden = [gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=False) for h in hidden]
            # the whole rows from every context-parallel rank, likewise
            hidden = [self.cp.gather(h, dim=0) for h in hidden]
            with self.timer("MTP loss"):
                weight = M.output_weight(self.model)
                group = ps.get_tensor_model_parallel_group() if self.tp.tp_size > 1 else None
                return mtp_loss.mtp_loss_per_sample(hidden, weight, rows, loss_mask, self.vocab_size,
                                                    vocab_start=self.tp.tp_rank * weight.shape[0], group=group)

    @property
    def step_layout(self) -> step_plan.StepLayout:
        t = self.train
        return step_plan.StepLayout(t.global_batch_size, t.micro_batch_size, t.max_tokens_per_gpu, self.tp.dp_rank,
                                    self.tp.dp_size, self.tp.ep_size,
                                    row_multiple=self._row_multiple)

    def plan(self, samples: list[Sample], dp_rank: int | None = None) -> step_plan.Steps:
        """This rank's (or data-parallel rank `dp_rank`'s) sample indices per optimizer step, per micro-batch."""
        return step_plan.plan([len(s.tokens) for s in samples], self.step_layout, dp_rank)

    def sft_step(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        """A supervised step on the samples' response tokens whatever --loss-type is (warm-up)."""
        return self.train_step(samples, rollout_id, loss_type="sft")

    def train_step(self, samples: list[Sample], rollout_id: int, loss_type: str | None = None) -> dict[str, float]:
        """One rollout's worth of training: len(samples) / global_batch_size optimizer steps.

        Metrics (means over samples): loss (the policy or SFT objective), pg_loss, kl, clip_fraction,
        entropy, mtp_loss (reported even for a frozen draft), with --use-tis tis, tis_clipfrac and tis_abs (slime's
        truncated importance sampling, losses.TisWeights), and grad_norm (mean over steps), lr; over the
        steps applied. A step whose loss or gradient norm is not finite, or whose every sample was left out for its
        reward, is skipped (finite_guard.py): skipped_steps, skipped_steps_total, reward_left_out.
        """
        with self.timer("old log-probs"):
            prepared = self._prepare(samples, loss_type)
        grad_norms = []
        skipped = 0
        for s_idx in range(len(prepared.steps)):
            self.optimizer.zero_grad(set_to_none=True)
            step_sums = torch.zeros_like(prepared.sums)
            self._backward_step(prepared, s_idx, sums=step_sums)
            with self.timer("optimizer"):
                grad_norm = grads.clip_by_global_norm(self._reduced_grads(), self.train.clip_grad, self.tp.tp_size,
                                                      self.device)
                reason = self._nonfinite_step(prepared, s_idx, step_sums, grad_norm, rollout_id, samples)
                if reason is None:
                    self.optimizer.step()
                    self.master.copy_to_model()
            if reason is not None:  # as Megatron skips a step: no update from this step's gradients
                self.optimizer.zero_grad(set_to_none=True)
                if self.online_draft is not None:
                    self.online_draft.optimizer.zero_grad(set_to_none=True)
                skipped += 1
                logger.warning("optimizer step skipped: %s", reason)
                self.skips.skipped(reason)  # raises NonFiniteError after too many in a row
                continue
            self.skips.applied()
            prepared.sums += step_sums
            grad_norms.append(grad_norm)
            if self.online_draft is not None:
                from megatron.core import parallel_state as ps

                with self.timer("EAGLE3 draft"):
                    self.online_draft.step(ps.get_data_parallel_group() if self.tp.dp_size > 1 else None,
                                           self.tp.dp_size)
        pipeline.sum_over_stages(prepared.sums, self.device)  # the last stage's, where the loss is computed
        metrics = step_metrics.step_metrics(prepared.sums, grad_norms, self.optimizer.param_groups[0]["lr"],
                                            self.tp.dp_size, self.device, use_tis=self.train.use_tis and not
                                            prepared.sft)
        metrics.update(skipped_steps=skipped, skipped_steps_total=self.skips.total,
                       reward_left_out=sum(prepared.left_out))
        if self.online_draft is not None:
            metrics.update(self.online_draft.pop_metrics())
        return metrics

    def _nonfinite_step(self, p: PreparedStep, s_idx: int, step_sums: torch.Tensor, grad_norm: float,
                        rollout_id: int, samples: list[Sample]) -> str | None:
        """Why optimizer step `s_idx` must be skipped (its loss or gradient norm is not finite), or None.
        Every rank decides the same: the loss flags are summed over data-parallel ranks, the norm is global."""
        from megatron.core import parallel_state as ps

        bad = torch.tensor([float(not torch.isfinite(step_sums[0]))], dtype=torch.float64, device=self.device)
        if self.tp.dp_size > 1:
            dist.all_reduce(bad, group=ps.get_data_parallel_group())
        pipeline.sum_over_stages(bad)  # every stage learns what the last one's loss was
        gbs = self.train.global_batch_size  # step s_idx takes samples [s_idx * gbs, (s_idx + 1) * gbs) on all ranks
        step = slice(s_idx * gbs, (s_idx + 1) * gbs)
        bad_samples = [samples[i].index for i in p.nonfinite_loss_samples.get(s_idx, [])]
        return step_skip_reason(f"rollout {rollout_id}, optimizer step {s_idx}", p.left_out[step], samples[step.start],
                                loss_finite=not bool(bad[0]), nonfinite_loss_samples=bad_samples,
                                grad_norm=grad_norm)

    def check_weights_finite(self, purpose: str) -> None:
        """Raise NonFiniteError naming every non-finite tensor before the weights are `purpose` (synced, saved).
        Collective: every rank checks its shard and all learn what any rank found (finite_guard.py)."""
        check_weights_finite(lambda: itertools.chain(self.named_megatron_params(), self.named_draft_tensors()),
                             purpose)

    def gradients(self, samples: list[Sample], loss_type: str | None = None) -> dict[str, torch.Tensor]:
        """The data-parallel-averaged, unclipped float32 gradient of one optimizer step (exactly
        --global-batch-size samples), without updating: for checks such as packed == padded."""
        if len(samples) != self.train.global_batch_size:
            raise ValueError(f"gradients() takes one optimizer step: {self.train.global_batch_size} samples "
                             f"(--global-batch-size), got {len(samples)}")
        prepared = self._prepare(samples, loss_type)
        self.optimizer.zero_grad(set_to_none=True)
        self._backward_step(prepared, 0, train_draft=False)
        self._reduced_grads()
        names = {id(p): n for n, p in M.named_weights(self.model)}
        out = {names[id(p)]: m.grad.detach().clone() for p, m in zip(self.master.model_params, self.master.params)
               if m.grad is not None}
        self.optimizer.zero_grad(set_to_none=True)
        return out

    def _reduced_grads(self) -> list[torch.Tensor]:
        """The master gradients summed over data-parallel ranks, and the embedding's over its pipeline copies;
        returns the parameters that have one."""
        pipeline.sum_shared_embedding_grads(self.master.params)
        return grads.reduce_grads(self.master.params)

    def _prepare(self, samples: list[Sample], loss_type: str | None) -> PreparedStep:
        """Micro-batches, advantages, and the old-policy (and reference) log-probs before any update."""
        t = self.train
        sft = (loss_type or t.loss_type) == "sft"
        steps = self.plan(samples)
        left_out = [False] * len(samples)
        if not sft:
            reasons = [reward_left_out(s) for s in samples]
            left_out = [r is not None for r in reasons]
            if any(left_out):
                first = next(r for r in reasons if r is not None)
                logger.warning("%d of %d samples left out for their reward; first: %s", sum(left_out),
                               len(samples), first)
            if t.use_tis or t.use_rollout_logprobs:
                step_plan.check_rollout_log_probs([s for s, out in zip(samples, left_out) if not out],
                                                  "--use-tis" if t.use_tis else "--use-rollout-logprobs")
            # a left-out sample trains no token: collated as an aborted one (loss mask all zero)
            samples = [dataclasses.replace(s, status=Status.ABORTED) if out else s
                       for s, out in zip(samples, left_out)]
        lengths = [len(s.tokens) for s in samples]
        seq_len, row_lens = step_plan.row_lengths(lengths, steps, self.step_layout)
        batches = [[dataclasses.replace(collate([samples[i] for i in mb], self.device, seq_len), min_row_len=row)
                    for mb, row in zip(step, rows)] for step, rows in zip(steps, row_lens)]
        advantages = old = ref = None
        trained = [sum(response_mask(s)) for s in samples]  # tokens each sample trains (0: aborted or left out)
        if not sft:
            advantages = grpo_advantages_without([s.reward for s in samples], [s.group_index for s in samples],
                                                 t.n_samples_per_prompt, left_out,
                                                 rewards_normalization=not t.disable_rewards_normalization,
                                                 std_normalization=not t.disable_grpo_std_normalization)
            if t.normalize_advantages:
                advantages = losses.whiten_advantages(advantages, torch.tensor(trained, dtype=torch.float32))
            # --use-rollout-logprobs: the ratios are against the engine's log-probs, as slime's; no forward here
            old = [[b.rollout_log_probs for b in step] if t.use_rollout_logprobs else self._log_probs(step)
                   for step in batches]
            if self.ref_state is not None:
                with initial_weights.swapped_in(self.model, self.ref_state):
                    ref = [self._log_probs(step) for step in batches]
        step_tokens = step_plan.step_tokens(lengths, trained, steps, self.step_layout) \
            if t.calculate_per_token_loss else None
        return PreparedStep(sft, steps, batches, advantages, old, ref, step_metrics.new_sums(), left_out=left_out,
                         step_tokens=step_tokens)

    def _backward_step(self, p: PreparedStep, s_idx: int, train_draft: bool = True,
                       sums: torch.Tensor | None = None) -> None:
        """Forward and backward every micro-batch of optimizer step `s_idx` through megatron-core's schedule
        (pipeline.run_schedule: 1F1B over pipeline stages); gradients accumulate in float32. The loss is the last
        stage's (`_micro_batch_loss`)."""
        self.model.train()
        train_draft = self.online_draft is not None and train_draft
        sums = p.sums if sums is None else sums

        def forward(m_idx, batch):
            rows = model_rows(batch, self.packed, batch.min_row_len)
            inputs = self._local_rows(rows)
            with self.timer("trunk forward"):
                trunk = self._trunk(inputs, with_aux=train_draft)
            if trunk.logits is None:  # a stage before the last: its output goes on to the next stage
                return trunk.hidden, None
            return trunk.hidden, functools.partial(self._micro_batch_loss, p, s_idx, m_idx, rows, inputs, trunk,
                                                   train_draft, sums)

        pipeline.run_schedule(self.model, p.batches[s_idx], forward, forward_only=False, timers=self.timer.megatron())

    def _micro_batch_loss(self, p: PreparedStep, s_idx: int, m_idx: int, rows: ModelRows, inputs: LocalRows,
                          trunk: M.TrunkOutput, train_draft: bool, sums: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The last stage's loss of micro-batch `m_idx`: the scalar the schedule backpropagates through the trunk,
        with its metrics accumulated into `sums`.

        The MTP loss is backpropagated here, on its own: its graph starts from the detached trunk, so the two
        backward passes give the gradients one pass over their sum would, and each is timed apart.
        The online draft's loss (--enable-draft-training) also has its own backward: its inputs are detached,
        so it reaches the draft only."""
        t = self.train
        batch = p.batches[s_idx][m_idx]
        with self.timer("trunk forward"):
            log_probs, entropy = self._token_log_probs(rows, inputs, trunk, with_entropy=True)
            if p.sft:
                terms = losses.sft_loss_terms(log_probs, batch.loss_mask, entropy)
            else:
                adv = p.advantages[p.steps[s_idx][m_idx]].to(self.device)[:, None].expand_as(log_probs)
                terms = losses.policy_loss_terms(
                    log_probs, p.old[s_idx][m_idx], adv, batch.loss_mask, eps_clip=t.eps_clip,
                    eps_clip_high=t.eps_clip_high, eps_clip_c=t.eps_clip_c, entropy=entropy,
                    entropy_coef=t.entropy_coef,
                    ref_log_probs=None if p.ref is None else p.ref[s_idx][m_idx],
                    kl_loss_coef=t.kl_loss_coef, kl_loss_type=t.kl_loss_type,
                    tis=losses.TisWeights(t.tis_clip, t.tis_clip_low) if t.use_tis else None,
                    rollout_log_probs=batch.rollout_log_probs)
        if t.mtp_num_layers and getattr(self.model, "mtp_process", False):
            terms.mtp_loss = self._mtp_loss(rows, inputs, trunk, batch.loss_mask)
            if t.enable_mtp_training:
                with self.timer("MTP backward"):
                    (t.mtp_loss_scaling_factor * terms.mtp_loss.sum() / t.global_batch_size).backward()
        # a sample's mean over its tokens, summed over the step: per sample (slime's default), or weighed by its
        # trained tokens over the step's (--calculate-per-token-loss: a mean over every token)
        weight = batch.loss_mask.sum(-1) / p.step_tokens[s_idx] if p.step_tokens else 1.0 / t.global_batch_size
        loss = (terms.total * weight).sum()
        if train_draft:
            with self.timer("EAGLE3 draft"):
                self.online_draft.accumulate(trunk, rows.position_ids, rows.to_rows(batch.loss_mask),
                                             rows.attention_mask, 1.0 / len(p.batches[s_idx]))
        # the trainer's log-probs against the rollout's: before the update, or (--use-rollout-logprobs, where
        # those are the old ones) this forward's, as slime's train_rollout_logprob_abs_diff
        compared = log_probs.detach() if t.use_rollout_logprobs else None if p.sft else p.old[s_idx][m_idx]
        step_metrics.accumulate(sums, terms, batch, compared, per_token=p.step_tokens is not None)
        nonfinite = (~torch.isfinite(terms.total.detach())).nonzero().flatten().tolist()
        if nonfinite:
            mb = p.steps[s_idx][m_idx]
            p.nonfinite_loss_samples.setdefault(s_idx, []).extend(mb[i] for i in nonfinite)
        return loss, {}
