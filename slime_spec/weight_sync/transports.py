"""How a bucket of HF-named tensors reaches the engines: distributed, tensor or disk.

A transport is `start()` (once per sync), `send(bucket, selector, weight_version)` per bucket,
`finish(weight_version)`, and `close()` at shutdown; the session (begin/end), pausing and
verification are the syncer's job (sync.py).

- distributed: the trainer's rank 0 and every engine form one process group through
  `/init_weights_update_group` (trainer = rank 0, engine i's TP rank r = rank_offset_i + r); per bucket
  every engine gets `/update_weights_from_distributed` (names, dtypes, shapes) while rank 0 broadcasts
  each tensor in that order. nccl on GPU, gloo on CPU.
- tensor (colocated): `/update_weights_from_tensor` with the named tensors serialized the way SGLang's
  MultiprocessingSerializer does (pickle, base64 over HTTP), one copy per engine TP rank.
- disk: the whole model written as an HF checkpoint (safetensors shards + index + the original
  config/tokenizer files), then `/update_weights_from_disk`. One request per sync, so all-or-nothing.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import shutil
import threading
from pathlib import Path
from typing import Sequence

import torch

from slime_spec.engines.client import EngineClient, post_all
from slime_spec.weight_sync import protocol
from slime_spec.weight_sync.gather import Bucket

HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model")


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the spelling SGLang's receiver feeds to getattr(torch, ...)."""
    return str(dtype).removeprefix("torch.")


