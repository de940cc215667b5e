"""The checkpoints bench/engine.py measures: random ones for the bounds, and briefly trained targets whose drafts
learn from the target's own outputs (the regime where speculation should pay): a MiMo with its MTP layer, and a
Llama (llama3 RoPE) with an EAGLE3 draft head.

Training runs the engine's own model (slime_spec.engine.model_executor.model) with autograd: a fresh KV cache per batch
is just
scratch space. Trained checkpoints are cached under `--model-cache` by their settings, so reruns only measure.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from slime_spec.common import eagle3_draft
from slime_spec.demo.task import split_problems
from slime_spec.engine.model_executor.model import CausalLM, hf_weight_names, load_model
from slime_spec.tools.tiny_model import LLAMA31_ROPE_SCALING, make_tiny_eagle3_draft, make_tiny_model
from slime_spec.trainer.eagle3_ttt import ttt_loss

TRAIN_BATCH = 16  # sequences per training step: small, so a CPU trains the bench's model in minutes
# The EAGLE3 draft's vocabulary: every character the scratchpad task writes ('+' and '=' included) and EOS, fewer
# than the target's ids, so the d2t / t2d maps are real.
EAGLE3_DRAFT_VOCAB = 90


def make_exact_pair(out: Path, shape: dict, draft_layers: int) -> tuple[Path, Path]:
    """(target, draft): a random Qwen2 target whose layers from `draft_layers` on are identity (o_proj and down_proj
    zeroed, so the residual passes through) and a draft made of its first `draft_layers` layers. The two compute the
    same logits (every draft token is accepted) while the draft costs draft_layers / num_layers of the trunk."""
    target = make_tiny_model(out / "exact_target", arch="qwen2", seed=0, **shape)
    path = target / "model.safetensors"
    weights = load_file(str(path))
    for layer in range(draft_layers, shape["num_layers"]):
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            weights[f"model.layers.{layer}.{name}.weight"].zero_()
    save_file(weights, str(path), metadata={"format": "pt"})
    draft = make_tiny_model(out / "exact_draft", arch="qwen2", seed=1, init_from=str(target),
                            **{**shape, "num_layers": draft_layers})
    return target, draft


def make_anti_draft(target: Path, out: Path, shape: dict) -> Path:
    """The target with an untied, negated lm_head: its greedy draft is the target's argmin, never accepted."""
    make_tiny_model(out, arch="qwen2", seed=0, init_from=str(target), tie_word_embeddings=False, **shape)
    weights = load_file(str(out / "model.safetensors"))
    weights["lm_head.weight"] = -load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def encode_problems(tokenizer, rows: list[dict]) -> list[tuple[list[int], int]]:
    """(prompt + worked answer + EOS, prompt length) per problem, tokenized as the rollout tokenizes prompts."""
    out = []
    for row in rows:
        prompt = tokenizer.encode(row["prompt"], add_special_tokens=False)
        answer = tokenizer.encode(row["label"], add_special_tokens=False) + [tokenizer.eos_token_id]
        out.append((prompt + answer, len(prompt)))
    return out


