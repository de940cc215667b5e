"""Build SGLang 0.5.23's own request objects from our request bodies, the way its HTTP server does.

`sglang.srt.entrypoints.http_server` declares each route's body as an io_struct class; FastAPI turns
the JSON object into it through pydantic, using the class's `__get_pydantic_core_schema__`
(a typed dict, then `cls(**value)`, so msgspec's types and the class's own `__post_init__` run).
We call the same pydantic adapter. SGLang's schema ignores unknown keys, so we also refuse keys the
class does not have: a misspelled field would otherwise be dropped without a word.
"""

from __future__ import annotations

import functools

from tests.conformance import sglang_doubles

# Fields every BaseReq carries for SGLang's own routing between its processes; never in an HTTP body.
INTERNAL_FIELDS = {"rid", "http_worker_ipc"}


@functools.cache
def io_struct():
    sglang_doubles.install()
    import sglang.srt.managers.io_struct as module

    return module


def field_names(cls) -> set[str]:
    import dataclasses

    import msgspec

    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        return {f.name for f in msgspec.structs.fields(cls)}
    return {f.name for f in dataclasses.fields(cls)}


def build(struct_name: str, body: dict):
    """The io_struct object SGLang's route builds from `body`; raises on any field SGLang would not take."""
    from pydantic import TypeAdapter

    cls = getattr(io_struct(), struct_name)
    unknown = set(body) - field_names(cls)
    if unknown:
        raise ValueError(f"{struct_name} has no field(s) {sorted(unknown)}: SGLang would drop them silently")
    internal = set(body) & INTERNAL_FIELDS - ({"rid"} if struct_name in ("AbortReq", "GenerateReqInput") else set())
    if internal:
        raise ValueError(f"{struct_name}: {sorted(internal)} are SGLang-internal routing fields")
    return TypeAdapter(cls).validate_python(body)


class ByteTokenizer:
    """Test double for the served tokenizer: SGLang only asks it to encode stop strings here."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))


def build_generate(body: dict, vocab_size: int):
    """A /generate body through SGLang's own checks: the route's contract check, GenerateReqInput,
    its batch/argument normalization, and the tokenizer manager's SamplingParams normalize + verify."""
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.sampling.sampling_params import SamplingParams

    error = generate_contract_error(body)
    if error is not None:
        raise ValueError(f"/generate contract: {error}")
    req = build("GenerateReqInput", body)
    req.normalize_batch_and_arguments()
    each = req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params]
    for sp in each[1:]:  # a batch: every prompt's parameters pass the same checks
        batch_params = SamplingParams(**(sp or {}))
        batch_params.normalize(ByteTokenizer())
        batch_params.verify(vocab_size)
    params = SamplingParams(**(each[0] or {}))
    params.normalize(ByteTokenizer())
    params.verify(vocab_size)
    return req, params
