"""`/generate` bodies in, SGLang-shaped responses out: pure functions, no engine, no HTTP.

A body is split into one `PlannedRequest` per sequence the way SGLang's `GenerateReqInput`
normalizes it (single or batch, `sampling_params` dict or list, `rid` str or list, `n` parallel
samples). Sampling params go through SGLang's own `SamplingParams` (normalize + verify), so a bad
value fails with SGLang's message; a field the embedded engine does not implement fails by name
instead of being silently ignored. Responses carry SGLang 0.5.23's `meta_info` keys.

Limits (SGLang has none; they keep one request from monopolizing the server):
- `sampling_params.n` <= MAX_PARALLEL_SAMPLE_NUM (1024);
- sequences per /generate (prompts x n) <= SEQUENCES_PER_RUNNING_REQUEST (64) x --max-running-requests;
- a text prompt is refused before tokenizing when even at the tokenizer's longest token (in characters, x2
  for Unicode normalization) it would not fit the context (`min_prompt_tokens`).
Every refusal names the field, the limit and the fix. `contract_error_field` names the field SGLang's
/generate contract rejected (its message does not), and `check_field_types` checks a control route's body
against the annotations of SGLang's io_struct class.
"""

from __future__ import annotations

import ast
import math
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from slime_spec.sglang_contract import all_structs, validate_payload

MAX_PARALLEL_SAMPLE_NUM = 1024
SEQUENCES_PER_RUNNING_REQUEST = 64

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
    try:
        sp.normalize(tokenizer)
        sp.verify(vocab_size)
    except ValueError as e:  # SGLang's message names the parameter; say where it sits
        raise ValueError(f"sampling_params: {e}") from e
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


def longest_token_chars(tokenizer: Any) -> int:
    """The longest vocabulary string: no token decodes to more characters (byte-level and SentencePiece)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=0)


def min_prompt_tokens(text: str, longest_token: int) -> int:
    """A lower bound on the tokens of `text`, without tokenizing (x2: normalization may merge characters)."""
    return math.ceil(len(text) / (2 * longest_token))


def plan_generate(body: dict, tokenizer: Any, vocab_size: int, context_len: int,
                  skip_tokenizer_init: bool = False, *, max_sequences: int | None = None,
                  max_token_chars: int = 0) -> tuple[list[PlannedRequest], bool]:
    """Split a /generate body into engine requests; returns (requests, is_single). Raises ValueError.

    max_sequences: the cap on prompts x n (None: only n is capped); max_token_chars: `longest_token_chars` of
    the tokenizer (0: no length check before tokenizing). Every limit is checked before tokenizing."""
    check_generate_fields(body)
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ValueError("Either text, input_ids or input_embeds should be provided." if text is None
                         else "text and input_ids cannot be provided at the same time")
    if text is not None:
        if skip_tokenizer_init:
            raise ValueError("text is unavailable when skip_tokenizer_init=True: send input_ids")
        is_single = isinstance(text, str)
        texts = [text] if is_single else text
        if max_sequences is not None and len(texts) > max_sequences:
            raise ValueError(f"text: a batch of {len(texts)} prompts is over the limit of {max_sequences} sequences "
                             f"per /generate ({SEQUENCES_PER_RUNNING_REQUEST} x --max-running-requests); split it")
        for i, t in enumerate(texts):
            if max_token_chars and min_prompt_tokens(t, max_token_chars) >= context_len:
                where = "text" if is_single else f"text[{i}]"
                raise ValueError(f"{where} has {len(t)} characters: at least "
                                 f"{min_prompt_tokens(t, max_token_chars)} tokens, longer than the model's "
                                 f"context length ({context_len} tokens); shorten the prompt")
        prompts = texts  # tokenized below, after every limit is checked
    else:
        if not isinstance(input_ids, list) or len(input_ids) == 0:
            raise ValueError("input_ids cannot be empty.")
        is_single = not isinstance(input_ids[0], list)
        prompts = [input_ids] if is_single else input_ids
    num = len(prompts)
    if num == 0:
        raise ValueError(f"{'text' if text is not None else 'input_ids'}: the batch is empty; send at least one "
                         "prompt")
    sampling = _per_item(body.get("sampling_params"), num, "sampling_params", {})
    ns = {(s or {}).get("n", 1) if isinstance(s, dict) else 1 for s in sampling}
    if len(ns) != 1:
        raise ValueError("The parallel_sample_num should be the same for all samples in sample params.")
    n = ns.pop()
    n = 1 if n is None else n
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"sampling_params.n={n!r}: the number of parallel samples must be a positive integer; "
                         "send n >= 1 or leave it unset (1)")
    if n > MAX_PARALLEL_SAMPLE_NUM:
        raise ValueError(f"sampling_params.n={n} exceeds the embedded engine's limit of {MAX_PARALLEL_SAMPLE_NUM} "
                         "parallel samples per request; send several requests with a smaller n")
    if max_sequences is not None and num * n > max_sequences:
        raise ValueError(f"this /generate asks for {num} prompt(s) x sampling_params.n={n} = {num * n} sequences, "
                         f"over the limit of {max_sequences} ({SEQUENCES_PER_RUNNING_REQUEST} x "
                         "--max-running-requests); split the batch (text / input_ids) over several requests")
    if text is not None:
        prompts = [tokenizer.encode(t) for t in prompts]
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
        duplicate = next(r for r, c in Counter(rids).items() if c > 1)
        raise ValueError(f"rid: {duplicate!r} appears twice in one request; give each prompt its own rid")
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


# ------------------------------------------------------------------ naming the field of a rejected body
_SERDE_TYPES = {"f64": "a number", "f32": "a number", "i64": "an integer", "i32": "an integer", "u64": "an integer",
                "u32": "an integer", "bool": "true or false", "a string": "a string", "a sequence": "a list",
                "StringOrList": "a string or a list of strings", "BoolOrList": "true/false or a list of them",
                "TokenIdsOrList": "a list of token ids, or a list of such lists",
                "SamplingParamsOrList": "an object, or a list of objects (one per prompt)",
                "struct SamplingParams": "an object"}


def contract_error_field(body: dict, contract_error: Callable[[dict], str | None]) -> str | None:
    """The field (`sampling_params[1].temperature` style) that makes SGLang's /generate contract refuse `body`."""
    base = {"text": "x"}
    for key, value in body.items():
        if contract_error({key: value} if key in ("text", "input_ids") else {**base, key: value}) is None:
            continue
        if key == "sampling_params":
            for i, item in enumerate(value if isinstance(value, list) else [value]):
                for sub, sub_value in (item.items() if isinstance(item, dict) else []):
                    if contract_error({**base, "sampling_params": {sub: sub_value}}) is not None:
                        return f"sampling_params{f'[{i}]' if isinstance(value, list) else ''}.{sub}"
        return key
    return None


