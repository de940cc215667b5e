"""`/generate` bodies in, SGLang-shaped responses out: pure functions, no engine, no HTTP.

A body is split into one `PlannedRequest` per sequence the way SGLang's `GenerateReqInput`
normalizes it (single or batch, `sampling_params` dict or list, `rid` str or list, `n` parallel
samples). Sampling params go through SGLang's own `SamplingParams` (normalize + verify), so a bad
value fails with SGLang's message; a field the embedded engine does not implement fails by name
instead of being silently ignored. Responses carry SGLang 0.5.23's `meta_info` keys.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from slime_spec.sglang_contract import validate_payload

# Fields that only route, label or log a request in SGLang: no effect on its tokens.
_ROUTING_FIELDS = {"stream", "log_metrics", "priority", "routing_key", "custom_labels", "extra_key",
                   "cache_salt", "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
                   "routed_dp_rank", "disagg_prefill_dp_rank", "data_parallel_rank", "decode_tp_size",
                   "no_logs", "conversation_id", "received_time", "received_time_perf"}
_HONOURED_FIELDS = {"text", "input_ids", "sampling_params", "rid", "return_logprob", "return_text_in_logprobs",
                    "logprob_start_len", "top_logprobs_num", "return_prompt_token_ids"}

# SGLang sampling fields the embedded engine does not implement, with the value that means "off".
_UNSUPPORTED_SAMPLING = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                         "min_new_tokens": 0, "beam_width": None, "json_schema": None, "regex": None,
                         "ebnf": None, "structural_tag": None, "logit_bias": None, "sampling_seed": None,
                         "custom_params": None, "watermark": None}


@dataclass
class PlannedRequest:
    rid: str
    input_ids: list[int]
    params: Any  # slime_spec.engine.core.SamplingParams
    return_logprob: bool
    return_text_in_logprobs: bool
    return_prompt_token_ids: bool


def _is_off(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == [] or value == {} or value == ""


def check_generate_fields(body: Any) -> None:
    """SGLang's io_struct field names, then refuse any field that would change results here."""
    if not isinstance(body, dict):
        raise ValueError("the /generate body must be a JSON object")
    validate_payload("GenerateReqInput", body)
    if body.get("stream"):
        raise ValueError("stream=true is not supported by the embedded engine; send stream=false")
    for name, value in body.items():
        if name in _ROUTING_FIELDS or name in _HONOURED_FIELDS:
            continue
        if not _is_off(value):
            raise ValueError(f"{name}={value!r} is not supported by the embedded engine; leave it unset")
    for name, off in (("logprob_start_len", -1), ("top_logprobs_num", 0)):
        values = body.get(name)
        for v in values if isinstance(values, list) else [values]:
            if v is not None and v != off:
                raise ValueError(f"{name}={v!r} is not supported by the embedded engine (only output-token "
                                 f"logprobs are returned); leave it unset")


def _per_item(value: Any, num: int, name: str, default: Any) -> list:
    if value is None:
        return [default] * num
    if isinstance(value, list):
        if len(value) != num:
            raise ValueError(f"The length of {name} ({len(value)}) should equal the batch size ({num}).")
        return list(value)
    return [value] * num


def to_core_sampling(raw: dict, tokenizer: Any, vocab_size: int, room: int):
    """SGLang sampling params (a request dict) -> the engine's SamplingParams; `room` = tokens left in context."""
    from sglang.srt.sampling.sampling_params import TOP_K_ALL
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

    from slime_spec.engine.core import SamplingParams

    if not isinstance(raw, dict):
        raise ValueError(f"sampling_params must be an object, got {type(raw).__name__}")
    try:
        sp = SGLangSamplingParams(**{k: v for k, v in raw.items() if k != "n"})
    except TypeError as e:
        raise ValueError(f"sampling_params: {e}") from e
    sp.normalize(tokenizer)
    sp.verify(vocab_size)
    for name, off in _UNSUPPORTED_SAMPLING.items():
        value = getattr(sp, name)
        if value is not None and value != off:
            raise ValueError(f"sampling_params.{name}={value!r} is not supported by the embedded engine")
    if sp.stop_regex_strs:
        raise ValueError("sampling_params.stop_regex is not supported by the embedded engine")
    max_new = room if sp.max_new_tokens is None else sp.max_new_tokens
    greedy = sp.top_k == 1  # SGLang turns temperature 0 into top_k 1
    return SamplingParams(
        temperature=0.0 if greedy else float(sp.temperature), top_p=float(sp.top_p),
        top_k=-1 if sp.top_k >= TOP_K_ALL else int(sp.top_k), min_p=float(sp.min_p), max_new_tokens=int(max_new),
        stop=list(sp.stop_strs or []), stop_token_ids=sorted(sp.stop_token_ids or []),
        ignore_eos=bool(sp.ignore_eos), skip_special_tokens=bool(sp.skip_special_tokens),
        no_stop_trim=bool(sp.no_stop_trim))


def check_context(input_ids: list[int], max_new_tokens: int | None, context_len: int, vocab_size: int) -> None:
    """SGLang's length checks (tokenizer_manager._validate_one_request), with its messages."""
    if not input_ids:
        raise ValueError("input_ids cannot be empty.")
    bad = [t for t in input_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"input_ids contains out-of-vocabulary token id {bad[0]!r}; valid range is "
                         f"[0, {vocab_size}).")
    n = len(input_ids)
    if n >= context_len:
        raise ValueError(f"The input ({n} tokens) is longer than the model's context length ({context_len} tokens).")
    if max_new_tokens is not None and max_new_tokens + n > context_len:
        raise ValueError(
            f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
            f"You requested a total of {max_new_tokens + n} tokens: {n} tokens from the input messages and "
            f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
            f"messages or the completion to fit within the limit.")


