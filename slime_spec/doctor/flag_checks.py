"""Ranges of single flags and relations between flags, as data, checked by one pure function.

Each row is found before anything starts; without it the mistake surfaces later (a refused request,
an engine that does not start, a trainer that asserts after the engines are up). `check(values)`
reads plain values: flag dests (`rollout_top_p`), forwarded SGLang flags as `sglang_<dest>`, and
the derived values `derived_values` adds (actor GPUs, data-parallel size, backend, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from slime_spec.config import online_draft_layout
from slime_spec.config.parallel_sizes import data_parallel_size
from slime_spec.config.run_config import expert_tensor_parallel_size, resolve_global_batch_size
from slime_spec.doctor.codes import Finding, Rule


@dataclass(frozen=True)
class Bound:
    """One flag's valid values. `name` is the key in `values`; an unset (None) value is not checked."""

    name: str
    ok: Callable[[float], bool]
    must: str
    fix: str
    trainer_only: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class Relation:
    """Flags that must agree. `holds(values)` is False when they do not; templates read `values`."""

    holds: Callable[[dict], bool]
    problem: str
    fix: str
    trainer_only: bool = False


def _at_least(n: int) -> Callable[[float], bool]:
    return lambda v: v >= n


def _probability(v: float) -> bool:
    return 0 < v <= 1


def _top_k(v: int) -> bool:
    return v == -1 or v >= 1


