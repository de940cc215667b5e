"""Peak memory per GPU per step, read from NVML (here a test double of the three pynvml calls the monitor makes:
nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex, nvmlDeviceGetMemoryInfo(handle).used)."""

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

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


def test_a_window_reports_its_own_peak_with_the_next_take():
    nvml = FakeNvml()
    monitor = GpuMemoryMonitor(nvml, interval_s=3600)
    try:
        nvml.used = [6 * GIB, 0]
        monitor.take_peaks()
        nvml.used = [1 * GIB, 2 * GIB]
        with monitor.window("sync"):
            with monitor.lock:  # a sample the thread took inside the window
                monitor.peaks = [3 * GIB, 2 * GIB]
                monitor.open_windows["sync"] = [3 * GIB, 2 * GIB]
        nvml.used = [5 * GIB, 0]  # after the window: the step's peak, not the window's
        assert monitor.take_peaks() == {"gpu0_peak_memory_gib": 5.0, "gpu1_peak_memory_gib": 2.0,
                                        "gpu0_sync_peak_memory_gib": 3.0, "gpu1_sync_peak_memory_gib": 2.0}
        assert "gpu0_sync_peak_memory_gib" not in monitor.take_peaks()  # reported once
    finally:
        monitor.close()


def test_no_monitor_without_nvml(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails as where nvidia-ml-py is not installed
    assert GpuMemoryMonitor.start_if_available() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU machine)")
def test_engine_release_hands_its_memory_back_to_the_driver(tmp_path):
    """A colocated trainer gets the engine's memory only if the engine's caching allocator lets go of it: after
    release_memory the process reserves (almost) nothing of what the weights, KV cache and graphs took; resume then
    serves the same greedy tokens."""
    from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams
    from slime_spec.speculative.settings import SpecConfig
    from slime_spec.tools.tiny_model import make_tiny_model
    from tests.helpers.engine_runs import run_to_completion

    model = make_tiny_model(tmp_path / "m", arch="mimo", mtp_layers=1, hidden_size=256, num_layers=4,
                            max_position_embeddings=512)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    core = EngineCore(str(model), SpecConfig("EAGLE", 3, 1, 4), dtype="bfloat16", device="cuda",
                      max_running_requests=16)
    ids = core.tokenizer("release release")["input_ids"]

    def greedy(rid):
        return Request(rid, ids, SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True))

    before = run_to_completion(core, [greedy("a")])["a"].output_ids
    held = torch.cuda.memory_reserved() - base
    assert held > 16 * 2**20  # weights + KV cache + graph pools: enough that a leak would show
    core.release_memory(None)
    left = torch.cuda.memory_reserved() - base
    assert left < 0.1 * held, f"release kept {left / 2**20:.1f} MiB of {held / 2**20:.1f} MiB reserved"
    core.resume_memory(None)
    assert run_to_completion(core, [greedy("b")])["b"].output_ids == before


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("torch_memory_saver") is None,
                    reason="needs a CUDA device and torch_memory_saver (runs on the GPU machine)")
def test_memory_saver_release_keeps_the_graphs_and_frees_the_gpu():
    """With SGLang's memory saver, a release hands the weights', KV caches' and graphs' memory back to the driver
    and a resume maps it again at the same addresses: no graph is captured again, and greedy output after each
    resume equals the output before (bench/engine_memory_saver_gpu.py, plain and saver side by side)."""
    bench = Path(__file__).resolve().parents[1] / "bench" / "engine_memory_saver_gpu.py"
    out = subprocess.run([sys.executable, str(bench), "--size", "tiny", "--cycles", "2"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {cells[0]: cells for line in out.stdout.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}
    plain, saver = rows["plain"], rows["memory saver"]
    assert saver[6] == "no" and plain[6] == "yes", out.stdout  # graphs captured again
    assert saver[7] == "True" and plain[7] == "True", out.stdout  # greedy equal after resume
    assert float(saver[5]) > 0.5 * float(plain[5]) > 0, out.stdout  # GiB handed back to the driver