def explain_contract_error(body: dict, message: str, contract_error: Callable[[dict], str | None]) -> str:
    """SGLang's contract message, prefixed with the field it is about and ended with the fix."""
    field = contract_error_field(body, contract_error) or "the /generate body"
    expected = message.rsplit("expected ", 1)[-1].removeprefix("a value or an array of values for ").strip()
    fix = _SERDE_TYPES.get(expected)
    if fix is None:
        return f"{field}: {message}; fix it to match SGLang's GenerateReqInput"
    scalar_in_list = fix in ("a number", "an integer", "a string", "true or false") and "expected" in message \
        and isinstance(_value_at(body, field), list)
    return f"{field}: {message}; send {'each element of ' if scalar_in_list else ''}{field} as {fix}"


def _value_at(body: dict, field: str) -> Any:
    """The value at a `contract_error_field` path (`a.b`, `a[1].b`), None where the path does not lead."""
    value: Any = body
    for part in field.replace("[", ".[").split("."):
        if part.startswith("["):
            index = int(part[1:-1])
            value = value[index] if isinstance(value, list) and index < len(value) else None
        else:
            value = value.get(part) if isinstance(value, dict) else None
    return value


# ------------------------------------------------------------------ control-route bodies
_JSON_TYPES = {"str": (str,), "bytes": (str,), "int": (int,), "float": (int, float), "bool": (bool,),
               "dict": (dict,), "Dict": (dict,), "list": (list,), "List": (list,)}


def _matches(value: Any, ann: ast.expr) -> bool:
    """Whether a JSON value fits an annotation; an annotation this does not know accepts anything."""
    if isinstance(ann, ast.Constant) and ann.value is None:
        return value is None
    if isinstance(ann, ast.Name):
        types = _JSON_TYPES.get(ann.id)
        if types is None:
            return True
        return isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name):
        outer, args = ann.value.id, ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
        if outer == "Optional":
            return value is None or _matches(value, args[0])
        if outer == "Union":
            return any(_matches(value, a) for a in args)
        if outer == "Annotated":
            return _matches(value, args[0])
        if outer == "Literal":
            return value in [a.value for a in args if isinstance(a, ast.Constant)]
        if outer in ("List", "list"):
            return isinstance(value, list) and all(_matches(v, args[0]) for v in value)
        if outer in ("Dict", "dict"):
            return isinstance(value, dict)
    return True


