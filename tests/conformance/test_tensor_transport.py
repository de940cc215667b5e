"""What our tensor transport sends, read back by SGLang 0.5.23's own code, one TP rank at a time.

Each engine's body goes through SGLang's `UpdateWeightsFromTensorReqInput` (base64 -> bytes), then each
TP rank runs SGLang's `TpModelWorker.deserialize_own_rank` (monkey_patch_torch_reductions +
MultiprocessingSerializer/SafeUnpickler on its own entry) with its parallel state a test double
naming the rank; a flattened bucket is then rebuilt as SGLang's
`WeightUpdater._update_weights_from_flattened_bucket` does, with SGLang's own FlattenedTensorBucket.
On CPU the tensors travel inline; the CUDA tests run only where a GPU is present.
"""

from __future__ import annotations

import types
from unittest import mock

import pytest
import torch

from slime_spec.weight_sync.gather import Bucket, NamedTensor
from slime_spec.weight_sync.transports.http_transports import TensorTransport
from slime_spec.weight_sync.transports.tensor_payload import serialize_for_tp_ranks
from tests.conformance.sglang_io import build


class RecordingClient:
    """An engine that records each body and replies success (test double for the HTTP hop)."""

    def __init__(self, url: str):
        self.url, self.bodies = url, []

    def post(self, path: str, body: dict) -> dict:
        assert path == "/update_weights_from_tensor"
        self.bodies.append(body)
        return {"success": True, "message": "Success"}


# On CUDA, SGLang's worker loads weights through modules that import sgl_kernel (its CUDA kernels, built for its own
# torch and CUDA): the lent GPU machine cannot install it, so these run only where SGLang runs on the GPU.
SGL_KERNEL = "SGLang's CUDA weight loading imports sgl_kernel, which is not installed here"


def sglang_rank_reads(body: dict, tp_rank: int):
    """TP rank `tp_rank` of an SGLang engine deserializing its own entry of the request."""
    req = build("UpdateWeightsFromTensorReqInput", body)  # installs the import doubles first
    from sglang.srt.managers.tp_worker import TpModelWorker

    parallel = types.SimpleNamespace(tp_rank=tp_rank)  # test double for SGLang's parallel context
    with mock.patch("sglang.srt.managers.tp_worker.get_parallel", return_value=parallel):
        return TpModelWorker.deserialize_own_rank(None, req.serialized_named_tensors)


def sglang_rank_loads(body: dict, tp_rank: int) -> list[tuple[str, torch.Tensor]]:
    """What SGLang's TP rank `tp_rank` hands to its model's load_weights for a flattened-bucket request: the
    steps of its `WeightUpdater._update_weights_from_flattened_bucket` (whose module imports multimodal code
    that needs torchvision, absent here), on SGLang's own FlattenedTensorBucket and FlattenedTensorMetadata."""
    assert body["load_format"] == "flattened_bucket"
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    obj = sglang_rank_reads(body, tp_rank)
    metadata = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                        end_idx=m.end_idx, numel=m.numel) for m in obj["metadata"]]
    return FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=metadata).reconstruct_tensors()


def assert_loads_the_bucket(got: list[tuple[str, torch.Tensor]], sent: Bucket, device: str = "cpu") -> None:
    assert sorted(n for n, _ in got) == sorted(t.name for t in sent.tensors)
    by_name = dict(got)
    for expected in sent.tensors:
        tensor = by_name[expected.name]
        assert tensor.device.type == device and tensor.dtype == expected.tensor.dtype, expected.name
        assert torch.equal(tensor, expected.tensor), expected.name


def bucket(device: str = "cpu") -> Bucket:
    g = torch.Generator().manual_seed(1)
    vocab_padded = torch.randn(80, 16, generator=g)  # a view of a padded vocab: only 64 rows are sent
    fused = torch.randn(24, 16, generator=g).to(torch.bfloat16)
    named = [("model.embed_tokens.weight", vocab_padded[:64]), ("model.layers.0.self_attn.q_proj.weight", fused[:16]),
             ("model.layers.0.self_attn.k_proj.weight", fused[16:]), ("model.norm.weight", torch.ones(16)),
             ("model.layers.0.mlp.experts.bias", torch.arange(6, dtype=torch.float16).reshape(2, 3))]
    return Bucket("target", [NamedTensor(n, t.to(device)) for n, t in named])


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_each_engine_tp_rank_loads_its_own_flattened_bucket(tp_size):
    clients = [RecordingClient("http://engine-0"), RecordingClient("http://engine-1")]
    transport = TensorTransport(clients, engine_tp_size=tp_size)
    sent = bucket()
    transport.send(sent, "target", "v1")
    for client in clients:
        (body,) = client.bodies
        assert len(body["serialized_named_tensors"]) == tp_size
        for rank in range(tp_size):
            assert_loads_the_bucket(sglang_rank_loads(body, rank), sent)
            # inline bytes: the flat tensor holds exactly the sent bytes, not the padded storage of a view
            flat = sglang_rank_reads(body, rank)["flattened_tensor"]
            assert flat.numel() == sum(t.tensor.numel() * t.tensor.element_size() for t in sent.tensors)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_each_engine_tp_rank_reads_its_own_entry(tp_size):
    clients = [RecordingClient("http://engine-0"), RecordingClient("http://engine-1")]
    transport = TensorTransport(clients, engine_tp_size=tp_size, flatten=False)
    sent = bucket()
    transport.send(sent, "target", "v1")
    for client in clients:
        (body,) = client.bodies
        assert len(body["serialized_named_tensors"]) == tp_size
        for rank in range(tp_size):
            got = sglang_rank_reads(body, rank)
            assert [n for n, _ in got] == [t.name for t in sent.tensors]
            for (_, tensor), expected in zip(got, sent.tensors):
                assert tensor.dtype == expected.tensor.dtype and torch.equal(tensor, expected.tensor), expected.name
                # inline bytes: exactly the tensor's own, not the padded storage it was a view of
                assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def test_a_rank_without_an_entry_is_an_error_not_a_silent_reuse():
    body = {"serialized_named_tensors": serialize_for_tp_ranks([("w", torch.ones(2))], 2)}
    with pytest.raises(IndexError):
        sglang_rank_reads(body, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC handles need a GPU (runs on the GPU machine)")
def test_cuda_tensors_travel_as_ipc_handles_sglang_opens():
    """The handle names the device by UUID; SGLang's patched rebuild maps it to its own device index."""
    pytest.importorskip("sgl_kernel", reason=SGL_KERNEL)
    sent = bucket("cuda")
    body = {"serialized_named_tensors": serialize_for_tp_ranks([(t.name, t.tensor) for t in sent.tensors], 2)}
    assert body["serialized_named_tensors"][0] != body["serialized_named_tensors"][1]  # each rank its own handles
    for rank in range(2):
        got = sglang_rank_reads(body, rank)
        for (_, tensor), expected in zip(got, sent.tensors):
            assert tensor.is_cuda and torch.equal(tensor, expected.tensor), expected.name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC handles need a GPU (runs on the GPU machine)")
def test_cuda_flattened_bucket_travels_as_one_ipc_handle_per_rank():
    pytest.importorskip("sgl_kernel", reason=SGL_KERNEL)
    client = RecordingClient("http://engine-0")
    sent = bucket("cuda")
    TensorTransport([client], engine_tp_size=2).send(sent, "target", "v1")
    (body,) = client.bodies
    assert body["serialized_named_tensors"][0] != body["serialized_named_tensors"][1]
    for rank in range(2):
        assert_loads_the_bucket(sglang_rank_loads(body, rank), sent, device="cuda")
