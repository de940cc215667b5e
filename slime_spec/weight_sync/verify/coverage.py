"""Did the sync write every weight the engine serves, and are the served values the trainer's?

Coverage reads the engine's own list of served weights: `/weights_checker {"action": "checksum"}`
returns, per TP rank, a checksum for every parameter and buffer of every selected runner (target
keys unprefixed, draft keys prefixed with the runner's role, e.g. `draft.`), in the engine's
internal names: SGLang fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, and its MTP draft
models rename the MTP block (`model.mtp_layers.{N}.input_proj` -> `model.input_proj`, ...). A served name
is covered when some sent tensor maps onto it.

Values: the checksums SGLang's WeightChecker computes are reproduced from the sent tensors by
weight_sync/verify/sglang_params.py (SGLang's served names, fused and vocabulary-padded values in the engine's dtype,
hashed
by SGLang's own `tensor_hash`; checked against SGLang's model classes in
tests/conformance/test_weight_checker.py) and compared name for name. They equal an engine's only where
it hashes on CPU; on GPU SGLang hashes with a Triton kernel, and weight_sync/verify/readback.py decides which value
check
applies to which engine.

An external draft must keep its own weights, except those SGLang shares with the target: an EAGLE3
draft uses the target's embedding (and, per model, its lm_head), so those follow every target update.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from slime_spec.weight_sync.verify.sglang_params import fuse, sent_expert_parts, stacked_parts

# Prefixes SGLang's MTP draft models put in front of a layer's own names.
_DRAFT_PREFIXES = ("model.decoder.", "model.mtp_block.", "model.mtp_layers.", "model.layers.", "model.")
_ROLE_KEY = re.compile(r"^(draft[\w]*)\.(.+)$")
# Buffers a checksum lists but a sync never writes (derived from the config, not trained).
_DERIVED = ("rotary_emb", "inv_freq", "cos_sin_cache")


def fused_name(name: str) -> str | None:
    """`...self_attn.q_proj.weight` -> `...self_attn.qkv_proj.weight`; None if the name is not a stacked part."""
    fused, _ = fuse(name)
    return fused if fused != name else None


def served_by_role(checker_reply: dict) -> dict[str, dict[str, str]]:
    """`/weights_checker` reply -> {role: {name: checksum}} (checksums of TP rank 0; names of all ranks).

    The embedded engine's `names` action (a slime-spec extension) answers `shapes` instead of `checksums`:
    the values are then shapes, good for coverage (names) only."""
    ranks = checker_reply.get("ranks")
    if not ranks:
        raise ValueError(f"/weights_checker returned no `ranks` (checksums): {checker_reply.get('message')!r}")
    out: dict[str, dict[str, str]] = {}
    for rank_index, info in enumerate(ranks):
        entries = info["checksums"] if "checksums" in info else info["shapes"]
        for key, checksum in entries.items():
            m = _ROLE_KEY.match(key)
            role, name = (m.group(1), m.group(2)) if m else ("target", key)
            if rank_index == 0 or name not in out.get(role, {}):
                out.setdefault(role, {})[name] = checksum
    return out


def engine_tp_size(checker_reply: dict) -> int:
    infos = checker_reply["ranks"][0]["parallelism_info"]
    infos = infos if isinstance(infos, list) else [infos]
    return max(int(i["tp_size"]) for i in infos)


def _tail(name: str) -> str:
    for prefix in _DRAFT_PREFIXES:
        if name.startswith(prefix):
            rest = name[len(prefix):]
            return re.sub(r"^\d+\.", "", rest)
    return name


def with_fused_names(sent: set[str]) -> set[str]:
    """The sent names plus the fused names their parts make (what a served draft name may match by tail)."""
    return sent | {f for s in sent if (f := fused_name(s))}


def updated_roles(served: dict, roles: set[str]) -> list[str]:
    """The served roles a sync updates: those asked for, every draft runner when "draft" is."""
    return [r for r in served if r in roles or (r.startswith("draft") and "draft" in roles)]


def match_sent_name(served: str, sent: set[str], role: str, pool: set[str] | None = None) -> str | None:
    """The sent name (or fused name of sent parts) that writes `served`; None if none does.

    Target names match exactly (after fusing); a draft name may also match a sent MTP name by its tail,
    because SGLang's draft models drop the MTP layer prefix (`model.layers.61.enorm` -> `model.enorm`).
    """
    if served in sent:
        return served
    parts = stacked_parts(served) or sent_expert_parts(served, sent)
    if parts and all(p in sent for p in parts):
        return served
    if role == "target":
        return None
    tail = _tail(served)
    pool = with_fused_names(sent) if pool is None else pool  # callers matching many names pass it once
    candidates = sorted(n for n in pool if n == tail or n.endswith("." + tail))
    return candidates[0] if candidates else None


@dataclass
class Coverage:
    written: dict[str, int] = field(default_factory=dict)  # role -> served tensors written
    missing: dict[str, list[str]] = field(default_factory=dict)  # role -> served names nothing wrote

    @property
    def ok(self) -> bool:
        return not any(self.missing.values())


def check_coverage(served: dict[str, dict[str, str]], sent: set[str], roles: set[str]) -> Coverage:
    """Every served weight of the updated runners (`roles`: "target", and "draft" for a native MTP draft)."""
    cov, pool = Coverage(), with_fused_names(sent)
    for role in updated_roles(served, roles):
        names = served[role]
        missing = [n for n in sorted(names) if not _is_derived(n) and match_sent_name(n, sent, role, pool) is None]
        cov.written[role] = len(names) - len(missing)
        cov.missing[role] = missing
    return cov


def _is_derived(name: str) -> bool:
    return any(d in name for d in _DERIVED)


# Tensors SGLang may share from the target into an external draft (set_embed / set_embed_and_head).
SHAREABLE = ("embed_tokens.weight", "lm_head.weight")


def frozen_draft_checksums(served: dict[str, dict[str, str]]) -> dict[str, str]:
    """The draft runners' checksums (`role.name`) of the tensors that must not change in a sync: all but
    those shared with the target (a shareable name whose checksum equals the target's of the same name)."""
    target = served.get("target", {})
    return {f"{role}.{name}": c for role, names in served.items() if role != "target"
            for name, c in names.items() if not (name.endswith(SHAREABLE) and target.get(name) == c)}


def compare_checksums(served: dict[str, dict[str, str]], expected: dict[str, dict[str, str]],
                      roles: set[str]) -> list[str]:
    """Per updated runner, every served tensor the sync wrote whose checksum is not the one the sent tensors make
    (`expected`: role -> SGLang name -> checksum, sglang_params.ServedChecksums), one line each for the error;
    a tensor the sync wrote that the runner does not serve is reported too."""
    bad = []
    for role in updated_roles(served, roles):
        want = expected.get(role, expected.get("draft", {}) if role.startswith("draft") else {})
        for name, checksum in sorted(want.items()):
            got = served[role].get(name)
            if got is None:
                bad.append(f"{role}:{name} (written by the sync, not served by the engine's {role} runner)")
            elif got != checksum:
                bad.append(f"{role}:{name} (engine {got}, trainer {checksum})")
    return bad


def draft_tensors_written(served: dict[str, dict[str, str]], draft_sent: set[str]) -> dict[str, set[str]]:
    """Per draft runner (role): the sent draft tensors (checkpoint names) some served weight of it takes.

    A trained separate draft (EAGLE3) is sent under its checkpoint names; the engine may serve them fused
    (`qkv_proj`) or renamed (`midlayer` -> `model.layers.0`), which `match_sent_name` resolves by tail.
    """
    pool = with_fused_names(draft_sent)
    out: dict[str, set[str]] = {}
    for role in updated_roles(served, {"draft"}):
        taken = out.setdefault(role, set())
        for name in served[role]:
            source = match_sent_name(name, draft_sent, role, pool)
            if source is not None:
                taken.update(p for p in (stacked_parts(source) or [source]) if p in draft_sent)
    return out


def written_by_draft_sync(role_key: str, draft_sent: set[str]) -> bool:
    """Whether the served draft tensor `role.name` is one the draft sync writes."""
    m = _ROLE_KEY.match(role_key)
    role, name = (m.group(1), m.group(2)) if m else ("target", role_key)
    return role != "target" and match_sent_name(name, draft_sent, role) is not None
