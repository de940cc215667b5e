"""One weight-update session of the embedded engine (`/begin_weight_update` .. `/end_weight_update`): its selector,
its rollback snapshot, and the first error that failed it.

Before an update overwrites a served tensor, the session keeps a copy of it (once per session, in a
weight_receive.SnapshotStore: on the device while its free memory allows, else in reused host buffers). If any
update of the session fails, every tensor the session wrote is restored at once and the rest of the session is
refused, so the weights from before `begin` keep serving. SGLang 0.5.23 keeps no such copy (its loaders write
the parameters in place and a failure answers "partially updated"); the copy is the embedded engine's own price.

Why no update skips the copy: a session spans many update requests (one per bucket), and a later bucket can be
refused (a wrong name, a lost trainer mid-broadcast) after earlier ones landed; only a copy taken before the first
write of each tensor can restore it. An update outside a session is already all or nothing without one: it is
validated in full before its first copy.
"""

from __future__ import annotations

from typing import Callable

import torch

from slime_spec.engine.weight_receive import SnapshotStore, device_snapshot_budget

Backup = dict[str, dict[str, torch.Tensor]]  # role -> name -> the tensor as it was before the session


def roles_of(selector: str) -> list[str]:
    if selector == "all":
        return ["target", "draft"]
    if selector in ("target", "draft"):
        return [selector]
    raise ValueError(f"invalid selector {selector!r}; expected 'target', 'draft', or 'all'")


class WeightSession:
    """The open session, if any. `snapshot_budget(device)` says how many snapshot bytes may stay on the device."""

    def __init__(self, device: str, snapshot_budget: Callable[[str], int] = device_snapshot_budget):
        self.device = device
        self.snapshot_budget = snapshot_budget
        self.selector: str | None = None  # None: no session is open
        self.error: str | None = None
        self.version_before: str | None = None
        self.backup: Backup = {}
        self.snapshots = SnapshotStore()  # the buffers `backup` points into

    @property
    def open(self) -> bool:
        return self.selector is not None

    def begin(self, selector: str, weight_version: str) -> None:
        roles_of(selector)
        self.selector, self.error, self.version_before, self.backup = selector, None, weight_version, {}
        self.snapshots.begin_session(self.snapshot_budget(self.device))

    def close(self) -> None:
        self.selector, self.error, self.backup = None, None, {}
        self.snapshots.end_session()

    def snapshotter(self, core, selector: str) -> Callable[[set[str]], None]:
        """Keep, once per session, a copy of every served tensor named that `selector` reaches (the served
        tensors are looked up once per update, not once per tensor)."""
        served = {role: core.named_weights(role) for role in roles_of(selector)}
        copies: dict[tuple, torch.Tensor] = {}  # one copy of a tensor several runners serve (MiMo's embedding)

        def snapshot(names: set[str]) -> None:
            for role, weights in served.items():
                saved = self.backup.setdefault(role, {})
                for name in (names & weights.keys()) - saved.keys():  # one update's names, not every served one
                    tensor = weights[name]
                    key = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
                    if key not in copies:
                        copies[key] = self.snapshots.copy_of(role, name, tensor)
                    saved[name] = copies[key]
        return snapshot

    def snapshot_bytes(self) -> tuple[int, int]:
        """(device, host) bytes this session has copied so far."""
        return self.snapshots.device_bytes, self.snapshots.host_bytes

    def rollback(self, core) -> int:
        """Restore every tensor the session wrote; returns how many. The device copies are dropped after."""
        restored = 0
        for role, saved in self.backup.items():
            if saved:
                core.load_weights(list(saved.items()), selector=role)
                restored += len(saved)
        self.backup = {}
        self.snapshots.end_session()
        return restored
