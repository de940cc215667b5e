"""Save and replay rollouts: `--save-debug-rollout-data` / `--load-debug-rollout-data`.

The path is a template with `{rollout_id}`, e.g. 'dir/rollout_{rollout_id}.pt'. A file holds
`{"rollout_id", "samples": [Sample.to_dict()], "metrics": {...}, "format_version"}` written by
torch.save, so a training run can replay exactly what an earlier rollout produced.
"""

from __future__ import annotations

from pathlib import Path

from slime_spec.rollout.sample import Sample

FORMAT_VERSION = 1


def debug_data_path(template: str, rollout_id: int) -> Path:
    if "{rollout_id}" not in template:
        raise ValueError(f"debug rollout data path {template!r} must contain '{{rollout_id}}', "
                         "e.g. 'dir/rollout_{rollout_id}.pt'")
    return Path(template.format(rollout_id=rollout_id))


def save_rollout(template: str, rollout_id: int, samples: list[Sample], metrics: dict | None = None) -> Path:
    path = debug_data_path(template, rollout_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format_version": FORMAT_VERSION, "rollout_id": rollout_id,
               "samples": [s.to_dict() for s in samples], "metrics": metrics or {}}
    import torch  # lazily: the rollout manager should not pay torch's import unless it saves

    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)  # never leave a half-written file under the real name
    return path


def load_rollout(template: str, rollout_id: int) -> list[Sample]:
    path = debug_data_path(template, rollout_id)
    if not path.is_file():
        raise FileNotFoundError(f"--load-debug-rollout-data: {path} does not exist (rollout {rollout_id}); "
                                "save it first with --save-debug-rollout-data")
    import torch

    payload = torch.load(path, weights_only=False)
    if payload.get("format_version") != FORMAT_VERSION or payload.get("rollout_id") != rollout_id:
        raise ValueError(f"{path}: not a slime-spec rollout file for rollout {rollout_id} "
                         f"(format {payload.get('format_version')}, rollout {payload.get('rollout_id')})")
    return [Sample.from_dict(d) for d in payload["samples"]]
