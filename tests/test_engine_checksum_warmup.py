"""SGLang's checksum kernels compiled at engine start (engine/weights/checker.py `warm_checksum_kernels`), so the
first `/weights_checker` of a sync does not pay the Triton compile; a failure to compile is logged, not fatal."""

import logging
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from slime_spec.engine.managers.scheduler_process import EmbeddedScheduler
from slime_spec.engine.weights.checker import warm_checksum_kernels


def test_nothing_to_compile_on_cpu():
    assert warm_checksum_kernels(torch.device("cpu")) == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU machine)")
def test_after_the_warm_up_sglangs_hash_of_a_cuda_weight_is_its_hash_before():
    from sglang.srt.managers.mm_utils import tensor_hash

    weight = torch.randn(1000, 1000, dtype=torch.bfloat16, device="cuda")  # 62.5 tiles of 8192 words
    assert warm_checksum_kernels(weight.device) > 0
    assert tensor_hash(weight) == tensor_hash(weight.clone())
    assert tensor_hash(weight) != tensor_hash(weight + 1)


def scheduler_whose_call_gives(outcome):
    fut = Future()
    fut.set_exception(outcome) if isinstance(outcome, Exception) else fut.set_result(outcome)
    return SimpleNamespace(loop=SimpleNamespace(call=lambda fn, label: fut))


def test_a_failed_warm_up_is_logged_and_the_engine_starts(caplog):
    with caplog.at_level(logging.INFO):
        EmbeddedScheduler._warm_checksum_kernels(scheduler_whose_call_gives(ImportError("no triton")))
    assert "not compiled at start (ImportError: no triton)" in caplog.text


def test_the_warm_up_says_how_long_it_took(caplog):
    with caplog.at_level(logging.INFO):
        EmbeddedScheduler._warm_checksum_kernels(scheduler_whose_call_gives(6.5))
    assert "checksum kernels compiled in 6.50 s" in caplog.text
