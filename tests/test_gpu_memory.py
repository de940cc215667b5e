"""Peak memory per GPU per step, read from NVML (here a test double of the three pynvml calls the monitor makes:
nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex, nvmlDeviceGetMemoryInfo(handle).used)."""

import types

from slime_spec.driver.gpu_memory import GIB, GpuMemoryMonitor


class FakeNvml:
    """Test double of pynvml: two GPUs whose `used` bytes the test sets."""

    def __init__(self):
        self.used = [0, 0]

    def nvmlDeviceGetCount(self):
        return len(self.used)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=self.used[handle])


def test_peaks_are_per_gpu_and_start_again_after_each_take():
    nvml = FakeNvml()
    monitor = GpuMemoryMonitor(nvml, interval_s=3600)  # no sample in between: take_peaks reads itself
    try:
        nvml.used = [3 * GIB, 1 * GIB]
        with monitor.lock:
            monitor.peaks = [5 * GIB, 0]  # a sample the thread took earlier in the step
        assert monitor.take_peaks() == {"gpu0_peak_memory_gib": 5.0, "gpu1_peak_memory_gib": 1.0}
        nvml.used = [2 * GIB, 4 * GIB]
        assert monitor.take_peaks() == {"gpu0_peak_memory_gib": 2.0, "gpu1_peak_memory_gib": 4.0}
    finally:
        monitor.close()


def test_no_monitor_without_nvml(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails as where nvidia-ml-py is not installed
    assert GpuMemoryMonitor.start_if_available() is None