BOUNDS: tuple[Bound, ...] = (
    Bound("rollout_temperature", _at_least(0), "must be >= 0 (0 is greedy)", "--rollout-temperature 1.0"),
    Bound("eval_temperature", _at_least(0), "must be >= 0 (0 is greedy)", "--eval-temperature 0"),
    Bound("rollout_top_p", _probability, "must be in (0, 1]", "--rollout-top-p 1.0 (no nucleus cut)"),
    Bound("eval_top_p", _probability, "must be in (0, 1]", "--eval-top-p 1.0"),
    Bound("rollout_top_k", _top_k, "must be -1 (off) or >= 1", "--rollout-top-k -1"),
    Bound("eval_top_k", _top_k, "must be -1 (off) or >= 1", "--eval-top-k -1"),
    Bound("n_samples_per_prompt", _at_least(1), "must be >= 1", "--n-samples-per-prompt 8 (a GRPO group)"),
    Bound("n_samples_per_eval_prompt", _at_least(1), "must be >= 1", "--n-samples-per-eval-prompt 1"),
    Bound("rollout_batch_size", _at_least(1), "must be >= 1 (prompts per rollout)", "--rollout-batch-size 32"),
    Bound("num_steps_per_rollout", _at_least(1), "must be >= 1 (optimizer steps per rollout)",
          "--num-steps-per-rollout 1", True),
    Bound("rollout_max_response_len", _at_least(1), "must be >= 1 token", "--rollout-max-response-len 1024"),
    Bound("eval_max_response_len", _at_least(1), "must be >= 1 token", "--eval-max-response-len 1024"),
    Bound("rollout_max_prompt_len", _at_least(1), "must be >= 1 token", "drop it, or a positive length"),
    Bound("num_rollout", _at_least(1), "must be >= 1", "--num-rollout 1"),
    Bound("rollout_num_engines", _at_least(1), "must be >= 1", "--rollout-num-engines 1"),
    Bound("rollout_num_gpus_per_engine", _at_least(1), "must be >= 1", "--rollout-num-gpus-per-engine 1"),
    Bound("rollout_num_gpus", _at_least(0), "must be >= 0", "--rollout-num-gpus <GPUs for the engines>"),
    Bound("actor_num_nodes", _at_least(1), "must be >= 1", "--actor-num-nodes 1"),
    Bound("actor_num_gpus_per_node", _at_least(1), "must be >= 1", "--actor-num-gpus-per-node 1"),
    Bound("sglang_server_concurrency", _at_least(1), "must be >= 1 (requests in flight per engine)",
          "--sglang-server-concurrency 64"),
    Bound("rollout_request_retries", _at_least(0), "must be >= 0", "--rollout-request-retries 3"),
    Bound("rm_timeout", lambda v: v > 0, "must be > 0 seconds", "--rm-timeout 300"),
    Bound("max_consecutive_skipped_steps", _at_least(0), "must be >= 0 (0: never stop)",
          "--max-consecutive-skipped-steps 3", True),
    Bound("engine_start_timeout", lambda v: v > 0, "must be > 0 seconds", "--engine-start-timeout 1800"),
    Bound("placement_timeout", _at_least(0), "must be >= 0 seconds (0 waits without bound)", "--placement-timeout 300"),
    Bound("update_weight_buffer_size", _at_least(1), "must be >= 1 byte", "--update-weight-buffer-size 536870912"),
    Bound("tensor_model_parallel_size", _at_least(1), "must be >= 1", "--tensor-model-parallel-size 1", True),
    Bound("pipeline_model_parallel_size", _at_least(1), "must be >= 1", "--pipeline-model-parallel-size 1", True),
    Bound("context_parallel_size", _at_least(1), "must be >= 1", "--context-parallel-size 1", True),
    Bound("decoder_first_pipeline_num_layers", lambda v: v is None or v >= 1,
          "must be >= 1 (or unset: the layers split evenly)", "drop --decoder-first-pipeline-num-layers", True),
    Bound("decoder_last_pipeline_num_layers", lambda v: v is None or v >= 1,
          "must be >= 1 (or unset: the layers split evenly)", "drop --decoder-last-pipeline-num-layers", True),
    Bound("expert_model_parallel_size", _at_least(1), "must be >= 1", "--expert-model-parallel-size 1", True),
    Bound("expert_tensor_parallel_size", lambda v: v is None or v >= 1, "must be >= 1 (or unset: the TP size)",
          "--expert-tensor-parallel-size 1", True),
    Bound("global_batch_size", _at_least(1), "must be >= 1", "drop it (one step per rollout) or a positive size",
          True),
    Bound("micro_batch_size", _at_least(1), "must be >= 1", "--micro-batch-size 1", True),
    Bound("mtp_unroll_steps", _at_least(1), "must be >= 1 (1: each MTP layer trained one step ahead)",
          "--mtp-unroll-steps N, N = --sglang-speculative-num-steps", True),
    Bound("lr", _at_least(0), "must be >= 0", "--lr 1e-6", True),
    Bound("weight_decay", _at_least(0), "must be >= 0", "--weight-decay 0.0", True),
    Bound("clip_grad", _at_least(0), "must be >= 0 (0: no clipping)", "--clip-grad 1.0", True),
    Bound("eps_clip", _at_least(0), "must be >= 0", "--eps-clip 0.2", True),
    Bound("eps_clip_high", _at_least(0), "must be >= 0", "--eps-clip-high 0.28", True),
    Bound("eps_clip_c", lambda v: v > 1, "must be > 1 (dual-clip PPO bounds a negative advantage's loss at "
          "eps_clip_c x |advantage|)", "--eps-clip-c 3.0, or drop it", True),
    Bound("kl_loss_coef", _at_least(0), "must be >= 0", "--kl-loss-coef 0.0", True),
    Bound("tis_clip", _at_least(0), "must be >= 0 (the largest importance weight)", "--tis-clip 2.0", True),
    Bound("tis_clip_low", _at_least(0), "must be >= 0 (the smallest importance weight)", "--tis-clip-low 0.0", True),
    Bound("adam_beta1", lambda v: 0 <= v < 1, "must be in [0, 1)", "--adam-beta1 0.9", True),
    Bound("adam_beta2", lambda v: 0 <= v < 1, "must be in [0, 1)", "--adam-beta2 0.999", True),
    Bound("sglang_mem_fraction_static", lambda v: 0 < v < 1,
          "must be in (0, 1): the fraction of GPU memory SGLang takes for weights and KV cache",
          "--sglang-mem-fraction-static 0.7"),
)

