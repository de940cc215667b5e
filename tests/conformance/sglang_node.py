"""SGLang's own launch-argument resolution on a faked 8 x H100 80GB node, in a process of its own.

Run as `python -m tests.conformance.sglang_node IN.json OUT.json`: IN holds a list of server argvs
(`python -m sglang.launch_server ...`); each goes through `prepare_server_args(argv[3:])` and
`ServerArgs.resolve_once()`, as `sglang.launch_server` does. OUT gets, per argv, the resolved fields
we check or the error SGLang raised.

The node is a test double: torch.cuda answers as 8 H100s (SGLang reads device count, capability,
memory and name to pick defaults). It runs in its own process because SGLang caches what it learns
about the platform in module globals at import time; the patched answers must not leak into other tests.
"""

from __future__ import annotations

import json
import sys
from unittest import mock

from tests.conformance import sglang_doubles

GPUS, GPU_BYTES, GPU_NAME = 8, 80 * 1024**3, "NVIDIA H100 80GB HBM3"
RESOLVED_FIELDS = ("tp_size", "pp_size", "dp_size", "random_seed", "base_gpu_id", "trust_remote_code",
                   "speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
                   "speculative_eagle_topk", "speculative_num_draft_tokens", "speculative_adaptive",
                   "attention_backend",
                   "mem_fraction_static", "max_running_requests", "dtype", "host", "port", "model_path")


def fake_h100_node() -> list:
    """Patches that make torch.cuda describe 8 x H100 80GB (a test double for the GPU node)."""
    props = mock.Mock(name="cuda_device_properties", total_memory=GPU_BYTES, major=9, minor=0,
                      multi_processor_count=132, uuid="GPU-00000000-0000-0000-0000-000000000000")
    props.name = GPU_NAME
    cuda = "torch.cuda."
    return [mock.patch(cuda + "is_available", return_value=True),
            mock.patch(cuda + "device_count", return_value=GPUS),
            mock.patch(cuda + "get_device_properties", return_value=props),
            mock.patch(cuda + "get_device_capability", return_value=(9, 0)),
            mock.patch(cuda + "get_device_name", return_value=GPU_NAME),
            mock.patch(cuda + "mem_get_info", return_value=(GPU_BYTES - 2**30, GPU_BYTES))]


def resolve(argv: list[str]) -> dict:
    from sglang.srt.server_args import prepare_server_args

    if argv[1:3] != ["-m", "sglang.launch_server"]:
        return {"error": f"not an SGLang launch: {argv[:3]}"}
    try:
        args = prepare_server_args(argv[3:])
        args.resolve_once()
    except BaseException as e:  # reported to the test, which fails with SGLang's own message
        return {"error": f"{type(e).__name__}: {e}"}
    return {name: getattr(args, name) for name in RESOLVED_FIELDS}


def main(in_path: str, out_path: str) -> int:
    sglang_doubles.install()
    for patch in fake_h100_node():
        patch.start()
    argvs = json.loads(open(in_path).read())
    results = [resolve(argv) for argv in argvs]
    open(out_path, "w").write(json.dumps(results, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
