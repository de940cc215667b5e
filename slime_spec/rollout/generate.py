"""One sample's generation: the default single-request function and the client a custom one receives.

A custom generate function (`--custom-generate-function-path pkg.module.fn`) has the signature

    async def fn(client: EngineClient, sample: Sample, sampling_params: dict) -> Sample

(slime passes `args` first; here the first argument is the engine client, which also carries the
`RolloutConfig` as `client.config` and the tokenizer as `client.tokenizer`). It may make several
requests (`await client.generate(payload)` or `client.post(path, payload)`); for each answer it
must call `apply_generate_output(sample, output)` or at least `sample.spec.add_meta_info(output["meta_info"])`
so the speculative counters of all its requests are summed. `sample.tokens` holds the prompt ids on
entry. Connection failures propagate: the manager retries the sample (from a fresh copy) on the
least-loaded engine, restarting a dead engine first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import aiohttp

from slime_spec.config import RolloutConfig
from slime_spec.rollout.engine_actor import parse_response
from slime_spec.rollout.sample import Sample, Status

GenerateFn = Callable[["EngineClient", Sample, dict], Awaitable[Sample]]


@dataclass
class EngineClient:
    """One engine as seen from inside a rollout: its URL over a shared aiohttp session."""

    url: str
    engine_index: int
    session: aiohttp.ClientSession
    config: RolloutConfig
    tokenizer: Any = None

    async def post(self, path: str, payload: dict) -> dict:
        async with self.session.post(f"{self.url}{path}", json=payload) as r:
            return parse_response(f"{self.url}{path}", r.status, await r.text())

    async def generate(self, payload: dict) -> dict:
        return await self.post("/generate", payload)


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
    sample.spec.add_meta_info(meta)
    finish = (meta.get("finish_reason") or {}).get("type")
    if finish == "length":
        sample.status = Status.TRUNCATED
    elif finish == "abort":
        sample.status = Status.ABORTED
        sample.error = (meta.get("finish_reason") or {}).get("message") or "the engine aborted the request"
    else:
        sample.status = Status.COMPLETED


async def default_generate(client: EngineClient, sample: Sample, sampling_params: dict) -> Sample:
    """One /generate request on the prompt token ids, logprobs of the response returned."""
    params = dict(sampling_params)
    params["max_new_tokens"] -= sample.response_length
    if params["max_new_tokens"] <= 0:
        sample.status = Status.TRUNCATED
        return sample
    payload = {"input_ids": list(sample.tokens), "sampling_params": params, "return_logprob": True}
    apply_generate_output(sample, await client.generate(payload))
    return sample