RELATIONS: tuple[Relation, ...] = (
    Relation(lambda v: v["dp_size"] > 0,
             "{actor_gpus} actor GPU(s) (--actor-num-nodes {actor_num_nodes} x --actor-num-gpus-per-node "
             "{actor_num_gpus_per_node}) are not divisible by --tensor-model-parallel-size "
             "{tensor_model_parallel_size} x --pipeline-model-parallel-size {pp_size} x --context-parallel-size "
             "{cp_size}",
             "tensor x pipeline x context parallel sizes dividing {actor_gpus}, or more actor GPUs", trainer_only=True),
    # slime asserts the same (megatron_utils/arguments.py)
    Relation(lambda v: v["pp_size"] > 1 or (v.get("decoder_first_pipeline_num_layers") is None
                                            and v.get("decoder_last_pipeline_num_layers") is None),
             "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers without pipeline stages "
             "(--pipeline-model-parallel-size 1): there is no first or last stage to size",
             "drop them, or set --pipeline-model-parallel-size", trainer_only=True),
    *(Relation(lambda v, refused=refused: not (v.get("enable_draft_training") and refused(v["pp_size"], v["cp_size"])),
               problem, fix, trainer_only=True) for refused, (problem, fix) in online_draft_layout.REFUSED_LAYOUTS),
    # Megatron's expert grid: expert TP x EP ranks hold one copy of the experts (which layouts are built:
    # spec_checks.check_trainer_support)
    Relation(lambda v: v["ep_size"] == 1 or v["stage_gpus"] % (v["etp_size"] * v["ep_size"]) == 0,
             "{actor_gpus} actor GPU(s) are not divisible by expert tensor parallel size {etp_size} x "
             "--expert-model-parallel-size {ep_size} x --pipeline-model-parallel-size {pp_size}: each pipeline "
             "stage's experts are split over {ep_size} x {etp_size} of its {stage_gpus} ranks (megatron-core's "
             "initialize_model_parallel refuses this layout too)",
             "--expert-model-parallel-size dividing {stage_gpus} / {etp_size}, or more actor GPUs",
             trainer_only=True),
    Relation(lambda v: v["dp_size"] == 0 or v["global_batch"] % v["micro_dp"] == 0,
             "global batch {global_batch} is not a multiple of --micro-batch-size {micro_batch_size} x "
             "data-parallel size {dp_size} (actor GPUs / (tensor x pipeline x context parallel sizes))",
             "--global-batch-size a multiple of {micro_dp} (or --micro-batch-size dividing "
             "{global_batch} / {dp_size})", trainer_only=True),
    Relation(lambda v: not v.get("use_tis") or v["tis_clip_low"] <= v["tis_clip"],
             "--tis-clip-low {tis_clip_low} is above --tis-clip {tis_clip}: every importance weight would be clipped "
             "to an empty range", "--tis-clip-low <= --tis-clip (slime's defaults: 0.0 and 2.0)", trainer_only=True),
    Relation(lambda v: not v.get("num_steps_per_rollout") or not v["global_batch_size"]
             or v["global_batch_size"] == v["rollout_batch_size"] * v["n_samples_per_prompt"]
             // v["num_steps_per_rollout"],
             "--global-batch-size {global_batch_size} disagrees with --num-steps-per-rollout {num_steps_per_rollout}: "
             "{rollout_batch_size} prompts x {n_samples_per_prompt} samples over that many steps is a global batch "
             "of rollout_batch_size x n_samples_per_prompt // num_steps_per_rollout (slime asserts the same)",
             "drop one of the two flags", trainer_only=True),
    Relation(lambda v: v["global_batch"] >= 1
             and v["rollout_batch_size"] * v["n_samples_per_prompt"] % v["global_batch"] == 0,
             "a rollout's {rollout_batch_size} x {n_samples_per_prompt} samples do not split into optimizer steps of "
             "{global_batch} (--global-batch-size, or the rollout over --num-steps-per-rollout): the trainer takes "
             "every sample of a rollout in whole steps", "a global batch dividing the rollout's samples",
             trainer_only=True),
    Relation(lambda v: not (v.get("use_rollout_logprobs") and v.get("use_tis")),
             "--use-rollout-logprobs with --use-tis: the importance ratios already use the rollout's log-probs, so "
             "every TIS weight would be 1 (slime refuses the pair too)", "drop --use-tis or --use-rollout-logprobs",
             trainer_only=True),
    Relation(lambda v: v.get("over_sampling_batch_size") is None
             or v["over_sampling_batch_size"] >= v["rollout_batch_size"],
             "--over-sampling-batch-size {over_sampling_batch_size} is below --rollout-batch-size "
             "{rollout_batch_size}: dynamic sampling submits that many prompts at a time to fill the batch",
             "--over-sampling-batch-size >= {rollout_batch_size} (slime's default: --rollout-batch-size)"),
    Relation(lambda v: not (v.get("rollout_history_drafting") and (v.get("over_sampling_batch_size") is not None
                                                                   or v.get("dynamic_sampling_filter_path"))),
             "--rollout-history-drafting with dynamic sampling (--over-sampling-batch-size / "
             "--dynamic-sampling-filter-path): history drafting registers a rollout's groups before it starts, and "
             "dynamic sampling decides them while it runs", "drop --rollout-history-drafting or dynamic sampling"),
    Relation(lambda v: v["backend"] != "embedded" or v["rollout_num_gpus_per_engine"] == 1,
             "--rollout-num-gpus-per-engine {rollout_num_gpus_per_engine} with backend embedded: the embedded "
             "engine runs one process on one device (no tensor parallelism)",
             "--rollout-num-gpus-per-engine 1, or --rollout-backend sglang on a GPU node"),
    Relation(lambda v: not v["rollout_num_gpus"] or v["rollout_num_gpus"] % v["rollout_num_gpus_per_engine"] == 0,
             "--rollout-num-gpus {rollout_num_gpus} is not a multiple of --rollout-num-gpus-per-engine "
             "{rollout_num_gpus_per_engine}: the remainder would sit idle",
             "--rollout-num-gpus a multiple of {rollout_num_gpus_per_engine}"),
)