def check_field_types(struct_name: str, body: dict) -> None:
    """Raise ValueError naming the first field whose JSON value does not fit SGLang's annotation of it."""
    spec = all_structs().get(struct_name)
    fields = spec.annotations if spec is not None else {}
    for name, value in body.items():
        ann = fields.get(name)
        if ann is not None and not _matches(value, ann):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            choices = _literal_choices(ann)
            if choices is not None:
                raise ValueError(f"invalid {name} {shown}; send one of {', '.join(map(repr, choices))} "
                                 f"(SGLang's {struct_name}.{name})")
            raise ValueError(f"{name}={shown}: SGLang's {struct_name}.{name} is `{ast.unparse(ann)}`; send {name} "
                             "as that type")


def _literal_choices(ann: ast.expr) -> list | None:
    if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Literal":
        args = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
        return [a.value for a in args if isinstance(a, ast.Constant)]
    return None



# ---------------------------------------------------------------- history drafting (slime-spec extension)
HISTORY_FIELD = "slime_history"  # slime-spec extension of /generate: {"group": str, "corpus_id": str}


def pop_history_extension(body: dict) -> dict | None:
    """Remove and check the `slime_history` extension before SGLang's contract sees the body.

    SGLang's GenerateReqInput rejects unknown fields, so clients send it only to the embedded engine."""
    if not isinstance(body, dict) or HISTORY_FIELD not in body:
        return None
    ext = body.pop(HISTORY_FIELD)
    if ext is None:
        return None
    if not isinstance(ext, dict) or set(ext) - {"group", "corpus_id"}:
        raise ValueError(f"{HISTORY_FIELD} must be an object with optional string fields 'group' and "
                         f"'corpus_id', got {ext!r}")
    for name in ("group", "corpus_id"):
        if ext.get(name) is not None and not isinstance(ext[name], str):
            raise ValueError(f"{HISTORY_FIELD}.{name}={ext[name]!r} must be a string (or left out)")
    if isinstance(body.get("text"), list) or (isinstance(body.get("input_ids"), list) and body["input_ids"]
                                               and isinstance(body["input_ids"][0], list)):
        raise ValueError(f"{HISTORY_FIELD} applies to one prompt: send it with a single text / input_ids (use "
                         "sampling_params.n for a group)")
    return ext


# SGLang 0.5.23's answers on the corpus routes (tokenizer_control_mixin.py, external_corpus_manager.py).
NGRAM_OFF_MESSAGE = "Ngram speculative decoding is not enabled."
EXTERNAL_CORPUS_MAX_TOKENS = 10_000_000  # SGLang's --speculative-ngram-external-corpus-max-tokens default


def plan_external_corpus(body: dict, tokenizer: Any, max_tokens: int, separator: int) -> tuple[str, list, bool]:
    """An /add_external_corpus body as SGLang's tokenizer manager turns it into token chunks.

    Returns (corpus_id, token_chunks, truncated). Like 0.5.23's HTTP route, it needs `file_path` (JSONL of
    strings) or `documents`; bare `token_chunks` are refused with SGLang's message."""
    cid = body.get("corpus_id") or uuid.uuid4().hex
    if body.get("file_path") is not None:
        return cid, _file_chunks(body["file_path"], tokenizer, max_tokens, separator), False
    if body.get("documents") is None:
        raise ValueError("Either file_path or documents must be provided.")
    chunks, total, truncated = [], 0, False
    for doc in body["documents"]:
        ids = list(tokenizer.encode(doc, add_special_tokens=False)) if doc else []
        if not ids:
            continue
        if chunks:
            ids = [separator] + ids
        if total + len(ids) > max_tokens:
            truncated = True
            break
        chunks.append(ids)
        total += len(ids)
    return cid, chunks, truncated


def _file_chunks(path: str, tokenizer: Any, max_tokens: int, separator: int) -> list[list[int]]:
    import json
    from pathlib import Path

    if not Path(path).is_file():
        raise ValueError(f"External ngram corpus path does not exist: {path}")
    chunks, total = [], 0
    for line_no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"Invalid JSON in external ngram corpus at line {line_no}: {e.msg}") from e
        if not isinstance(record, str):
            raise ValueError(f"Invalid external ngram corpus record at line {line_no}: expected a JSON string.")
        ids = list(tokenizer.encode(record, add_special_tokens=False))
        if not ids:
            continue
        ids = ([separator] if chunks else []) + ids
        if total + len(ids) > max_tokens:
            raise ValueError(f"External ngram corpus exceeds the configured token limit ({max_tokens}) at line "
                             f"{line_no} after loading {total} tokens.")
        total += len(ids)
        chunks.append(ids)
    return chunks
