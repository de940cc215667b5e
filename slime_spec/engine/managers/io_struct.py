"""SGLang's io_struct messages <-> the engine's requests and outputs: pure functions, no sockets, no engine.

SGLang's TokenizerManager has already validated, tokenized and normalized a request (its SamplingParams went
through `normalize` and `verify`) when it reaches the scheduler. What is left to the scheduler, and so to us:
- the sampling fields the embedded engine does not implement are refused by name (`UnsupportedRequest`, answered
  as SGLang's scheduler answers a request it cannot serve: an abort with status 400);
- a prompt of max_req_input_len tokens or more, refused by SGLang's own `validate_input_length` (the
  TokenizerManager refuses only a prompt that fills the context);
- the stop and EOS rules (EngineCore applies them; SGLang's DetokenizerManager trims the matched stop);
- the reply: `BatchTokenIDOutput` messages (the tokens since a request's last message, with the counters SGLang's
  TokenizerManager turns into `meta_info`: `spec_verify_ct`, `spec_num_correct_drafts`, token counts).

History drafting (a slime-spec extension) travels in `extra_key`, the one free-form string SGLang's
GenerateReqInput forwards to the scheduler (it names a prefix-cache namespace there; the embedded engine keeps
no prefix cache): see `history_extra_key`.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass
from typing import Any

HISTORY_FIELD = "slime_history"  # slime-spec extension of /generate: {"group": str, "corpus_id": str}
HISTORY_KEY_PREFIX = "slime_history:"  # extra_key = prefix + JSON of the extension
INIT_DETOKENIZE_TAIL = 5  # SGLang's INIT_INCREMENTAL_DETOKENIZATION_OFFSET: prompt ids the detokenizer re-reads

# SGLang sampling fields the embedded engine does not implement, with the value that means "off".
_UNSUPPORTED_SAMPLING = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                         "min_new_tokens": 0, "json_schema": None, "regex": None, "ebnf": None,
                         "structural_tag": None, "logit_bias": None, "sampling_seed": None,
                         "custom_params": None}
_UNSUPPORTED_REQUEST = {"logprob_start_len": (-1, None), "top_logprobs_num": (0, None),
                        "token_ids_logprob": (None,), "input_embeds": (None,), "mm_inputs": (None,),
                        "return_hidden_states": (False, None), "lora_id": (None,), "session_params": (None,),
                        "custom_logit_processor": (None,), "return_routed_experts": (False,)}


class UnsupportedRequest(ValueError):
    """A request the embedded engine cannot serve as asked; the message names the field."""


# ------------------------------------------------------------------ requests in
def to_core_sampling(sp: Any, room: int):
    """SGLang's normalized SamplingParams -> the engine's; `room` = tokens left in the context."""
    from sglang.srt.sampling.sampling_params import TOP_K_ALL

    from slime_spec.engine.managers.request import SamplingParams
    for name, off in _UNSUPPORTED_SAMPLING.items():
        value = getattr(sp, name, off)
        if value is not None and value != off:
            raise UnsupportedRequest(f"sampling_params.{name}={value!r} is not supported by the embedded engine; "
                                     "leave it unset")
    if getattr(sp, "stop_regex_strs", None):
        raise UnsupportedRequest("sampling_params.stop_regex is not supported by the embedded engine; leave it unset")
    max_new = room if sp.max_new_tokens is None else sp.max_new_tokens
    greedy = sp.top_k == 1  # SGLang's normalize turns temperature 0 into top_k 1
    return SamplingParams(
        temperature=0.0 if greedy else float(sp.temperature), top_p=float(sp.top_p),
        top_k=-1 if sp.top_k >= TOP_K_ALL or sp.top_k < 0 else int(sp.top_k), min_p=float(sp.min_p),
        max_new_tokens=int(max_new), stop=list(sp.stop_strs or []), stop_token_ids=sorted(sp.stop_token_ids or []),
        ignore_eos=bool(sp.ignore_eos), skip_special_tokens=bool(sp.skip_special_tokens),
        no_stop_trim=bool(sp.no_stop_trim))


def to_core_request(req: Any, context_length: int):
    """A TokenizedGenerateReqInput -> the engine's Request; raises UnsupportedRequest naming the field."""
    from slime_spec.engine.managers.request import Request
    for name, offs in _UNSUPPORTED_REQUEST.items():
        value = getattr(req, name, None)
        if value not in offs and not (value == [] or value == {}):
            raise UnsupportedRequest(f"{name}={value!r} is not supported by the embedded engine (it returns the "
                                     "output tokens' logprobs only); leave it unset")
    ids = [int(t) for t in req.input_ids]
    params = to_core_sampling(req.sampling_params, context_length - len(ids))
    return Request(rid=req.rid, input_ids=ids, params=params, return_logprob=bool(req.return_logprob),
                   history=history_of(req.extra_key))


def history_extra_key(ext: Any) -> str:
    """The `slime_history` extension, checked, as the `extra_key` string the scheduler decodes (history_of)."""
    if not isinstance(ext, dict) or set(ext) - {"group", "corpus_id"}:
        raise ValueError(f"{HISTORY_FIELD} must be an object with optional string fields 'group' and "
                         f"'corpus_id', got {ext!r}")
    for name in ("group", "corpus_id"):
        if ext.get(name) is not None and not isinstance(ext[name], str):
            raise ValueError(f"{HISTORY_FIELD}.{name}={ext[name]!r} must be a string (or left out)")
    return HISTORY_KEY_PREFIX + json.dumps({k: ext.get(k) for k in ("group", "corpus_id")}, sort_keys=True)


