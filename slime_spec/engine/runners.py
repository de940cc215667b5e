"""Which served tensors a weight-update `selector` reaches, by HF name, with SGLang 0.5.23's semantics.

SGLang's weight_updater fans an update out to the selected model runners ("target", "draft", or "all"); each
runner loads the names its model has. The MiMo target runner skips `model.mtp_layers.*`; the MTP draft runner
loads those plus the embedding and lm_head it shares with the target; a STANDALONE draft loads every name it has
(so "all" overwrites a same-shaped external draft with target tensors, the hazard behind slime #1177).
"""

from __future__ import annotations

import torch

from slime_spec.engine.model import CausalLM, hf_weight_names

Runner = dict[str, torch.nn.Parameter]


def select_runners(target: CausalLM, drafter, selector: str) -> list[Runner]:
    if selector not in ("target", "draft", "all"):
        raise ValueError(f"invalid selector {selector!r}; expected 'target', 'draft', or 'all'")
    runners = []
    if selector in ("target", "all"):
        params = dict(target.named_parameters(remove_duplicate=False))
        runners.append({n: params[n] for n in hf_weight_names(target) if not n.startswith("model.mtp_layers.")})
    if selector in ("draft", "all") and drafter is not None:
        draft = drafter.weight_runner()
        if draft is not None:
            runners.append(draft)
    return runners


def named_weights(runners: list[Runner]) -> dict[str, torch.Tensor]:
    """Served tensors by HF name; where a STANDALONE draft shares a name with the target, the target's wins."""
    out: dict[str, torch.Tensor] = {}
    for runner in reversed(runners):
        out.update({n: p.detach() for n, p in runner.items()})
    return out


def plan_load(runners: list[Runner], named: list[tuple[str, torch.Tensor]], *, tied: bool, selector: str,
              algorithm: str | None) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Check every name, shape and dtype and return the (parameter, tensor) copies to make; raise on any error.

    A name no selected runner has is an error. A tied model's `lm_head.weight` is accepted and skipped, as
    SGLang's loaders skip it. A tensor shared by several runners (MiMo's embedding) is copied once.
    """
    plan: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        targets = list({id(r[name]): r[name] for r in runners if name in r}.values())
        if not targets and tied and name == "lm_head.weight" and selector != "draft":
            embed = runners[0]["model.embed_tokens.weight"]
            if tuple(tensor.shape) != tuple(embed.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != served {tuple(embed.shape)}")
            continue
        if not targets:
            raise ValueError(f"{name}: no runner selected by selector={selector!r} has this weight "
                             f"(speculative algorithm {algorithm}); check the name or the selector")
        if not (tensor.is_floating_point() or tensor.dtype == targets[0].dtype):
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot be loaded into a {targets[0].dtype} weight")
        for param in targets:
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != served {tuple(param.shape)}")
            plan.append((param, tensor))
    return plan
