"""Least-loaded routing with a per-engine in-flight cap (`--sglang-server-concurrency`)."""

from __future__ import annotations

import asyncio


class NoEngineAvailable(RuntimeError):
    pass


def pick_engine(in_flight: list[int], available: list[bool], cap: int) -> int | None:
    """The available engine with the fewest in-flight requests below `cap` (lowest index on ties), or None."""
    candidates = [i for i, (n, ok) in enumerate(zip(in_flight, available)) if ok and n < cap]
    return min(candidates, key=lambda i: in_flight[i]) if candidates else None


class Router:
    def __init__(self, num_engines: int, max_concurrency: int):
        if max_concurrency < 1:
            raise ValueError(f"--sglang-server-concurrency={max_concurrency}: must be >= 1")
        self.cap = max_concurrency
        self.in_flight = [0] * num_engines
        self.available = [True] * num_engines
        self.dead = [False] * num_engines  # could not be restarted: never used again
        self._cond = asyncio.Condition()

    async def acquire(self) -> int:
        async with self._cond:
            while True:
                if all(self.dead):
                    raise NoEngineAvailable("every rollout engine is down and could not be restarted; "
                                            "see the engine logs and run `slime-spec doctor`")
                idx = pick_engine(self.in_flight, self.available, self.cap)
                if idx is not None:
                    self.in_flight[idx] += 1
                    return idx
                await self._cond.wait()

    async def release(self, idx: int) -> None:
        async with self._cond:
            self.in_flight[idx] -= 1
            self._cond.notify(1)  # one slot freed: wake one waiter, not all (no thundering herd)

    async def set_available(self, idx: int, ok: bool, dead: bool = False) -> None:
        async with self._cond:
            self.available[idx] = ok and not dead
            self.dead[idx] = dead
            self._cond.notify_all()
