"""SGLang's own weight receiver, as one engine TP rank, in a process of its own.

Run as `python -m tests.conformance.sglang_receiver PLAN.json OUT.pt`. It joins the weight-update
group through SGLang's model-runner `WeightUpdater.init_weights_update_group` (which calls
`init_custom_process_group`), receives each bucket of the plan with
`WeightUpdater.receive_weights_from_distributed`, and saves what arrived to OUT.pt.
The engine's default process group (which SGLang asserts exists) is a one-rank gloo group here.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from tests.conformance import sglang_doubles


def main(plan_path: str, out_path: str) -> int:
    sglang_doubles.install()
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    plan = json.loads(open(plan_path).read())
    dist.init_process_group("gloo", init_method=f"file://{plan['default_group_file']}", rank=0, world_size=1)
    unused = None
    updater = WeightUpdater(tp_rank=plan["tp_rank"], device="cpu", gpu_id=0, model_config=unused,
                            custom_weight_loaders={}, get_model=lambda: unused,
                            update_model_fields=lambda *a, **k: None, recapture_cuda_graph=lambda: None,
                            get_model_runner=lambda: unused)
    ok, message = updater.init_weights_update_group(plan["master_address"], plan["master_port"], plan["rank_offset"],
                                                    plan["world_size"], plan["group_name"], backend="gloo")
    if not ok:
        print(message, file=sys.stderr)
        return 1
    received = {}
    for bucket in plan["buckets"]:
        received.update(updater.receive_weights_from_distributed(
            names=bucket["names"], dtypes=bucket["dtypes"], shapes=bucket["shapes"], group_name=plan["group_name"],
            load_format=bucket.get("load_format")))
    torch.save({n: t.clone() for n, t in received.items()}, out_path)  # a flattened bucket's are views of one
    ok, message = updater.destroy_weights_update_group(plan["group_name"])
    print(message)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