class DistributedTransport:
    name = "distributed"

    def __init__(self, clients: Sequence[EngineClient], master_address: str, master_port: int, *,
                 backend: str = "gloo", group_name: str = "weight_update_group", engine_tp_size: int = 1,
                 session: bool = True, timeout_s: float = 300.0):
        self.clients, self.master_address, self.master_port = list(clients), master_address, int(master_port)
        self.backend, self.group_name, self.engine_tp_size = backend, group_name, int(engine_tp_size)
        self.session, self.timeout_s = session, timeout_s
        self.world_size = 1 + len(self.clients) * self.engine_tp_size
        self.group = None

    def start(self) -> None:
        self.connect()

    def finish(self, weight_version: str | None) -> None:
        pass

    def connect(self) -> None:
        """Form the group: every engine POSTs block until all ranks join, so rank 0 joins meanwhile."""
        from slime_spec.dist_group import WeightUpdateGroup

        if self.group is not None:
            return

        def payload(i: int) -> dict:
            return protocol.init_group_payload(self.master_address, self.master_port, 1 + i * self.engine_tp_size,
                                               self.world_size, self.group_name, self.backend)

        posts = BackgroundCall(lambda: post_all(self.clients, "/init_weights_update_group", payload))
        try:
            self.group = WeightUpdateGroup(self.master_address, self.master_port, rank=0,
                                           world_size=self.world_size, group_name=self.group_name,
                                           backend=self.backend, timeout_s=self.timeout_s)
        finally:
            posts.join()
        posts.result()

    def send(self, bucket: Bucket, selector: protocol.Selector, weight_version: str | None) -> None:
        tensors = [t.tensor.to("cuda") if self.backend == "nccl" else t.tensor for t in bucket.tensors]
        payload = protocol.distributed_payload(
            bucket.names, [dtype_name(t.dtype) for t in tensors], [list(t.shape) for t in tensors],
            group_name=self.group_name, selector=selector, weight_version=weight_version,
            flush_cache=False, session=self.session)
        posts = BackgroundCall(lambda: post_all(self.clients, "/update_weights_from_distributed", payload))
        try:
            for t in tensors:
                self.group.broadcast(t, src=0)
        finally:
            posts.join()
        posts.result()

    def close(self) -> None:
        """Leave the group on every engine; this side's group is dropped even if an engine fails to (a
        restarted engine has no group any more), and the engine error is raised after."""
        if self.group is None:
            return
        try:
            post_all(self.clients, "/destroy_weights_update_group", protocol.destroy_group_payload(self.group_name))
        finally:
            self.group.destroy()
            self.group = None


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's MultiprocessingSerializer(output_str=True) format: a pickle of [(name, tensor)], base64.

    CUDA tensors go through ForkingPickler (CUDA IPC handles, zero copy, as SGLang does); CPU tensors are
    pickled with their bytes inline, which any process can read (ForkingPickler's CPU path needs a
    shared-memory handshake between related processes).
    """
    buf = io.BytesIO()
    if any(t.is_cuda for _, t in named):
        import torch.multiprocessing  # noqa: F401  (registers the CUDA IPC reductions)
        from multiprocessing.reduction import ForkingPickler

        ForkingPickler(buf).dump(named)
    else:
        pickle.dump([(n, compact(t)) for n, t in named], buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def compact(t: torch.Tensor) -> torch.Tensor:
    """A tensor that owns exactly its bytes: pickling a view would carry its whole storage (e.g. a padded vocab)."""
    t = t.detach().contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
        t = t.clone()
    return t


class TensorTransport:
    name = "tensor"

    def __init__(self, clients: Sequence[EngineClient], *, engine_tp_size: int = 1, session: bool = True):
        self.clients, self.engine_tp_size, self.session = list(clients), int(engine_tp_size), session

    def start(self) -> None:
        pass

    def finish(self, weight_version: str | None) -> None:
        pass

    def send(self, bucket: Bucket, selector: protocol.Selector, weight_version: str | None) -> None:
        encoded = serialize_named_tensors([(t.name, t.tensor) for t in bucket.tensors])
        payload = protocol.tensor_payload([encoded] * self.engine_tp_size, selector=selector,
                                          weight_version=weight_version, flush_cache=False, session=self.session)
        post_all(self.clients, "/update_weights_from_tensor", payload)

    def close(self) -> None:
        pass


class DiskTransport:
    """Each bucket becomes a safetensors shard; `finish` writes the index and asks every engine to load it."""

    name = "disk"

    def __init__(self, clients: Sequence[EngineClient], out_dir: str | Path, hf_checkpoint: str | Path, *,
                 session: bool = True):
        self.clients, self.out_dir, self.hf_checkpoint = list(clients), Path(out_dir), Path(hf_checkpoint)
        self.session = session
        self._weight_map: dict[str, str] = {}

    def start(self) -> None:
        """A fresh checkpoint directory for this sync, with the original config and tokenizer files."""
        if not (self.hf_checkpoint / "config.json").exists():
            raise FileNotFoundError(f"--hf-checkpoint {self.hf_checkpoint} has no config.json to write next to "
                                    "the synced weights")
        if self.out_dir.exists():
            shutil.rmtree(self.out_dir)
        self.out_dir.mkdir(parents=True)
        for name in HF_SIDE_FILES:
            if (self.hf_checkpoint / name).exists():
                shutil.copy2(self.hf_checkpoint / name, self.out_dir / name)
        self._weight_map = {}

    def send(self, bucket: Bucket, selector: protocol.Selector, weight_version: str | None) -> None:
        from safetensors.torch import save_file

        file = f"model-{len(set(self._weight_map.values())):05d}.safetensors"
        # compact: split views of one fused tensor share storage, which safetensors refuses to write
        save_file({t.name: compact(t.tensor.cpu()) for t in bucket.tensors},
                  str(self.out_dir / file), metadata={"format": "pt"})
        self._weight_map.update({name: file for name in bucket.names})

    def finish(self, weight_version: str | None) -> None:
        index = {"metadata": {}, "weight_map": dict(sorted(self._weight_map.items()))}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        post_all(self.clients, "/update_weights_from_disk",
                 protocol.disk_payload(str(self.out_dir.resolve()), weight_version=weight_version,
                                       session=self.session))

    def close(self) -> None:
        pass


class BackgroundCall:
    """Run a call in a thread; `result()` re-raises its error. Used for POSTs that block on a collective."""

    def __init__(self, fn):
        self._result, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._result = fn()
        except BaseException as e:  # re-raised in result(), on the caller's thread
            self._error = e

    def join(self) -> None:
        self._thread.join()

    def result(self):
        if self._error is not None:
            raise self._error
        return self._result
