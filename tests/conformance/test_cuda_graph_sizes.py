"""The embedded engine captures the decode batch sizes SGLang 0.5.23 would capture (its own list function)."""

from types import SimpleNamespace

import pytest

from slime_spec.engine.model_executor.cuda_graph import decode_batch_sizes

cuda_graph_hook = pytest.importorskip("sglang.srt.arg_groups.cuda_graph_hook")


@pytest.mark.parametrize("speculative_algorithm", [None, "EAGLE"])
@pytest.mark.parametrize("disable_padding", [False, True])
@pytest.mark.parametrize("max_bs", [1, 7, 32, 48, 160, 512, 600])
def test_decode_batch_sizes_match_sglang(speculative_algorithm, disable_padding, max_bs):
    server_args = SimpleNamespace(disable_cuda_graph_padding=disable_padding,
                                  speculative_algorithm=speculative_algorithm)
    expected = cuda_graph_hook.generate_decode_cuda_graph_batch_sizes(server_args, max_bs)
    assert decode_batch_sizes(max_bs, speculative_algorithm is not None, disable_padding) == expected
