"""Peak memory per GPU over each step of a run, read from NVML by the driver.

NVML counts what every process holds on a GPU (trainer, engines, the speed-up measurement's engines, CUDA contexts):
the number that decides whether a colocated layout fits. A thread samples every `interval_s`; `take_peaks()` returns
the largest reading per GPU since the previous call, and for each `window(name)` closed since then, the largest
reading while it was open (`gpu{i}_{name}_peak_memory_gib`: the loop opens one around each sync). Without NVML (a
CPU machine, or no nvidia-ml-py) there is no monitor and the run reports no GPU memory.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

GIB = 2**30


class GpuMemoryMonitor:
    def __init__(self, nvml, interval_s: float = 0.05):
        self.nvml, self.interval_s = nvml, interval_s
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        self.peaks = [0] * len(self.handles)
        self.open_windows: dict[str, list[int]] = {}
        self.closed_windows: dict[str, list[int]] = {}
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._sample_until_stopped, name="gpu-memory", daemon=True)
        self.thread.start()

    @classmethod
    def start_if_available(cls, interval_s: float = 0.05) -> "GpuMemoryMonitor | None":
        """A running monitor, or None where NVML is not importable or sees no GPU."""
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # no nvidia-ml-py, or no driver: nothing to monitor
            return None
        if pynvml.nvmlDeviceGetCount() == 0:
            return None
        return cls(pynvml, interval_s)

    def _used(self) -> list[int]:
        return [self.nvml.nvmlDeviceGetMemoryInfo(h).used for h in self.handles]

    def _sample_until_stopped(self) -> None:
        while not self.stopped.wait(self.interval_s):
            used = self._used()
            with self.lock:
                self.peaks = _max(self.peaks, used)
                for name, peaks in self.open_windows.items():
                    self.open_windows[name] = _max(peaks, used)

    @contextlib.contextmanager
    def window(self, name: str) -> Iterator[None]:
        """Peak per GPU while the block runs; the next `take_peaks` reports it as gpu{i}_{name}_peak_memory_gib."""
        used = self._used()
        with self.lock:
            self.open_windows[name] = used
        try:
            yield
        finally:
            used = self._used()
            with self.lock:
                self.closed_windows[name] = _max(self.open_windows.pop(name), used)

    def take_peaks(self) -> dict[str, float]:
        """{"gpu{i}_peak_memory_gib": ...} since the last call (read now too, so a short step is not missed)."""
        used = self._used()
        with self.lock:
            peaks = _max(self.peaks, used)
            self.peaks = [0] * len(self.handles)
            windows, self.closed_windows = self.closed_windows, {}
        out = {f"gpu{i}_peak_memory_gib": p / GIB for i, p in enumerate(peaks)}
        for name, window in windows.items():
            out.update({f"gpu{i}_{name}_peak_memory_gib": p / GIB for i, p in enumerate(window)})
        return out

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)


def _max(a: list[int], b: list[int]) -> list[int]:
    return [max(x, y) for x, y in zip(a, b)]
