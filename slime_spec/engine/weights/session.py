"""One weight-update session of the embedded engine (`/begin_weight_update` .. `/end_weight_update`): its selector,
its rollback snapshot, and the first error that failed it.

Before an update overwrites a served tensor, the session holds its value from before `begin` (once per session):
a host buffer of the engine's HostMirror (engine/weights/mirror.py), which already equals what is served unless
this is the first sync or the tensor was written outside a session, in which case it is copied there just
before the write. If any update of the session fails, every tensor the session wrote is restored at once and the
rest of the session is refused, so the weights from before `begin` keep serving. A tensor several runners serve
(MiMo's shared embedding) is held once per session, whichever selector reaches it first, so its rollback restores
the value from before `begin` for every runner. When a session ends with its updates kept, the tensors it wrote
are copied to the mirror in the background, ready for the next session. SGLang 0.5.23 keeps no such copy (its
loaders write the parameters in place and a failure answers "partially updated"); the mirror is the embedded
engine's own price: host memory, no device memory.

Which tensors an update needs is decided once per update (`snapshot_for`, over all its names); each is taken just
before that tensor's first write (`UpdateSnapshot.take`), which counts the bytes copied on the sync's path and
those the mirror already held. Rollback and close share one cleanup and are idempotent.

Why no update goes without: a session spans many update requests (one per bucket), and a later bucket can be
refused (a wrong name, a lost trainer mid-broadcast) after earlier ones landed; only a value held from before the
first write of each tensor can restore it. An update outside a session is already all or nothing without one: it
is validated in full before its first copy.
"""

from __future__ import annotations

from typing import Iterable

import torch

from slime_spec.engine.model_executor.pinned_weights import PinnedWeightCopy
from slime_spec.engine.weights.mirror import HostMirror, storage_key
from slime_spec.engine.weights.receive import EngineTiming

Backup = dict[str, dict[str, torch.Tensor]]  # role -> name -> the tensor as it was before the session
ROLES = ("target", "draft")


def roles_of(selector: str) -> list[str]:
    if selector == "all":
        return list(ROLES)
    if selector in ROLES:
        return [selector]
    raise ValueError(f"invalid selector {selector!r}; expected 'target', 'draft', or 'all'")


class WeightSession:
    """The open session, if any, and the engine's host mirror of what it serves (kept across sessions)."""

    def __init__(self, device: str, served=None, host: PinnedWeightCopy | None = None):
        """served(core, role, names): those names' served tensors, as core.named_weights(role) has them (the engine
        passes a look-up that walks the model once per session: weight_updater.served_weights_named). host: the
        memory release's pinned copy of the weights, which the mirror shares (with the memory saver)."""
        self.device = device
        self.served = served or _named_weights_of
        self.selector: str | None = None  # None: no session is open
        self.error: str | None = None
        self.version_before: str | None = None
        self.restored = 0  # tensors this session's rollbacks restored
        self.backup: Backup = {}
        self.mirror = HostMirror(host)  # the buffers `backup` points into
        self._copies: dict[tuple, torch.Tensor] = {}  # storage_key -> its value before begin: a shared tensor once

    @property
    def open(self) -> bool:
        return self.selector is not None

    def begin(self, selector: str, weight_version: str) -> None:
        roles_of(selector)
        self.mirror.wait()  # the last session's background copies: the next writes must come after them
        self.selector, self.error, self.version_before, self.restored = selector, None, weight_version, 0

    def snapshot_for(self, core, selector: str, names: Iterable[str], timing: EngineTiming) -> "UpdateSnapshot":
        """One update's part of the snapshot, decided once for all its names: the served tensors they reach
        that the session does not hold yet (the served tensors are looked up once per update too)."""
        wanted, pending = set(names), {}
        for role in roles_of(selector):
            saved = self.backup.get(role, {})
            for name, tensor in self.served(core, role, wanted - saved.keys()).items():
                pending.setdefault(name, []).append((role, tensor))
        return UpdateSnapshot(self, pending, timing)

    def rollback(self, core) -> int:
        """Restore every tensor the session wrote and drop the session's hold on them; returns the tensors the
        session's rollbacks restored. The session stays open: a failed one refuses the rest until it is closed.
        Idempotent: what was restored is not restored again. The mirror stays fresh: it holds what is served."""
        for role in list(self.backup):
            saved = self.backup[role]
            if saved:
                core.load_weights(list(saved.items()), selector=role)
                self.restored += len(saved)
            del self.backup[role]  # restored: not again if a later role raises and the rollback is retried
        self._copies = {}
        return self.restored

    def close(self, core=None, *, kept_core=None) -> int:
        """End the session, the one way every session ends: `end_weight_update` (`kept_core`: what landed stays,
        and is copied to the mirror in the background), `abort_weight_update` (`core`: rolled back first). Returns
        the tensors the session's rollbacks restored, a failed update's included. Idempotent."""
        if core is not None:
            self.rollback(core)
        elif kept_core is not None and self._copies:
            self.mirror.refresh(self._written(kept_core))
        self.backup, self._copies = {}, {}
        self.selector, self.error = None, None
        return self.restored

    def keep(self, role: str, name: str, tensor: torch.Tensor) -> tuple[int, int]:
        """Hold `name` of `role` before its first write (a storage held already this session is shared). Returns
        (bytes copied now, bytes the mirror already held)."""
        key, nbytes = storage_key(tensor), tensor.numel() * tensor.element_size()
        held = key in self._copies
        if not held:
            self._copies[key], copied = self.mirror.backup_of((role, name), tensor)
        self.backup.setdefault(role, {})[name] = self._copies[key]
        if held:
            return 0, 0
        return (nbytes, 0) if copied else (0, nbytes)

    def _written(self, core) -> list[tuple[tuple[str, str], torch.Tensor]]:
        """Every (role, name) whose storage this session wrote, whichever runner's name reached it."""
        return [((role, name), t) for role in ROLES for name, t in core.named_weights(role).items()
                if storage_key(t) in self._copies]


def _named_weights_of(core, role: str, names) -> dict[str, torch.Tensor]:
    weights = core.named_weights(role)
    return {n: weights[n] for n in names if n in weights}


class UpdateSnapshot:
    """The tensors one update must hold (`WeightSession.snapshot_for`), each taken by `take(name)` before that
    tensor's first write. The one place snapshot bytes are counted: into the update's EngineTiming."""

    def __init__(self, session: WeightSession, pending: dict[str, list[tuple[str, torch.Tensor]]],
                 timing: EngineTiming):
        self.session, self.pending, self.timing = session, pending, timing

    def take(self, name: str) -> None:
        for role, tensor in self.pending.pop(name, ()):
            copied, mirrored = self.session.keep(role, name, tensor)
            self.timing.snapshot_copied_bytes += copied
            self.timing.snapshot_mirrored_bytes += mirrored

    def take_all(self) -> None:
        for name in list(self.pending):
            self.take(name)
