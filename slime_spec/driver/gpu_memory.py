"""Peak memory per GPU over each step of a run, read from NVML by the driver.

NVML counts what every process holds on a GPU (trainer, engines, the speed-up measurement's engines, CUDA contexts):
the number that decides whether a colocated layout fits. A thread samples every `interval_s`; `take_peaks()` returns
the largest reading per GPU since the previous call. Without NVML (a CPU machine, or no nvidia-ml-py) there is no
monitor and the run reports no GPU memory.
"""

from __future__ import annotations

import threading

GIB = 2**30


class GpuMemoryMonitor:
    def __init__(self, nvml, interval_s: float = 0.05):
        self.nvml, self.interval_s = nvml, interval_s
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        self.peaks = [0] * len(self.handles)
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
                self.peaks = [max(p, u) for p, u in zip(self.peaks, used)]

    def take_peaks(self) -> dict[str, float]:
        """{"gpu{i}_peak_memory_gib": ...} since the last call (read now too, so a short step is not missed)."""
        used = self._used()
        with self.lock:
            peaks = [max(p, u) for p, u in zip(self.peaks, used)]
            self.peaks = [0] * len(self.handles)
        return {f"gpu{i}_peak_memory_gib": p / GIB for i, p in enumerate(peaks)}

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)
