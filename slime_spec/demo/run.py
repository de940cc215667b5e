"""`make demo`: the whole loop on a CPU machine, on the embedded engine, in about five minutes.

1. A tiny MiMo-style model, deep and narrow (12 layers and one MTP layer, hidden 128: twelve decoder layers per
   draft layer, where MiMo-7B has 36, so the target costs several times its draft), a character-level tokenizer,
   and 3-digit addition worked column by column (65-115-token responses, some parts worded tersely; demo/task.py),
   rewarded for the right answer less a length penalty, so RL moves the policy away from its SFT wording.
2. A short SFT warm-up (policy and MTP layer), exported as an HF checkpoint.
3. GRPO with speculative rollout (NEXTN: the MTP layer drafts) and online MTP training. Every few steps the
   rollout's prompts are timed again on a plain engine and on an engine whose MTP layer stays as SFT left it
   (`--spec-speedup-frozen-draft`), all three with the current target weights: what speculation and what online
   draft training buy, side by side on one policy.
Outputs under outputs/demo/: metrics.jsonl, summary.json, plot.png.

On a machine with CUDA (`--device cuda`, the default there) the target has 0.5B parameters and trains in bfloat16
with float32 master weights; `--layout split` puts the trainer on GPU 0 and the engine on GPU 1 (weights over NCCL),
`--layout colocate` both on one GPU, the engine's memory released while the trainer trains and the trainer's moved
to host memory while the engine generates; `--layout colocate-tp2` is slime's colocated layout on two GPUs: the
trainer at tensor parallel 2 over both, one engine on each, each engine fed by the trainer rank on its GPU;
`--layout colocate-pp2` the same with the trainer's layers in two pipeline stages (megatron-core's 1F1B schedule,
activations over NCCL), each stage broadcasting its weights to the other before each rank feeds its own engine.
metrics.jsonl then also has, per step, the rollout, train, sync, offload and onload seconds and the peak memory of
each GPU, over the step and during its sync.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import shutil
import sys
import time
from pathlib import Path

from slime_spec.demo.task import split_problems, write_jsonl
from slime_spec.rollout.metrics import SPEC_PHASES
from slime_spec.speculative.stats import accept_length

SIZES = {  # name: model, data and loop sizes
    "full": dict(hidden=128, layers=12, ffn=256, sft_steps=200, sft_batch=32, n_train=2000, n_eval=32,
                 grpo_steps=20, prompts=8, samples=8, updates_per_rollout=2, digits=3, max_response_len=128,
                 speedup_interval=7, speedup_repeats=3, terse_share=0.35, rm_type="scratchpad_concise"),
    "smoke": dict(hidden=64, layers=2, ffn=128, sft_steps=20, sft_batch=16, n_train=80, n_eval=8,
                  grpo_steps=2, prompts=4, samples=4, updates_per_rollout=2, digits=2, max_response_len=96,
                  speedup_interval=2, speedup_repeats=2, terse_share=0.35, rm_type="scratchpad_concise"),
    # --device cuda: a 0.5B-parameter target (34 layers of hidden 1024, 16 heads, 4 KV heads; one MTP layer), trained
    # in bfloat16 with float32 master weights, with learning rates a model this deep takes
    "gpu": dict(hidden=1024, layers=34, ffn=4096, heads=16, kv_heads=4, sft_steps=200, sft_batch=64, sft_lr="3e-4",
                n_train=8000, n_eval=64, grpo_steps=8, prompts=16, samples=8, updates_per_rollout=2, digits=3,
                max_response_len=128, speedup_interval=2, speedup_repeats=3, terse_share=0.35,
                rm_type="scratchpad_concise", grpo_lr="1e-5"),
}
# two GPUs shared by trainer and engines: the trainer's flag that splits it over both
SHARED_TWO_GPU_LAYOUTS = {"colocate-tp2": "--tensor-model-parallel-size",
                          "colocate-pp2": "--pipeline-model-parallel-size"}
LAYOUTS = ("split", "colocate", *SHARED_TWO_GPU_LAYOUTS)
TWO_GPU_LAYOUTS = ("split", *SHARED_TWO_GPU_LAYOUTS)
# NEXTN with the MTP layer, 3 steps on every engine: the online and the frozen draft's speed-ups then differ only by
# their drafts. With --spec-auto each engine chose its own k from its own cost history, and the frozen-draft engine,
# which serves only the measurements, settled on a cheaper k than engine 0 (docs/en/benchmarks.md, the demo).
SPEC_FLAGS = ["--sglang-speculative-algorithm", "NEXTN", "--sglang-speculative-num-steps", "3",
              "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", "4"]
# The one MTP layer drafts all 3 steps, fed its own hidden states after the first: train it that way, in SFT and
# online (trained one step ahead only, as Megatron trains MTP layers, its second draft was accepted 0.73 of the time,
# not 0.96).
MTP_FLAGS = ["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "1.0", "--mtp-unroll-steps", "3"]
# At 1e-4 the policy's wording moved little in 20 steps (rollout responses 95 -> 86 tokens) and a frozen draft's accept
# rate fell by 0.03; at 2e-4 to 79 tokens and by 0.05-0.07 while the held-out greedy reward still rose (0.28 -> 0.63);
# at 3e-4 this deep, narrow policy degraded (held-out greedy reward 0.77 -> 0.35). docs/en/benchmarks.md, the demo.
GRPO_LR = "2e-4"


def make_model_and_data(out: Path, size: dict, seed: int, arch: str = "mimo") -> tuple[Path, Path, Path, list[dict]]:
    """arch "mimo": the demo's model with one MTP layer; "llama": a Llama-3.1-shaped one (llama3 RoPE scaling)
    for an external draft (bench/eagle3_online.py)."""
    from slime_spec.tools.tiny_model import LLAMA31_ROPE_SCALING, make_tiny_model
    family = dict(mtp_layers=1) if arch == "mimo" else dict(rope_scaling=LLAMA31_ROPE_SCALING)
    model = make_tiny_model(out / "model_init", arch=arch, hidden_size=size["hidden"], num_layers=size["layers"],
                            num_heads=size.get("heads", 4), num_kv_heads=size.get("kv_heads", 2),
                            intermediate_size=size["ffn"], max_position_embeddings=256,
                            seed=seed, **family)
    train, evals = split_problems(size["n_train"], size["n_eval"], seed, size["digits"], size["terse_share"])
    data = out / "data"
    return model, write_jsonl(train, data / "train.jsonl"), write_jsonl(evals, data / "eval.jsonl"), train


def sft_samples(rows: list[dict], tokenizer) -> list:
    """Prompt + answer + EOS, loss on the answer and EOS: tokenized exactly as the rollout tokenizes prompts."""
    from slime_spec.rollout.sample import Sample
    out = []
    for i, row in enumerate(rows):
        prompt = tokenizer.encode(row["prompt"], add_special_tokens=False)
        answer = tokenizer.encode(row["label"], add_special_tokens=False) + [tokenizer.eos_token_id]
        out.append(Sample(index=i, group_index=i, prompt=row["prompt"], label=row["label"], tokens=prompt + answer,
                          response=row["label"], response_length=len(answer), reward=0.0))
    return out


def cpu_has_bf16(cpuinfo: str) -> bool:
    """Whether the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX); `cpuinfo` is /proc/cpuinfo's text."""
    flags = {f for line in cpuinfo.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def native_bf16() -> bool:
    """Whether this machine's CPU multiplies bfloat16 natively (Linux: /proc/cpuinfo; elsewhere: no)."""
    path = Path("/proc/cpuinfo")
    return path.exists() and cpu_has_bf16(path.read_text())


def sft_argv(model: Path, size: dict, seed: int, out: Path, mtp: bool = True, bf16: bool = False) -> list[str]:
    """The SFT warm-up's trainer flags (bench/demo_sft.py trains with the same)."""
    return ["--hf-checkpoint", str(model), "--loss-type", "sft", "--lr", size.get("sft_lr", "3e-3"),
            "--global-batch-size", str(size["sft_batch"]), "--micro-batch-size", str(size["sft_batch"]),
            "--rollout-backend", "embedded", "--output-dir", str(out), "--seed", str(seed),
            *(["--bf16"] if bf16 else []), *([*MTP_FLAGS, "--enable-mtp-training"] if mtp else [])]


def sft_warmup(model: Path, rows: list[dict], out: Path, size: dict, seed: int, mtp: bool = True,
               bf16: bool = False) -> Path:
    """A short SFT of the policy (and its MTP layer when `mtp`), in bfloat16 with float32 master weights when
    `bf16`; the result is written as an HF checkpoint in float32, the model's dtype (a bfloat16 SFT's weights are
    exactly representable). The demo takes bfloat16 where the CPU multiplies it natively: on the 2-core demo
    machine an SFT step took 0.70 s against 1.01 s in float32, to the same loss after 200 steps (bench/demo_sft.py,
    docs/en/benchmarks.md). GRPO stays float32, as the engines are."""
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from slime_spec.config.args import parse_config
    from slime_spec.driver.loop import init_ray
    from slime_spec.trainer.group import TrainGroup
    config, _ = parse_config(sft_argv(model, size, seed, out, mtp=mtp, bf16=bf16))
    tokenizer = AutoTokenizer.from_pretrained(model)
    samples = sft_samples(rows, tokenizer)
    rng = random.Random(seed)
    init_ray()
    group = TrainGroup(config)
    try:
        bar = tqdm(range(size["sft_steps"]), desc="SFT warm-up", mininterval=2.0)
        for step in bar:
            m = group.train_step(rng.sample(samples, size["sft_batch"]), step)
            bar.set_postfix(loss=f"{m['loss']:.3f}", mtp=f"{m.get('mtp_loss', 0.0):.3f}", refresh=False)
        state = group.hf_state_dict()
    finally:
        group.shutdown()  # Ray stays up: the GRPO run that follows joins it (one Ray start per demo)
    dst = out / "model_sft"
    dst.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    save_file({k: v.float().contiguous() for k, v in state.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst


def grpo_argv(model: Path, train_data: Path, eval_data: Path, run_dir: Path, size: dict, seed: int,
              layout: str | None = None) -> list[str]:
    """The demo's GRPO run: MTP trained online, timed against plain and against its draft frozen at the start.
    `layout` (on GPUs): "split", trainer on GPU 0 and the engine on GPU 1, weights over NCCL; "colocate", both on
    GPU 0, each one's memory released while the other works; "colocate-tp2" / "colocate-pp2", the trainer at TP 2 / in
    two pipeline stages over GPUs 0 and 1 and an engine on each, colocated."""
    argv = grpo_task_argv(model, train_data, eval_data, run_dir, size, seed, lr=size.get("grpo_lr", GRPO_LR))
    return argv + [*MTP_FLAGS, *SPEC_FLAGS, "--enable-mtp-training", "--spec-speedup-frozen-draft",
                   *gpu_layout_argv(layout)]


def gpu_layout_argv(layout: str | None) -> list[str]:
    """The flags of a GPU layout (None: the CPU demo): bfloat16 training with float32 master weights, a bfloat16
    engine, and one GPU each for trainer and engine (split), one shared (colocate), or two shared by a TP 2 (or two
    stage) trainer and two engines (colocate-tp2, colocate-pp2)."""
    if layout is None:
        return []
    if layout not in LAYOUTS:
        raise ValueError(f"--layout={layout!r}: one of {LAYOUTS}")
    gpus = "2" if layout in SHARED_TWO_GPU_LAYOUTS else "1"
    argv = ["--bf16", "--sglang-dtype", "bfloat16", "--actor-num-gpus-per-node", gpus, "--rollout-num-gpus", gpus]
    if layout == "split":
        return argv
    if layout in SHARED_TWO_GPU_LAYOUTS:  # an engine per GPU (the placement counts them; the flag says it too)
        argv += [SHARED_TWO_GPU_LAYOUTS[layout], "2", "--rollout-num-engines", "2"]
    # SGLang's memory saver where torch_memory_saver is installed: a release then keeps the engine's addresses and
    # its CUDA graphs, instead of capturing them all again on every resume
    saver = ["--sglang-enable-memory-saver"] if importlib.util.find_spec("torch_memory_saver") else []
    return argv + ["--colocate", *saver]


def resolve_device(device: str, gpus: int) -> str:
    """--device auto: cuda where torch sees a GPU."""
    if device == "auto":
        return "cuda" if gpus else "cpu"
    if device == "cuda" and not gpus:
        raise ValueError("--device cuda: torch sees no CUDA device here; use --device cpu (or auto)")
    return device


def resolve_layout(layout: str | None, gpus: int) -> str:
    """--layout on GPUs: split, colocate-tp2 and colocate-pp2 need two (trainer on GPU 0 and engine on GPU 1; a TP 2
    or two-stage trainer and an engine on each); unset, split where two are seen."""
    if layout is None:
        return "split" if gpus >= 2 else "colocate"
    if layout in TWO_GPU_LAYOUTS and gpus < 2:
        raise ValueError(f"--layout {layout} needs two GPUs, and torch sees {gpus}; use --layout colocate (trainer "
                         "and engine on one GPU)")
    return layout


def grpo_task_argv(model: Path, train_data: Path, eval_data: Path, run_dir: Path, size: dict, seed: int,
                   lr: str = GRPO_LR) -> list[str]:
    """The GRPO run on the demo's task, without speculative flags: model, data, batch sizes, eval, speed-up."""
    n = size["prompts"] * size["samples"] // size["updates_per_rollout"]  # PPO minibatches per rollout
    argv = ["--hf-checkpoint", str(model), "--rollout-backend", "embedded", "--rollout-num-engines", "1",
            "--prompt-data", str(train_data), "--input-key", "prompt", "--label-key", "label",
            "--rm-type", size["rm_type"], "--rollout-skip-special-tokens", "--rollout-shuffle",
            "--num-rollout", str(size["grpo_steps"]), "--rollout-batch-size", str(size["prompts"]),
            "--n-samples-per-prompt", str(size["samples"]), "--rollout-max-response-len", str(size["max_response_len"]),
            "--rollout-temperature", "1.0", "--global-batch-size", str(n), "--micro-batch-size", str(n),
            # with speculation SGLang runs 48 requests at once unless told otherwise (doctor:
            # SPEC_MAX_RUNNING_REQUESTS), while a plain engine runs the whole rollout at once: every engine takes it all
            "--sglang-max-running-requests", str(size["prompts"] * size["samples"]),
            "--advantage-estimator", "grpo", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
            "--lr", lr, "--seed", str(seed), "--rollout-seed", str(seed),
            "--output-dir", str(run_dir), "--metrics-jsonl", str(run_dir / "metrics.jsonl"),
            # held-out greedy accuracy before training and after the last step: the clean measure of progress
            "--eval-prompt-data", "addition", str(eval_data), "--eval-interval", str(max(1, size["grpo_steps"] // 2)),
            "--eval-temperature", "0",
            # every few steps the same prompts are also timed without speculation: the honest speed-up
            "--spec-speedup-interval", str(size["speedup_interval"]),
            # each engine timed 3 times per measurement, its median pass kept: on the 2-core machine identical
            # engines ran up to 14% apart in one pass (bench/speedup_noise.py)
            "--spec-speedup-repeats", str(size["speedup_repeats"])]
    return argv


def grpo(argv: list[str]) -> dict:
    import ray

    from slime_spec.driver.loop import preflight, run, stop_private_ray
    try:
        return run(preflight(argv))
    finally:
        stop_private_ray()  # the Ray the SFT warm-up started
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    from slime_spec.common.logging_setup import quiet_known_noise
    quiet_known_noise()  # the SFT warm-up loads the checkpoint's config in this process too
    p = argparse.ArgumentParser(prog="slime-spec demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a small run that still goes through every stage")
    p.add_argument("--out", default="outputs/demo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda where torch sees a GPU; on cuda the target has 0.5B parameters (--smoke: the "
                        "smoke size)")
    p.add_argument("--layout", choices=LAYOUTS, default=None,
                   help="on cuda: split (trainer GPU 0, engine GPU 1, NCCL weight sync; the default with 2 GPUs), "
                        "colocate (one GPU shared, each side's memory offloaded while the other works) or "
                        "colocate-tp2 / colocate-pp2 (two GPUs shared by a TP 2 or two-stage trainer and an engine on "
                        "each)")
    args = p.parse_args(argv)
    import torch

    gpus = torch.cuda.device_count()
    try:
        device = resolve_device(args.device, gpus)
        if device == "cpu" and args.layout is not None:
            raise ValueError("--layout places trainer and engine on GPUs: drop it with --device cpu")
        layout = resolve_layout(args.layout, gpus) if device == "cuda" else None
    except ValueError as e:
        p.error(str(e))
    size = SIZES["smoke" if args.smoke else ("gpu" if device == "cuda" else "full")]
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    t0 = time.perf_counter()
    print(f"[demo] building a tiny MiMo model and an addition task under {out}", flush=True)
    model, train_data, eval_data, rows = make_model_and_data(out, size, args.seed)
    bf16 = device == "cuda" or native_bf16()
    print(f"[demo] SFT warm-up: {size['sft_steps']} steps of {size['sft_batch']} problems, "
          f"{'bfloat16' if bf16 else 'float32'} on {device}", flush=True)
    sft_model = sft_warmup(model, rows, out, size, args.seed, bf16=bf16)
    where = f" on {gpus} GPU(s), layout {layout}" if layout else ""
    print(f"[demo] GRPO with NEXTN speculative rollout and online MTP training{where}", flush=True)
    title = demo_title(size) + (f" ({layout}, {torch.cuda.get_device_name(0)})" if layout else "")
    run = grpo(grpo_argv(sft_model, train_data, eval_data, out / "run", size, args.seed, layout))
    return finish(out, run, time.perf_counter() - t0, title, smoke=args.smoke, device_async=device == "cuda")


def demo_title(size: dict) -> str:
    return (f"tiny MiMo ({size['layers']} layers + 1 MTP layer, hidden {size['hidden']}) on {size['digits']}-digit "
            "addition with a scratchpad: GRPO, NEXTN speculative rollout")


def reward_verdict(r0: float, r1: float, smoke: bool) -> str:
    """What the reward trend means; a smoke run is too short to learn, so its trend is no verdict."""
    if smoke:
        return "smoke run: too few steps to learn, the trend means nothing"
    return "rose" if r1 > r0 else "did NOT rise"


TIME_SHARES = ("engine", *SPEC_PHASES, "outside_engine")


def run_time_and_accept(rollouts: list[dict]) -> dict:
    """Over a run's rollouts: each time share weighted by rollout seconds (rollout/metrics.time_shares: engine
    phases, and outside the engine = HTTP, queues), and accept length token-weighted (tokens per verify pass over
    every sample) and per sample (the mean of per-sample ratios, averaged over rollouts)."""
    out = {}
    for name in TIME_SHARES:
        timed = [(r[f"time_share_{name}"], r["rollout_time_s"]) for r in rollouts if f"time_share_{name}" in r]
        seconds = sum(t for _, t in timed)
        out[f"time_share_{name}"] = sum(v * t for v, t in timed) / seconds if seconds else None
    verify = sum(r.get("spec_verify_ct") or 0 for r in rollouts)
    completion = sum(r.get("spec_completion_tokens") or 0 for r in rollouts)
    out["accept_length_token_weighted"] = accept_length(completion, verify) if verify else None
    per_sample = [r["spec_accept_length"] for r in rollouts if r.get("spec_accept_length") is not None]
    out["accept_length_per_sample"] = sum(per_sample) / len(per_sample) if per_sample else None
    return out


def format_time_and_accept(m: dict, device_async: bool = False) -> str:
    """device_async: the engine ran on a GPU, where its phases are host times (engine/speculative/timing.py): a
    phase's device work shows in the phase that waits for it, so the split is labelled as such."""
    accept = (f"accept length {m['accept_length_token_weighted']:.2f} token-weighted, "
              f"{m['accept_length_per_sample']:.2f} per sample" if m["accept_length_token_weighted"] else "")
    if m["time_share_engine"] is None:
        return accept
    phases = ", ".join(f"{p} {m[f'time_share_{p}']:.0%}" for p in SPEC_PHASES
                       if m[f"time_share_{p}"] is not None)
    split = (f"host time by phase, the GPU's work showing where the host waits for it: {phases}" if device_async
             else f"{phases} of them")
    return (f"{accept}; rollout time: engine steps {m['time_share_engine']:.0%} ({split}), "
            f"outside the engine (HTTP, queues) {m['time_share_outside_engine']:.0%}")


def frozen_draft(run: dict) -> dict:
    """The frozen draft's side of the run's speed-up measurements (`--spec-speedup-frozen-draft`), and the online
    draft's accept rate at the same measurements, first and last (pure)."""
    keys = ("spec_speedup_frozen", "spec_speedup_frozen_first", "spec_speedup_frozen_last",
            "spec_speedup_frozen_accept_rate_first", "spec_speedup_frozen_accept_rate_last",
            "spec_speedup_accept_rate_first", "spec_speedup_accept_rate_last")
    return {k: run.get(k) for k in keys}


def online_draft_gain(rollouts: list[dict]) -> dict:
    """What training the draft online bought, timed (pure): the frozen-draft engine's seconds over engine 0's on the
    same prompts and target weights, over the run (sums of seconds) and at each speed-up measurement."""
    measured = [r for r in rollouts if r.get("spec_speedup_frozen_s") and r.get("spec_speedup_spec_s")]
    each = [r["spec_speedup_frozen_s"] / r["spec_speedup_spec_s"] for r in measured]
    total = (sum(r["spec_speedup_frozen_s"] for r in measured) / sum(r["spec_speedup_spec_s"] for r in measured)
             if measured else None)
    return {"online_draft_gain": total, "online_draft_gain_each": each}


def finish(out: Path, run: dict, elapsed_s: float, title: str, smoke: bool = False,
           device_async: bool = False) -> int:
    from slime_spec.driver.report import plot
    shutil.copy(out / "run" / "metrics.jsonl", out / "metrics.jsonl")
    plot(run["rollouts"], out / "plot.png", title, label="MTP trained online")
    frozen = frozen_draft(run)
    summary = {"elapsed_s": elapsed_s, "title": title, "smoke": smoke,
               "mtp_trained": {k: v for k, v in run.items() if k != "rollouts"}, "draft_frozen": frozen}
    r0, r1 = run["reward_first_quarter_mean"], run["reward_last_quarter_mean"]
    summary["reward_rose"] = None if smoke else r1 > r0
    summary["spec_speedup"] = {"mtp_trained": run["spec_speedup"], "draft_frozen": frozen["spec_speedup_frozen"]}
    summary["time_and_accept"] = {"mtp_trained": run_time_and_accept(run["rollouts"])}
    summary.update(online_draft_gain(run["rollouts"]))
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    print(f"\n[demo] {title}\n[demo] done in {elapsed_s:.0f}s (first quarter of the steps -> last quarter, means)")
    print(f"  reward        {r0:.3f} -> {r1:.3f} ({reward_verdict(r0, r1, smoke)})")
    print(f"  accept length {run['accept_length_first_quarter_mean']:.3f} -> "
          f"{run['accept_length_last_quarter_mean']:.3f} (MTP trained online, rollouts)")
    if run.get("accept_rate_first_quarter_mean") is not None:
        print(f"  accept rate   {run['accept_rate_first_quarter_mean']:.3f} -> "
              f"{run['accept_rate_last_quarter_mean']:.3f} (accepted / drafted tokens: the draft's quality) "
              "(MTP trained online, rollouts)")
    n = run["spec_speedup_measurements"]
    rates = [(name, frozen[f"spec_speedup{key}_accept_rate_first"], frozen[f"spec_speedup{key}_accept_rate_last"])
             for name, key in (("MTP trained online", ""), ("draft frozen", "_frozen"))]
    for name, a0, a1 in rates:
        if a0 is not None and a1 is not None:
            print(f"  accept rate   {a0:.3f} -> {a1:.3f} ({name}, first -> last of {n} speed-up measurements)")
    if run.get("spec_speedup") is not None:
        print(f"  spec_speedup  {run['spec_speedup']:.2f}x over the run (first {run['spec_speedup_first']:.2f}x, "
              f"last {run['spec_speedup_last']:.2f}x; plain time / speculative time, same prompts) (MTP trained "
              "online)")
    if frozen["spec_speedup_frozen"] is not None:
        print(f"  spec_speedup  {frozen['spec_speedup_frozen']:.2f}x over the run (first "
              f"{frozen['spec_speedup_frozen_first']:.2f}x, last {frozen['spec_speedup_frozen_last']:.2f}x; the same "
              "prompts and target weights, the MTP layer as SFT left it) (draft frozen)")
    if run.get("spec_speedup_step") is not None:
        frozen_step = run.get("spec_speedup_step_frozen")
        print(f"  whole step    {run['spec_speedup_step']:.2f}x over the measured steps (each step's time with its "
              "rollout decoded plainly / its time; training and sync unchanged) (MTP trained online)"
              + (f"; {frozen_step:.2f}x with the draft frozen" if frozen_step is not None else ""))
    if summary["online_draft_gain"] is not None:
        each = ", ".join(f"{g:.2f}" for g in summary["online_draft_gain_each"])
        print(f"  online draft  {summary['online_draft_gain']:.2f}x the frozen draft's speed over the run (frozen "
              f"time / online time, same prompts and target weights; at each measurement: {each})")
    print(f"  {format_time_and_accept(summary['time_and_accept']['mtp_trained'], device_async)} "
          "(MTP trained online)")
    print(f"  outputs: {out / 'metrics.jsonl'}, {out / 'summary.json'}, {out / 'plot.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