def history_of(extra_key: str | None):
    """extra_key -> drafters.history.HistoryRef (None when the request carries no `slime_history`)."""
    if not extra_key or not extra_key.startswith(HISTORY_KEY_PREFIX):
        return None
    from slime_spec.engine.drafters.history import HistoryRef
    ext = json.loads(extra_key[len(HISTORY_KEY_PREFIX):])
    return HistoryRef(ext.get("group"), ext.get("corpus_id"))


# ------------------------------------------------------------------ outputs out
@dataclass
class OutputChunk:
    """One request's row in a BatchTokenIDOutput: `out` is what it has produced so far (finish_reason None while it
    runs), `sent` how many of those output tokens earlier messages carried, `req` the TokenizedGenerateReqInput."""
    req: Any
    out: Any
    sent: int = 0


def token_id_output(chunks: list[OutputChunk], spec_enabled: bool):
    """Chunks as one SGLang BatchTokenIDOutput, as SGLang's scheduler streams it (output_streamer.py).

    Each row carries the output ids after `sent` (with their logprobs) and cumulative counters. A request's first
    message puts, as SGLang's Req.init_incremental_detokenize does, the prompt's last ids (the detokenizer's
    surrounding context) before its output ids, read_offset = how many of them are prompt; a later message carries
    only the new ids, which the DetokenizerManager appends to what it holds for the request."""
    from sglang.srt.managers.io_struct import BatchTokenIDOutput

    n = len(chunks)
    decode_ids, read_offsets, output_ids, logprob_val, logprob_idx = [], [], [], [], []
    any_logprob = any(c.req.return_logprob for c in chunks)
    for c in chunks:
        new = list(c.out.output_ids[c.sent:])
        tail = []
        if c.sent == 0:
            prompt = c.req.input_ids
            tail = list(prompt[max(len(prompt) - INIT_DETOKENIZE_TAIL, 0):])
        decode_ids.append(array("l", tail + new))
        read_offsets.append(len(tail))
        output_ids.append(array("l", new))
        if c.req.return_logprob:
            logprob_val.append([float(v) for v in (c.out.output_logprobs or [])[c.sent:]])
            logprob_idx.append(new)
        else:
            logprob_val.append([])
            logprob_idx.append([])
    sp = [c.req.sampling_params for c in chunks]
    empty = [[] for _ in range(n)] if any_logprob else None
    return BatchTokenIDOutput(
        rids=[c.out.rid for c in chunks],
        http_worker_ipcs=[getattr(c.req, "http_worker_ipc", None) for c in chunks],
        finished_reasons=[None if c.out.finish_reason is None else dict(c.out.finish_reason) for c in chunks],
        decoded_texts=[""] * n, decode_ids=decode_ids, read_offsets=read_offsets, output_ids=output_ids,
        skip_special_tokens=[bool(s.skip_special_tokens) for s in sp],
        spaces_between_special_tokens=[bool(s.spaces_between_special_tokens) for s in sp],
        no_stop_trim=[bool(s.no_stop_trim) for s in sp],
        prompt_tokens=[c.out.prompt_tokens for c in chunks],
        reasoning_tokens=[0] * n, completion_tokens=[c.out.completion_tokens for c in chunks],
        cached_tokens=[0] * n,
        input_token_logprobs_val=empty, input_token_logprobs_idx=empty,
        output_token_logprobs_val=logprob_val if any_logprob else None,
        output_token_logprobs_idx=logprob_idx if any_logprob else None,
        input_top_logprobs_val=empty, input_top_logprobs_idx=empty,
        output_top_logprobs_val=empty, output_top_logprobs_idx=empty,
        input_token_ids_logprobs_val=empty, input_token_ids_logprobs_idx=empty,
        output_token_ids_logprobs_val=empty, output_token_ids_logprobs_idx=empty,
        output_token_entropy_val=None, output_token_sampling_mask=None, output_hidden_states=None,
        routed_experts=None, indexer_topk=None, placeholder_tokens_idx=None, placeholder_tokens_val=None,
        retraction_counts=[0] * n,
        spec_verify_ct=[c.out.spec_verify_ct for c in chunks] if spec_enabled else None,
        spec_num_correct_drafts=[c.out.spec_accept_token_num for c in chunks] if spec_enabled else None,
    )


def ends_in_stop_prefix(tail: str, stops: list[str]) -> bool:
    """SGLang's Req.check_match_stop_str_prefix: whether the decoded tail of a streaming request contains a stop
    string or ends in the start of one; its tokens are then held back, as they may yet be trimmed."""
    for stop in stops:
        if not stop:
            continue
        if stop in tail:
            return True
        if any(tail.endswith(stop[:i]) for i in range(1, min(len(tail), len(stop)) + 1)):
            return True
    return False


def prompt_length_error(input_ids: list[int], max_req_input_len: int) -> str | None:
    """SGLang's scheduler's own refusal of a prompt of max_req_input_len tokens or more (`validate_input_length`,
    which reads only the request's `origin_input_ids`); None when it fits. `--allow-auto-truncate` is refused at
    launch (server_args), so this never truncates."""
    from types import SimpleNamespace

    from sglang.srt.managers.utils import validate_input_length

    return validate_input_length(SimpleNamespace(origin_input_ids=input_ids), max_req_input_len,
                                 allow_auto_truncate=False)


def rejection(rid: str, message: str, http_worker_ipc: str | None = None, status_code: int = 400):
    """SGLang's answer to a request its scheduler refuses: an AbortReq whose finished_reason carries the status
    (the TokenizerManager turns 400 into its ValueError reply)."""
    from sglang.srt.managers.io_struct import AbortReq

    return AbortReq(rid=rid, http_worker_ipc=http_worker_ipc, abort_message=message,
                    finished_reason={"type": "abort", "message": message, "status_code": status_code})
