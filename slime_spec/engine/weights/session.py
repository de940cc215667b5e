"""One weight-update session of the embedded engine (`/begin_weight_update` .. `/end_weight_update`): its selector,
its rollback snapshot, and the first error that failed it.

Before an update overwrites a served tensor, the session keeps a copy of it (once per session, in a
weight_receive.SnapshotStore: on the device while its free memory allows, else in reused host buffers). If any
update of the session fails, every tensor the session wrote is restored at once and the rest of the session is
refused, so the weights from before `begin` keep serving. A tensor several runners serve (MiMo's shared
embedding) is copied once per session, whichever selector reaches it first, so its rollback restores the value
from before `begin` for every runner. SGLang 0.5.23 keeps no such copy (its loaders write the parameters in
place and a failure answers "partially updated"); the copy is the embedded engine's own price.

Which tensors an update copies is decided once per update (`snapshot_for`, over all its names); each copy is
taken just before that tensor's first write (`UpdateSnapshot.take`), which counts its bytes, the one place
snapshot bytes are counted. Rollback and close share one cleanup and are idempotent.

Why no update skips the copy: a session spans many update requests (one per bucket), and a later bucket can be
refused (a wrong name, a lost trainer mid-broadcast) after earlier ones landed; only a copy taken before the first
write of each tensor can restore it. An update outside a session is already all or nothing without one: it is
validated in full before its first copy.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from slime_spec.engine.weights.receive import EngineTiming, SnapshotStore, device_snapshot_budget

Backup = dict[str, dict[str, torch.Tensor]]  # role -> name -> the tensor as it was before the session


def roles_of(selector: str) -> list[str]:
    if selector == "all":
        return ["target", "draft"]
    if selector in ("target", "draft"):
        return [selector]
    raise ValueError(f"invalid selector {selector!r}; expected 'target', 'draft', or 'all'")


def storage_key(tensor: torch.Tensor) -> tuple:
    """One key for one served tensor, however many runners serve it (MiMo's MTP runner shares the embedding)."""
    return tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype


class WeightSession:
    """The open session, if any. `snapshot_budget(device)` says how many snapshot bytes may stay on the device."""

    def __init__(self, device: str, snapshot_budget: Callable[[str], int] = device_snapshot_budget):
        self.device = device
        self.snapshot_budget = snapshot_budget
        self.selector: str | None = None  # None: no session is open
        self.error: str | None = None
        self.version_before: str | None = None
        self.restored = 0  # tensors this session's rollbacks restored
        self.backup: Backup = {}
        self.snapshots = SnapshotStore()  # the buffers `backup` points into
        self._copies: dict[tuple, torch.Tensor] = {}  # storage_key -> its copy: a shared tensor is copied once

    @property
    def open(self) -> bool:
        return self.selector is not None

    def begin(self, selector: str, weight_version: str) -> None:
        roles_of(selector)
        self.selector, self.error, self.version_before, self.restored = selector, None, weight_version, 0
        self.snapshots.begin_session(self.snapshot_budget(self.device))

    def snapshot_for(self, core, selector: str, names: Iterable[str], timing: EngineTiming) -> "UpdateSnapshot":
        """One update's part of the snapshot, decided once for all its names: the served tensors they reach
        that the session has not copied yet (the served tensors are looked up once per update too)."""
        wanted, pending = set(names), {}
        for role in roles_of(selector):
            weights, saved = core.named_weights(role), self.backup.get(role, {})
            for name in (wanted & weights.keys()) - saved.keys():
                pending.setdefault(name, []).append((role, weights[name]))
        return UpdateSnapshot(self, pending, timing)

    def rollback(self, core) -> int:
        """Restore every tensor the session wrote and drop the snapshot at once (its device copies go back to
        the driver now, not at end); returns the tensors the session's rollbacks restored. The session stays
        open: a failed one refuses the rest until it is closed. Idempotent: what was restored is not restored
        again."""
        for role in list(self.backup):
            saved = self.backup[role]
            if saved:
                core.load_weights(list(saved.items()), selector=role)
                self.restored += len(saved)
            del self.backup[role]  # restored: not again if a later role raises and the rollback is retried
        self._drop_snapshot()
        return self.restored

    def close(self, core=None) -> int:
        """End the session, the one way every session ends: `end_weight_update` (no `core`: what landed stays),
        `abort_weight_update` (with `core`: rolled back first). Returns the tensors the session's rollbacks
        restored, a failed update's included. Idempotent."""
        if core is not None:
            self.rollback(core)
        else:
            self._drop_snapshot()
        self.selector, self.error = None, None
        return self.restored

    def keep(self, role: str, name: str, tensor: torch.Tensor) -> bool | None:
        """Back up `name` of `role` before its first write: a storage already copied this session is shared, not
        copied again. Returns None when no new copy was made, else whether the new copy is on the device."""
        key, made = storage_key(tensor), None
        if key not in self._copies:
            self._copies[key], made = self.snapshots.copy_of(role, name, tensor)
        self.backup.setdefault(role, {})[name] = self._copies[key]
        return made

    def _drop_snapshot(self) -> None:
        self.backup, self._copies = {}, {}
        self.snapshots.end_session()


class UpdateSnapshot:
    """The copies one update must take (`WeightSession.snapshot_for`), each taken by `take(name)` before that
    tensor's first write. The one place snapshot bytes are counted: into the update's EngineTiming, by tier."""

    def __init__(self, session: WeightSession, pending: dict[str, list[tuple[str, torch.Tensor]]],
                 timing: EngineTiming):
        self.session, self.pending, self.timing = session, pending, timing

    def take(self, name: str) -> None:
        for role, tensor in self.pending.pop(name, ()):
            on_device = self.session.keep(role, name, tensor)
            if on_device is None:
                continue
            nbytes = tensor.numel() * tensor.element_size()
            if on_device:
                self.timing.snapshot_device_bytes += nbytes
            else:
                self.timing.snapshot_host_bytes += nbytes

    def take_all(self) -> None:
        for name in list(self.pending):
            self.take(name)