def derived_values(values: dict) -> dict:
    """`values` plus what the relations read: the global batch (as the trainer resolves it), actor GPUs,
    data-parallel size, micro batch x DP."""
    global_batch = resolve_global_batch_size(values["global_batch_size"], values["rollout_batch_size"],
                                             values["n_samples_per_prompt"], values.get("num_steps_per_rollout"))
    actor_gpus = values["actor_num_nodes"] * values["actor_num_gpus_per_node"]
    tp, pp = values["tensor_model_parallel_size"], values.get("pipeline_model_parallel_size") or 1
    cp = values.get("context_parallel_size") or 1
    dp = data_parallel_size(actor_gpus, tp, pp, cp)
    return {**values, "global_batch": global_batch, "actor_gpus": actor_gpus, "dp_size": dp, "pp_size": pp,
            "cp_size": cp,
            "stage_gpus": actor_gpus // pp if pp >= 1 else 0,
            "micro_dp": values["micro_batch_size"] * dp, "ep_size": values.get("expert_model_parallel_size") or 1,
            "etp_size": expert_tensor_parallel_size(max(tp, 1), values.get("expert_tensor_parallel_size"))}


def check(values: dict) -> list[Finding]:
    """Every bound, then (when the bounds hold) every relation; `values` as `derived_values` returns them."""
    trainer = not values.get("debug_rollout_only", False)
    out = [Rule.FLAG_OUT_OF_RANGE.finding(flag=b.flag, value=values[b.name], must=b.must, fix=b.fix)
           for b in BOUNDS
           if values.get(b.name) is not None and (trainer or not b.trainer_only) and not b.ok(values[b.name])]
    if out:
        return out
    return [Rule.FLAG_CONFLICT.finding(problem=r.problem.format(**values), fix=r.fix.format(**values))
            for r in RELATIONS if (trainer or not r.trainer_only) and not r.holds(values)]
