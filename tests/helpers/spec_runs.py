"""Shared pieces of the speculative-decoding tests: tiny checkpoints, a request mix that joins mid-flight, good
MTP drafts, and the plain sampler's exact token distributions to test sampling against."""

from __future__ import annotations

from pathlib import Path

import torch

from slime_spec.engine.managers.engine_core import Request, SamplingParams, SpecConfig
from slime_spec.engine.model_executor.model import load_model
from slime_spec.speculative.settings import resolve_or_raise
from slime_spec.tools.tiny_model import make_tiny_model

PROMPTS = ["hello world", "the cat sat on the mat. the cat sat on the", "a", "1 2 3 4 5 6 7 8 1 2 3",
           "abcabcabcabcabc", "Q: why? A:", "xyz " * 8, "no", "repeat repeat repeat repeat", "!", "tail end",
           "mixing it up here"]


def make_spec_checkpoints(root: Path) -> dict[str, Path]:
    """Targets and drafts by role: a llama with a smaller draft, a MiMo (MTP layer), and 16-token-vocabulary models
    small enough to enumerate two-token continuations exactly."""
    llama = make_tiny_model(root / "llama", hidden_size=32, num_layers=2, seed=11)
    return {
        "llama": llama,
        "draft": make_tiny_model(root / "draft", hidden_size=32, num_layers=1, seed=12, init_from=str(llama)),
        "mimo": make_tiny_model(root / "mimo", arch="mimo", hidden_size=32, num_layers=1, seed=13),
        "v16": make_tiny_model(root / "v16", vocab_size=16, hidden_size=32, num_layers=1, seed=14),
        "v16_draft": make_tiny_model(root / "v16d", vocab_size=16, hidden_size=32, num_layers=1, seed=15),
        "v16_mimo": make_tiny_model(root / "v16m", arch="mimo", vocab_size=16, hidden_size=32, num_layers=1, seed=16),
    }


def generate(engine, requests, join_every=2, first_wave=5):
    """Run requests to completion; the first wave starts together, the rest join mid-flight every few steps."""
    pending, outs, steps = list(requests), {}, 0
    for r in pending[:first_wave]:
        engine.add_request(r)
    pending = pending[first_wave:]
    while engine.has_work() or pending:
        if pending and steps % join_every == 0:
            engine.add_request(pending.pop(0))
        for o in engine.step():
            outs[o.rid] = o
        steps += 1
    return outs


def make_requests(tok, temps=None, logprob=False):
    reqs = []
    for i, text in enumerate(PROMPTS):
        temp = 0.0 if temps is None else temps[i % len(temps)]
        params = SamplingParams(temperature=temp, max_new_tokens=8 + 7 * (i % 6), ignore_eos=i % 3 != 0)
        reqs.append(Request(f"r{i}", tok(text)["input_ids"], params, return_logprob=logprob))
    return reqs


def ngram(draft_tokens: int) -> SpecConfig:
    return resolve_or_raise({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": draft_tokens})


def copy_target_into_mtp(engine):
    """An MTP layer that imitates the 1-layer target on the next token (hidden input ignored): a good draft."""
    w = engine.named_weights("all")
    h = w["model.embed_tokens.weight"].shape[1]
    update = [(n.replace("model.layers.0.", "model.mtp_layers.0."), t.clone()) for n, t in w.items()
              if n.startswith("model.layers.0.")]
    proj = torch.zeros(h, 2 * h)
    proj[:, h:] = torch.eye(h)
    update += [("model.mtp_layers.0.input_proj.weight", proj),
               ("model.mtp_layers.0.token_layernorm.weight", torch.ones(h)),
               ("model.mtp_layers.0.final_layernorm.weight", w["model.norm.weight"].clone())]
    engine.load_weights(update, selector="draft")


def exact_marginals(path, prompt, temperature):
    """P(t2) and P(t3) of the plain sampler, by enumerating t1 and (t1, t2) with batched full forwards."""
    model, config = load_model(path)
    V = config["vocab_size"]

    def next_probs(seqs):
        ids = torch.tensor(seqs)
        pos = torch.arange(ids.shape[1])[None].expand_as(ids)
        logits = model.logits(model(ids, pos, model.new_cache(len(seqs), ids.shape[1]), torch.arange(len(seqs))))
        return torch.softmax(logits[:, -1].double() / temperature, -1)

    p1 = next_probs([prompt])[0]
    p2 = next_probs([prompt + [a] for a in range(V)])  # [V(t1), V(t2)]
    p3 = next_probs([prompt + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    joint2 = p1[:, None] * p2
    return joint2.sum(0), (joint2[..., None] * p3).sum((0, 1))