def plan_generate(body: dict, tokenizer: Any, vocab_size: int, context_len: int,
                  skip_tokenizer_init: bool = False) -> tuple[list[PlannedRequest], bool]:
    """Split a /generate body into engine requests; returns (requests, is_single). Raises ValueError."""
    check_generate_fields(body)
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ValueError("Either text, input_ids or input_embeds should be provided." if text is None
                         else "text and input_ids cannot be provided at the same time")
    if text is not None:
        if skip_tokenizer_init:
            raise ValueError("text is unavailable when skip_tokenizer_init=True: send input_ids")
        is_single = isinstance(text, str)
        prompts = [tokenizer.encode(t) for t in ([text] if is_single else text)]
    else:
        if not isinstance(input_ids, list) or len(input_ids) == 0:
            raise ValueError("input_ids cannot be empty.")
        is_single = not isinstance(input_ids[0], list)
        prompts = [input_ids] if is_single else input_ids
    num = len(prompts)
    if num == 0:
        raise ValueError("the batch is empty")
    sampling = _per_item(body.get("sampling_params"), num, "sampling_params", {})
    ns = {(s or {}).get("n", 1) if isinstance(s, dict) else 1 for s in sampling}
    if len(ns) != 1:
        raise ValueError("The parallel_sample_num should be the same for all samples in sample params.")
    n = ns.pop() or 1
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"sampling_params.n must be a positive integer, got {n!r}")
    return_logprob = _per_item(body.get("return_logprob"), num, "return_logprob", False)
    rids = body.get("rid")
    if rids is None:
        rids = [uuid.uuid4().hex for _ in range(num)]
    elif isinstance(rids, str):
        rids = [rids] if is_single else [f"{rids}_{i}" for i in range(num)]
    elif not isinstance(rids, list) or len(rids) != num:
        raise ValueError("The specified rids length mismatch with the batch_size for batch processing.")
    if n > 1:  # SGLang's parallel sampling: the batch repeated n times, a batch response
        is_single = False
        prompts, sampling, return_logprob = prompts * n, sampling * n, return_logprob * n
        rids = [f"{rid}_{k}" if k else rid for k in range(n) for rid in rids]
    if len(set(rids)) != len(rids):
        raise ValueError(f"duplicate rid in one request: {sorted(r for r in rids if rids.count(r) > 1)[0]!r}")
    planned = []
    for rid, ids, raw, lp in zip(rids, prompts, sampling, return_logprob):
        raw = raw or {}
        check_context(ids, raw.get("max_new_tokens", 128), context_len, vocab_size)
        params = to_core_sampling(raw, None if skip_tokenizer_init else tokenizer, vocab_size,
                                  context_len - len(ids))
        planned.append(PlannedRequest(str(rid), list(ids), params, bool(lp),
                                      bool(body.get("return_text_in_logprobs")) and not skip_tokenizer_init,
                                      bool(body.get("return_prompt_token_ids"))))
    return planned, is_single


def build_response(out: Any, req: PlannedRequest, *, tokenizer: Any, spec_enabled: bool, weight_version: str,
                   e2e_latency: float, skip_tokenizer_init: bool = False) -> dict:
    """One finished request (engine Output) as SGLang's /generate returns it."""
    meta: dict[str, Any] = {
        "id": req.rid, "finish_reason": out.finish_reason, "prompt_tokens": out.prompt_tokens,
        "weight_version": weight_version, "num_retractions": 0,
    }
    if req.return_logprob:
        ids, vals = out.output_ids, out.output_logprobs or []
        if len(vals) != len(ids):
            raise RuntimeError(f"request {req.rid}: {len(vals)} logprobs for {len(ids)} output tokens")
        texts = [tokenizer.decode([t]) for t in ids] if req.return_text_in_logprobs else [None] * len(ids)
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [[float(v), int(t), s] for v, t, s in zip(vals, ids, texts)]
        meta["output_token_logprobs_length"] = len(ids)
    meta.update({"reasoning_tokens": 0, "completion_tokens": out.completion_tokens, "cached_tokens": 0,
                 "e2e_latency": e2e_latency})
    meta.update(spec_meta_info(spec_enabled, out.completion_tokens, out.spec_verify_ct,
                               out.spec_accept_token_num, out.spec_draft_token_num))
    response: dict[str, Any] = {} if skip_tokenizer_init else {"text": out.text}
    response.update({"output_ids": list(out.output_ids), "meta_info": meta})
    if req.return_prompt_token_ids:
        response["prompt_token_ids"] = list(req.input_ids)
    return response


def spec_meta_info(spec_enabled: bool, completion_tokens: int, verify_ct: int, accepted: int,
                   proposed: int) -> dict:
    """SGLang sends these only with speculation on and at least one verify pass (_calculate_spec_decoding_metrics).

    0.5.23 names them spec_num_correct_drafts / spec_num_proposed_drafts; earlier releases (PR #13754)
    spec_accept_token_num / spec_draft_token_num. Both are sent, with the same values.
    """
    if not spec_enabled or verify_ct <= 0 or proposed <= 0:
        return {}
    return {"spec_accept_rate": accepted / proposed, "spec_accept_length": completion_tokens / verify_ct,
            "spec_num_correct_drafts": accepted, "spec_num_proposed_drafts": proposed,
            "spec_verify_ct": verify_ct, "spec_accept_token_num": accepted, "spec_draft_token_num": proposed}
