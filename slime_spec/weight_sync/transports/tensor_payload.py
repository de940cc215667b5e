"""Tensors as SGLang's `/update_weights_from_tensor` reads them: entries of `serialized_named_tensors`.

Each entry is what SGLang's `MultiprocessingSerializer.deserialize` reads (pickle, base64 over HTTP), one per
engine TP rank, each serialized on its own (a CUDA IPC handle is opened by one reader only): a CUDA tensor as an
IPC handle naming its device by UUID, a CPU tensor as its bytes. A bucket is sent as it is or flattened into one
uint8 tensor with SGLang's own `FlattenedTensorMetadata` (`load_format: "flattened_bucket"`). The tensor
transport (weight_sync/transports/http_transports.py) and every colocated trainer rank
(weight_sync/transports/colocated.py) make their entries here.
"""

from __future__ import annotations

import base64
import io
import pickle

import torch


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """One TP rank's entry of `serialized_named_tensors`: what SGLang's MultiprocessingSerializer.deserialize
    (its SafeUnpickler) reads back, a pickle of [(name, tensor)] in base64.

    CPU tensors are pickled with their bytes inline, which any process can read (torch's shared-memory
    CPU path needs a file-descriptor handshake between related processes). CUDA tensors travel as CUDA
    IPC handles, zero copy, naming the device by UUID as SGLang's `monkey_patch_torch_reductions` does
    on both sides, so the engine opens the handle on its own GPU whatever its device numbering. The
    caller must keep the tensors alive until the engine has replied (the engine copies from them).
    """
    buf = io.BytesIO()
    if any(t.is_cuda for _, t in named):
        cuda_ipc_pickler(buf).dump([(n, t.detach()) for n, t in named])
    else:
        pickle.dump([(n, compact(t)) for n, t in named], buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_for_tp_ranks(named: list[tuple[str, torch.Tensor]], tp_size: int) -> list[str]:
    """`serialized_named_tensors` for one engine: entry r is TP rank r's, and each rank reads only its own.

    Every entry is serialized on its own: a CUDA IPC handle is reference-counted per deserialization,
    so ranks must not share one (SGLang's tp_worker.deserialize_own_rank says the same).
    """
    if tp_size < 1:
        raise ValueError(f"engine tp size must be >= 1, got {tp_size}: pass the engines' --tp-size")
    return [serialize_named_tensors(named) for _ in range(tp_size)]


def _reduce_cuda_tensor_by_uuid(tensor: torch.Tensor):
    """torch's CUDA IPC reduction with the device index replaced by the device UUID (argument 6 of
    `rebuild_cuda_tensor`), the form SGLang's patched `rebuild_cuda_tensor` maps back to a local device."""
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        device = args[CUDA_DEVICE_ARG]
        args = (*args[:CUDA_DEVICE_ARG], str(torch.cuda.get_device_properties(device).uuid),
                *args[CUDA_DEVICE_ARG + 1:])
    return rebuild, args


CUDA_DEVICE_ARG = 6  # position of the device index in rebuild_cuda_tensor's arguments (torch 2.x)


def cuda_ipc_pickler(buf: io.BytesIO):
    """A ForkingPickler whose tensor reduction names devices by UUID; torch's global reductions stay as they are."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

    pickler = ForkingPickler(buf)
    pickler.dispatch_table = {**pickler.dispatch_table, torch.Tensor: _reduce_cuda_tensor_by_uuid,
                              torch.nn.Parameter: _reduce_cuda_tensor_by_uuid}
    return pickler


def compact(t: torch.Tensor) -> torch.Tensor:
    """A tensor that owns exactly its bytes: pickling a view would carry its whole storage (e.g. a padded vocab)."""
    t = t.detach().contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
        t = t.clone()
    return t


FLATTENED_BUCKET = "flattened_bucket"


def flatten_bucket(named: list[tuple[str, torch.Tensor]]) -> dict:
    """The `{"flattened_tensor", "metadata"}` object SGLang's `_update_weights_from_flattened_bucket` reads: every
    tensor's bytes in one uint8 tensor on their device, and SGLang's own FlattenedTensorMetadata per tensor.

    Wider dtypes come first, so every tensor starts at a multiple of its element size (the receiver views each
    byte range as its dtype, which needs that alignment); the order of names does not matter to a load.
    """
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    if not named:
        raise ValueError("cannot flatten an empty bucket")
    ordered = sorted(named, key=lambda nt: -nt[1].element_size())
    parts, metadata, offset = [], [], 0
    for name, t in ordered:
        flat = t.detach().reshape(-1).view(torch.uint8)
        metadata.append(FlattenedTensorMetadata(name=name, shape=t.shape, dtype=t.dtype, start_idx=offset,
                                                end_idx=offset + flat.numel(), numel=flat.numel()))
        parts.append(flat)
        offset += flat.numel()
    return {"flattened_tensor": torch.cat(parts), "metadata": metadata}


def serialize_flattened(obj: dict, tp_size: int) -> list[str]:
    """`serialized_named_tensors` of one flattened bucket, one entry per engine TP rank (each its own handle)."""
    if tp_size < 1:
        raise ValueError(f"engine tp size must be >= 1, got {tp_size}: pass the engines' --tp-size")
    return [_serialize(obj, obj["flattened_tensor"].is_cuda) for _ in range(tp_size)]


def stage_bucket(named: list[tuple[str, torch.Tensor]], flatten: bool):
    """What an engine reads out of this process for one bucket: the bucket flattened into one tensor (one device
    copy here, one IPC handle there) or the tensors as they are. The engine reads from another process, so on
    CUDA the bytes are written (device sync) before this returns. Keep it alive until the engines have replied."""
    staged = flatten_bucket(named) if flatten else named
    cuda = next((t.device for _, t in named if t.is_cuda), None)
    if cuda is not None:
        torch.cuda.synchronize(cuda)
    return staged


def serialize_bucket(staged, flatten: bool, count: int) -> list[str]:
    """`count` entries of `serialized_named_tensors` of a staged bucket, each serialized on its own (a CUDA IPC
    handle is opened by one reader only): one per engine TP rank, or one for this trainer rank's own entry."""
    return serialize_flattened(staged, count) if flatten else serialize_for_tp_ranks(staged, count)


def _serialize(obj, cuda: bool) -> str:
    buf = io.BytesIO()
    if cuda:
        cuda_ipc_pickler(buf).dump(obj)
    else:
        pickle.dump(obj, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")