def batch_tensors(seqs: list[tuple[list[int], int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] (right-padded with 0) and a float mask [B, T] of the response tokens (the loss targets)."""
    width = max(len(s) for s, _ in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s, _ in seqs])
    pos = torch.arange(width)[None]
    lengths = torch.tensor([len(s) for s, _ in seqs])[:, None]
    starts = torch.tensor([p for _, p in seqs])[:, None]
    return ids, ((pos >= starts) & (pos < lengths)).float()


def trunk_hidden(model: CausalLM, ids: torch.Tensor, aux_layer_ids: list[int] | None = None):
    """Final-normed hidden states [B, T, H]; with aux_layer_ids, (hidden, aux states [B, T, n * H])."""
    B, T = ids.shape
    cache = model.new_cache(B, T)
    positions = torch.arange(T, device=ids.device)[None].expand(B, T)
    return model(ids, positions, cache, torch.arange(B, device=ids.device), num_keys=T, aux_layer_ids=aux_layer_ids)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(mask)
    return (loss * mask).sum() / mask.sum().clamp(min=1)


def sft_loss(model: CausalLM, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The target's next-token loss on the response tokens."""
    logits = model.logits(trunk_hidden(model, ids)[:, :-1])
    return next_token_loss(logits, ids[:, 1:], mask[:, 1:])


MTP_UNROLL_STEPS = 3  # the product's --mtp-unroll-steps for NEXTN's 3 draft steps (trainer/model.py)


def mtp_loss(model: CausalLM, ids: torch.Tensor, mask: torch.Tensor, unroll_steps: int = MTP_UNROLL_STEPS
             ) -> torch.Tensor:
    """MTP layer 0's loss with the trunk frozen: at position p it reads (x_{p+1}, h_p) and predicts x_{p+2}; then
    unroll_steps - 1 more steps fed its own output, step d at p reading (x_{p+d+1}, its step d - 1 output at p) and
    predicting x_{p+d+2}, as the trainer's --mtp-unroll-steps does (each step attends within itself). The mean
    over the steps."""
    B, T = ids.shape
    with torch.no_grad():
        hidden = trunk_hidden(model, ids)
    slots = torch.arange(B, device=ids.device)
    out, losses = hidden, []
    for d in range(min(unroll_steps, T - 2)):  # step d needs a target at p + d + 2 for some p
        width = T - 1 - d
        positions = torch.arange(d, d + width, device=ids.device)[None].expand(B, width)  # step d drafts at p + d
        out = model.mtp_forward(ids[:, 1 + d:], out[:, :width], positions, model.new_mtp_cache(B, T), slots,
                                num_keys=width)
        losses.append(next_token_loss(model.logits(out[:, :-1]), ids[:, 2 + d:], mask[:, 2 + d:]))
    return torch.stack(losses).mean()


def eagle3_loss(draft: eagle3_draft.Eagle3Draft, aux_layer_ids: list[int], ttt_steps: int):
    """The EAGLE3 draft's training-time-test loss (trainer/eagle3_ttt.py, what online training runs) on the frozen
    target's features: its embeddings, aux states and logits, as the policy's forward exposes them."""

    def loss(model: CausalLM, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            hidden, aux = trunk_hidden(model, ids, aux_layer_ids)
            logits, embeds = model.logits(hidden), model.model.embed_tokens(ids)
        positions = torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids)
        return ttt_loss(draft, embeds, aux, logits, positions, mask, ttt_steps).loss

    return loss


def train(model: CausalLM, params: list[torch.nn.Parameter], loss_fn, data: list, steps: int, batch: int, lr: float,
          seed: int, label: str) -> float:
    """AdamW with a linear warm-up and decay; returns the last loss (printed every 50 steps, to stderr-free stdout)."""
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / steps))
    rng = random.Random(seed)
    start, loss = time.perf_counter(), torch.tensor(float("nan"))
    device = model.lm_head.weight.device
    for step in range(steps):
        ids, mask = (t.to(device) for t in batch_tensors(rng.sample(data, batch)))
        loss = loss_fn(model, ids, mask)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"[bench] {label} step {step + 1}/{steps} loss {loss.item():.3f} "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)
    model.requires_grad_(False)
    return float(loss.item())


