"""One sample's generation: the default single-request function and the client a custom one receives; a GRPO
group's samples in one batched request (`default_generate_group`), which the manager sends instead of one request per
sample where the default function generates.

A custom generate function (`--custom-generate-function-path pkg.module.fn`) has the signature

    async def fn(client: RolloutEngineClient, sample: Sample, sampling_params: dict) -> Sample

(slime passes `args` first; here the first argument is the engine client, which also carries the
`RolloutConfig` as `client.config` and the tokenizer as `client.tokenizer`). It may make several
requests (`await client.generate(payload)` or `await client.post(path, payload)`); for each answer it
must call `apply_generate_output(sample, output)`, or at least `sample.spec.add_meta_info(output["meta_info"])`
and set `sample.weight_version`, so the speculative counters of all its requests are summed and the
sample says which weights made it. `sample.tokens` holds the prompt ids on entry. Failures raise
`EngineError`: the manager retries the sample (from a fresh copy) on the least-loaded engine,
restarting an unreachable engine first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from slime_spec.config.run_config import RolloutConfig
from slime_spec.fleet.client import AsyncEngineClient
from slime_spec.rollout.sample import Sample, Status

GenerateFn = Callable[["RolloutEngineClient", Sample, dict], Awaitable[Sample]]


@dataclass
class RolloutEngineClient(AsyncEngineClient):
    """The engines' async client, plus what a generate function needs to know about the rollout."""

    engine_index: int = 0
    config: RolloutConfig | None = None
    tokenizer: Any = None


def apply_generate_output(sample: Sample, output: dict) -> None:
    """Append one /generate answer to a sample: tokens, text, logprobs, status, spec counters."""
    meta = output["meta_info"]
    logprobs = meta.get("output_token_logprobs")
    if logprobs is not None:
        token_ids = [int(item[1]) for item in logprobs]
        sample.rollout_log_probs += [float(item[0]) for item in logprobs]
    else:
        token_ids = [int(t) for t in output.get("output_ids", [])]
    if "output_ids" in output and list(output["output_ids"]) != token_ids:
        raise ValueError(f"engine answered output_ids of length {len(output['output_ids'])} that disagree with "
                         f"output_token_logprobs of length {len(token_ids)}")
    sample.tokens += token_ids
    sample.response += output.get("text", "")
    sample.response_length += len(token_ids)
    sample.meta_info = meta
    if meta.get("weight_version") is not None:
        sample.weight_version = str(meta["weight_version"])
    sample.spec.add_meta_info(meta)
    finish = (meta.get("finish_reason") or {}).get("type")
    if finish == "length":
        sample.status = Status.TRUNCATED
    elif finish == "abort":
        sample.status = Status.ABORTED
        sample.error = (meta.get("finish_reason") or {}).get("message") or "the engine aborted the request"
    else:
        sample.status = Status.COMPLETED


async def default_generate(client: RolloutEngineClient, sample: Sample, sampling_params: dict) -> Sample:
    """One /generate request on the prompt token ids, logprobs of the response returned."""
    params = dict(sampling_params)
    params["max_new_tokens"] -= sample.response_length
    if params["max_new_tokens"] <= 0:
        sample.status = Status.TRUNCATED
        return sample
    payload = {"input_ids": list(sample.tokens), "sampling_params": params, "return_logprob": True,
               **sample.metadata.get("request_extension", {})}  # history_sync.REQUEST_EXTENSION (embedded only)
    apply_generate_output(sample, await client.generate(payload))
    return sample


def sends_groups(rollout: RolloutConfig) -> bool:
    """Whether the rollout sends a GRPO group as one batched /generate: with the default generate function (a custom
    one sends what it sends), without the sglang-router in front and without history drafting (its requests carry
    fields of their own)."""
    return (rollout.custom_generate_function_path is None and not rollout.use_sglang_router
            and not rollout.rollout_history_drafting)


def group_request(samples: list[Sample], sampling_params: dict) -> dict | None:
    """The batched /generate body for `samples` (SGLang's GenerateReqInput with lists: one input and one
    sampling_params per sample), or None where one request per sample is needed: a sample that continues a partial
    response past its limit, or carries fields of its own (a history-drafting request extension)."""
    params = []
    for s in samples:
        if s.metadata.get("request_extension"):
            return None
        p = dict(sampling_params)
        p["max_new_tokens"] -= s.response_length
        if p["max_new_tokens"] <= 0:
            return None
        params.append(p)
    return batched_body([list(s.tokens) for s in samples], params)


def batched_body(input_ids: list[list[int]], sampling_params: list[dict] | dict) -> dict:
    """A batched /generate body (SGLang's GenerateReqInput with lists): one input per row, one sampling_params per
    row or one for all, the response's logprobs returned (as the rollout asks for them)."""
    return {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True}


async def default_generate_group(client: RolloutEngineClient, samples: list[Sample], body: dict) -> list[Sample]:
    """`default_generate` for a group's samples, as one batched /generate (`body` from `group_request`): SGLang's
    front end takes about a third of the CPU per sample in a batch (bench/engine_http.py), and the engine gets the
    group at once instead of over the arrival of its requests."""
    outputs = await client.generate_batch(body)
    if len(outputs) != len(samples):
        raise ValueError(f"a batched /generate of {len(samples)} inputs was answered with {len(outputs)} outputs")
    for sample, output in zip(samples, outputs):
        apply_generate_output(sample, output)
    return samples
