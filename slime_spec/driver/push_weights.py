"""`slime-spec push-weights`: push a checkpoint's weights into running engines, then (--check) read them back.

The weight-sync counterpart of `--debug-rollout-only`: no trainer, no Ray. The checkpoint's tensors
(target and MTP layers) go through the trainer's own sync code (`WeightSyncer`: selectors, buckets,
session, transports, coverage), so a push that works here works in training. With `--check` the
served values of a sample of tensors are read back and compared with the pushed ones
(weight_sync/verify/readback.py says which route is used for which engine, and the report names it).

Exit status: 0 when every engine took every bucket, serves every weight written, reports the pushed
`--weight-version` (read from `/model_info`, where SGLang reports the live version; its `/server_info` keeps
the startup configuration) and (with --check) serves the pushed values; 1 otherwise, with a report per
engine; 2 for bad flags.

    slime-spec push-weights --hf-checkpoint /ckpt/step_100_hf --engine-url http://10.0.0.5:30000 --check
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from slime_spec.config.flags import default as flag_default
from slime_spec.config.run_config import WeightSyncConfig
from slime_spec.fleet.client import EngineAuth, EngineClient, EngineError
from slime_spec.weight_sync.gather import NamedTensor, hf_mtp_matcher
from slime_spec.weight_sync.protocol import SpecSetup
from slime_spec.weight_sync.sync import SyncReport, WeightSyncer, WeightSyncError
from slime_spec.weight_sync.verify.served_state import weight_version_of


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slime-spec push-weights", description=__doc__.splitlines()[0])
    p.add_argument("--hf-checkpoint", required=True, help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--engine-url", action="append", required=True,
                   help="a running SGLang-compatible server, e.g. http://127.0.0.1:30000 (repeat for several)")
    p.add_argument("--transport", choices=("distributed", "tensor", "disk"), default="distributed",
                   help="distributed: a process group with the engines (they must reach --master-address); "
                        "tensor: serialized tensors over HTTP (engines on this host); disk: an HF checkpoint "
                        "the engines read from --disk-dir")
    p.add_argument("--check", action="store_true", help="read a sample of tensors back and compare values")
    p.add_argument("--check-sample", type=int, default=64, help="target tensors read back by name with --check")
    p.add_argument("--update-weight-buffer-size", type=int, default=flag_default("update_weight_buffer_size"),
                   help="bytes per update request, as in training")
    p.add_argument("--weight-version", default=None, help="the version the engines report after the push")
    p.add_argument("--api-key", default=None, help="the servers' --api-key")
    p.add_argument("--admin-api-key", default=None, help="the servers' --admin-api-key")
    p.add_argument("--master-address", default="127.0.0.1",
                   help="distributed: this host's address as the engines reach it")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                   help="distributed: default gloo for engines on device cpu, nccl otherwise")
    p.add_argument("--disk-dir", default=None, help="disk: directory every engine can read (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a process-group operation may wait")
    return p


def checkpoint_files(ckpt: Path) -> list[Path]:
    index = ckpt / "model.safetensors.index.json"
    if index.exists():
        return [ckpt / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"--hf-checkpoint {ckpt}: no *.safetensors files; point it at an HF checkpoint")
    return files


def iter_checkpoint(ckpt: Path, hf_config: dict) -> Iterator[NamedTensor]:
    """Every tensor of the checkpoint, one at a time (never the whole model), MTP layers marked."""
    from safetensors import safe_open

    is_mtp = hf_mtp_matcher(hf_config)
    for path in checkpoint_files(ckpt):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield NamedTensor(name, f.get_tensor(name).contiguous(), "mtp" if is_mtp(name) else "target")


def has_mtp_tensors(ckpt: Path, hf_config: dict) -> bool:
    from safetensors import safe_open

    is_mtp = hf_mtp_matcher(hf_config)
    for path in checkpoint_files(ckpt):
        with safe_open(str(path), framework="pt") as f:
            if any(is_mtp(n) for n in f.keys()):
                return True
    return False


def make_syncer(args, clients: list[EngineClient], hf_config: dict, ckpt: Path) -> WeightSyncer:
    info = clients[0].server_info()
    spec = SpecSetup.from_server_args(info, info.get("model_path"))
    backend = args.backend or ("gloo" if info.get("device") == "cpu" else "nccl")
    disk_dir = args.disk_dir or (tempfile.mkdtemp(prefix="slime-spec-push-") if args.transport == "disk" else None)
    config = WeightSyncConfig(weight_sync_transport=args.transport,
                              update_weight_buffer_size=args.update_weight_buffer_size, check_weight_sync=args.check)
    return WeightSyncer(clients, config, hf_config=hf_config, hf_checkpoint=ckpt, spec=spec,
                        has_mtp_layers=has_mtp_tensors(ckpt, hf_config), transport=args.transport,
                        master_address=args.master_address,
                        backend=backend,
                        engine_tp_size=int(info.get("tp_size") or 1), disk_dir=disk_dir, timeout_s=args.timeout,
                        check_sample=args.check_sample)


def check_weight_versions(clients: list[EngineClient], expected: str | None) -> dict[str, str | None]:
    """Each engine's weight version as it reports it (`/model_info`); a ValueError naming the engines that do not
    report `expected` (when given)."""
    versions = {c.url: weight_version_of(c) for c in clients}
    wrong = {url: v for url, v in versions.items() if expected is not None and v != expected}
    if wrong:
        raise ValueError(f"after the push these engines report another weight_version than --weight-version "
                         f"{expected!r} (/model_info): {wrong}")
    return versions


def report_lines(syncer: WeightSyncer, report: SyncReport | None, error: Exception | None,
                 versions: dict[str, str | None] | None = None) -> list[str]:
    """The per-engine report: what was pushed, what each engine serves, how values were checked."""
    lines = []
    if syncer.plan is not None:
        lines.append(f"protocol: session={syncer.protocol.session} (SGLang {syncer.protocol.version}); "
                     f"transport {syncer.transport_name}; selectors target={syncer.plan.target} "
                     f"mtp={syncer.plan.mtp} ({syncer.plan.reason})")
    if report is not None:
        lines.append(f"pushed {report.target_tensors} target + {report.mtp_tensors} MTP tensors, "
                     f"{report.bytes / 1e6:.1f} MB in {report.buckets} bucket(s), {report.transfer_seconds:.2f}s")
    checks = {c.url: c for c in syncer.last_value_checks}
    for client in syncer.clients:
        check = checks.get(client.url)
        if error is not None:
            state = "FAILED" if client.url in str(error) or len(syncer.clients) == 1 else "see error"
        else:
            state = "ok"
        line = f"engine {client.url}: {state}"
        if report is not None and error is None:
            line += f"; serves written: {report.served_written}"
        if versions and client.url in versions:
            line += f"; weight_version {versions[client.url]!r}"
        if check is not None:
            line += (f"; values checked by {' + '.join(check.methods) or 'no method'}: {check.compared} tensor(s), "
                     f"{len(check.problems)} problem(s)")
            line += "".join(f"\n    {p}" for p in check.problems[:20])
        elif syncer.config.check_weight_sync and error is None:
            line += "; values not checked"
        lines.append(line)
    if error is not None:
        lines.append(f"error: {error}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    ckpt = Path(args.hf_checkpoint)
    if not (ckpt / "config.json").exists():
        print(f"push-weights: --hf-checkpoint {ckpt} has no config.json; point it at an HF checkpoint directory",
              file=sys.stderr)
        return 2
    hf_config = json.loads((ckpt / "config.json").read_text())
    auth = EngineAuth(args.api_key, args.admin_api_key)
    clients = [EngineClient(url, auth) for url in args.engine_url]
    syncer, report, error, versions = None, None, None, None
    try:
        syncer = make_syncer(args, clients, hf_config, ckpt)
        report = syncer.sync_report(iter_checkpoint(ckpt, hf_config), weight_version=args.weight_version)
        versions = check_weight_versions(clients, args.weight_version)
    except (WeightSyncError, EngineError, ValueError, FileNotFoundError) as e:
        error = e
    finally:
        if syncer is not None:
            try:
                syncer.close()
            except Exception as close_error:  # reported, never hidden behind the push's own result
                error = error or close_error
        for c in clients:
            c.close()
    if syncer is None:
        print(f"push-weights: {error}", file=sys.stderr)
        return 1
    print("\n".join(report_lines(syncer, report, error, versions)))
    ok = error is None
    print("push-weights: OK" if ok else "push-weights: FAILED", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