def save_checkpoint(model: CausalLM, like: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for f in like.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    params = dict(model.named_parameters(remove_duplicate=False))
    save_file({n: params[n].detach().contiguous() for n in hf_weight_names(model)}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def sample_outputs(model_path: Path, prompts: list[list[int]], max_new: int, seed: int) -> list[tuple[list[int], int]]:
    """The target's own temperature-1 completions (prompt + output, prompt length): what the MTP layer learns."""
    from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams
    core = EngineCore(str(model_path), None, max_running_requests=64, seed=seed)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new)
    for i, p in enumerate(prompts):
        core.add_request(Request(f"s{i}", p, params))
    outs = {}
    while core.has_work():
        outs.update({o.rid: o for o in core.step()})
    return [(prompts[i] + outs[f"s{i}"].output_ids, len(prompts[i])) for i in range(len(prompts))]


def trained_mtp_model(cache_dir: Path, shape: dict, digits: int, sft_steps: int, mtp_steps: int,
                      seed: int = 0) -> tuple[Path, list[list[int]]]:
    """A MiMo target SFT-trained on the scratchpad task, then its MTP layer trained on the target's own sampled
    outputs (trunk frozen). Returns the checkpoint and held-out prompts (token ids) to benchmark on."""
    from transformers import AutoTokenizer

    settings = dict(shape=shape, digits=digits, sft_steps=sft_steps, mtp_steps=mtp_steps, seed=seed, version=1,
                    mtp_unroll_steps=MTP_UNROLL_STEPS)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    root = cache_dir / f"trained_mtp_{key}"
    train_rows, eval_rows = split_problems(2000, 64, seed, digits)
    init = make_tiny_model(root / "init", arch="mimo", mtp_layers=1, seed=seed, **shape)
    tokenizer = AutoTokenizer.from_pretrained(str(init))
    eval_prompts = [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in eval_rows]
    done = root / "model"
    if (done / "model.safetensors").exists():
        return done, eval_prompts
    model, _ = sft_target(init, train_rows, sft_steps, seed)
    sft = save_checkpoint(model, init, root / "sft")
    prompts = [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in train_rows[:256]]
    own = sample_outputs(sft, prompts, max_new=120, seed=seed)
    mtp = list(model.model.mtp_layers.parameters())
    train(model, mtp, mtp_loss, own, mtp_steps, TRAIN_BATCH, 3e-3, seed + 1, "MTP on the target's outputs")
    save_checkpoint(model.eval(), init, done)
    return done, eval_prompts


def sft_target(init: Path, rows: list[dict], steps: int, seed: int, device: str = "cpu", lr: float = 3e-3,
               batch: int = TRAIN_BATCH) -> tuple[CausalLM, list]:
    """The checkpoint at `init` SFT-trained (trunk only, float32 weights) on the scratchpad task; also the encoded
    problems."""
    from transformers import AutoTokenizer

    model, _ = load_model(init, device=device)
    model.train()
    trunk = [p for n, p in model.named_parameters() if not n.startswith("model.mtp_layers.")]
    data = encode_problems(AutoTokenizer.from_pretrained(str(init)), rows)
    train(model, trunk, sft_loss, data, steps, batch, lr, seed, "target SFT")
    return model, data


def train_eagle3_draft(target: Path, own: list[tuple[list[int], int]], out: Path, steps: int, ttt_steps: int = 3,
                       lr: float = 3e-3, seed: int = 0, draft_vocab: int = EAGLE3_DRAFT_VOCAB) -> Path:
    """An EAGLE3 draft for the Llama at `target` (random init, `make_tiny_eagle3_draft`), trained with the target
    frozen on `own` (prompt + output, prompt length: the target's own outputs); written to `out`."""
    init = make_tiny_eagle3_draft(out.parent / f"{out.name}_init", target, draft_vocab_size=draft_vocab, seed=seed + 1)
    model, _ = load_model(target)
    draft = eagle3_draft.load_draft(init, model.args.num_layers)
    ids = eagle3_draft.aux_layer_ids(draft.config, model.args.num_layers)
    train(model, list(draft.parameters()), eagle3_loss(draft, ids, ttt_steps), own, steps, TRAIN_BATCH, lr,
          seed + 1, "EAGLE3 draft on the target's outputs")
    return eagle3_draft.save_draft(draft.eval(), out)


def trained_eagle3_model(cache_dir: Path, shape: dict, digits: int, sft_steps: int, draft_steps: int,
                         seed: int = 0) -> tuple[Path, Path, list[list[int]]]:
    """A Llama target (llama3 RoPE scaling) SFT-trained on the scratchpad task, then an EAGLE3 draft trained on the
    target's own sampled outputs. Returns (target, draft, held-out prompts as token ids)."""
    from transformers import AutoTokenizer

    settings = dict(shape=shape, digits=digits, sft_steps=sft_steps, draft_steps=draft_steps, seed=seed,
                    draft_vocab=EAGLE3_DRAFT_VOCAB, version=1)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    root = cache_dir / f"trained_eagle3_{key}"
    train_rows, eval_rows = split_problems(2000, 64, seed, digits)
    init = make_tiny_model(root / "init", arch="llama", seed=seed, rope_scaling=LLAMA31_ROPE_SCALING, **shape)
    tokenizer = AutoTokenizer.from_pretrained(str(init))
    eval_prompts = [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in eval_rows]
    target, draft = root / "target", root / "draft"
    if (draft / eagle3_draft.CHECKPOINT_FILE).exists():
        return target, draft, eval_prompts
    model, _ = sft_target(init, train_rows, sft_steps, seed)
    save_checkpoint(model.eval(), init, target)
    prompts = [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in train_rows[:256]]
    own = sample_outputs(target, prompts, max_new=120, seed=seed)
    train_eagle3_draft(target, own, draft, draft_steps, seed=seed)
    return target, draft, eval_prompts
