"""The error a failed weight sync raises, with what each engine was verified to serve."""

from __future__ import annotations

from typing import Sequence

from slime_spec.common.errors import StructuredError
from slime_spec.weight_sync.verify import served_state


class WeightSyncError(StructuredError):
    """A sync failed; `engines_serve_previous_weights` says whether generation was resumed on old weights
    (every engine that answers was verified to serve them); `engines` says what each engine was verified to serve;
    `stuck_urls`: engines left stuck in a broken broadcast, which serve nothing until restarted."""

    def __init__(self, message: str, engines_serve_previous_weights: bool,
                 engines: Sequence[served_state.EngineVerdict] = (), stuck_urls: Sequence[str] = ()):
        super().__init__(message)
        self.engines_serve_previous_weights = engines_serve_previous_weights
        self.engines = list(engines)
        self.stuck_urls = list(stuck_urls)

    def metrics(self) -> dict:
        out = {"weight_sync_failed": 1, "weight_sync_resumed_on_previous": int(self.engines_serve_previous_weights)}
        for i, verdict in enumerate(self.engines):
            out.update(verdict.metrics(i))
        return out
