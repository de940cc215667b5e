"""Did the sync write every weight the engine serves, and are the served values the trainer's?

Coverage reads the engine's own list of served weights: `/weights_checker {"action": "checksum"}`
returns, per TP rank, a checksum for every parameter and buffer of every selected runner (target
keys unprefixed, draft keys prefixed with the runner's role, e.g. `draft.`), in the engine's
internal names: SGLang fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, and its MTP draft
models rename the MTP block (`model.layers.{N}.enorm` -> `model.enorm`, ...). A served name is
covered when some sent tensor maps onto it.

Checksums computed here from the very tensors that were sent, in the engine's dtype, match an engine
that hashes on CPU: SGLang's CPU `tensor_hash` is the first 8 bytes of a sha256 of the raw bytes, so a
fused parameter hashes as the concatenation of its parts in stacked order. On GPU SGLang hashes with a
Triton kernel; readback.py decides which value check applies to which engine.

An external draft must keep its own weights, except those SGLang shares with the target: an EAGLE3
draft uses the target's embedding (and, per model, its lm_head), so those follow every target update.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

import torch

# (fused name, parts in the order they are stacked), as SGLang's models declare stacked_params_mapping
STACKED = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))
# Prefixes SGLang's MTP draft models put in front of a layer's own names.
_DRAFT_PREFIXES = ("model.decoder.", "model.mtp_block.", "model.mtp_layers.", "model.layers.", "model.")
_ROLE_KEY = re.compile(r"^(draft[\w]*)\.(.+)$")
# Buffers a checksum lists but a sync never writes (derived from the config, not trained).
_DERIVED = ("rotary_emb", "inv_freq", "cos_sin_cache")


def fused_name(name: str) -> str | None:
    """`...self_attn.q_proj.weight` -> `...self_attn.qkv_proj.weight`; None if the name is not a stacked part."""
    for fused, parts in STACKED:
        for part in parts:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}.")
    return None


def stacked_parts(name: str) -> list[str] | None:
    """The part names, in stacked order, of a fused name; None if it is not fused."""
    for fused, parts in STACKED:
        if f".{fused}." in name:
            return [name.replace(f".{fused}.", f".{p}.") for p in parts]
    return None


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
    parts = stacked_parts(served)
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


def tensor_checksum(tensors: list[torch.Tensor]) -> str:
    """SGLang's CPU `tensor_hash` of the concatenation of `tensors` (one tensor, or a fused param's parts)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return f"{int.from_bytes(h.digest()[:8], 'big', signed=False):016x}"


class ChecksumRecorder:
    """Checksums of the sent tensors, in the engine's dtype, computed while they stream past.

    Parts of a fused parameter are held until all of them arrived (one layer's q/k/v at most), so the
    recorder never keeps a copy of the model.
    """

    def __init__(self, engine_dtype: torch.dtype | None):
        self.engine_dtype = engine_dtype
        self.checksums: dict[str, str] = {}
        # of the engine-dtype values as float32: what /get_weights_by_name returns
        self.float32_checksums: dict[str, str] = {}
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().cpu()
        if self.engine_dtype is not None:
            t = t.to(self.engine_dtype)
        self.checksums[name] = tensor_checksum([t])
        self.float32_checksums[name] = tensor_checksum([t.float()])
        fused = fused_name(name)
        if fused is None:
            return
        pending = self._pending.setdefault(fused, {})
        pending[name] = t
        parts = stacked_parts(fused)
        if all(p in pending for p in parts):
            self.checksums[fused] = tensor_checksum([pending[p] for p in parts])
            del self._pending[fused]


def compare_checksums(served: dict[str, dict[str, str]], expected: dict[str, str], roles: set[str]) -> list[str]:
    """Names whose served checksum differs from the sent tensor's (one line each, for the error)."""
    sent = set(expected)
    bad, pool = [], with_fused_names(sent)
    for role in updated_roles(served, roles):
        for name, checksum in sorted(served[role].items()):
            source = match_sent_name(name, sent, role, pool)
            if source is not None and expected[source] != checksum:
                bad.append(f"{role}:{name} (engine {checksum}, trainer {expected[source]} from {source})")
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
