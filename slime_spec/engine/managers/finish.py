"""When a request finishes and what it returns: SGLang's stop rules and stop trimming, for one engine.

A token is appended, then checked in SGLang's order: a stop string, a stop token (EOS or `stop_token_ids`,
unless `ignore_eos`), `max_new_tokens`. The context bounds `max_new_tokens` as SGLang's scheduler clips it when a
request arrives (`Scheduler.init_req_max_new_tokens`, its KV pool ample: the embedded engine's static cache holds a
whole context per slot): at most context length - 2 - prompt tokens. Its bounds are SGLang's TpModelWorker's:
max_req_len = context length - 1, and a prompt must stay under max_req_input_len = max_req_len - 5. A finished
row's text leaves out the stop token or what follows the stop string's start, unless `no_stop_trim`.
"""

from __future__ import annotations

from slime_spec.engine.managers.request import Output, Row


def request_limits(context_length: int) -> tuple[int, int]:
    """(max_req_len, max_req_input_len) as SGLang's TpModelWorker sets them where the KV pool holds a whole context:
    a request spans at most context length - 1 positions, and its scheduler refuses a prompt of max_req_len - 5
    tokens or more."""
    max_req_len = context_length - 1
    return max_req_len, max_req_len - 5


class FinishRules:
    def __init__(self, tokenizer, eos_token_ids: set[int], context_length: int):
        self.tokenizer, self.eos_token_ids, self.context_length = tokenizer, eos_token_ids, context_length
        self.max_req_len, self.max_req_input_len = request_limits(context_length)

    def max_new_tokens(self, row: Row) -> int:
        """The row's `max_new_tokens` as SGLang's scheduler clips it: within max_req_len = context length - 1, less
        the prompt and one more."""
        return max(0, min(row.req.params.max_new_tokens, self.max_req_len - row.prompt_len - 1))

    def append_tokens(self, row: Row, tokens: list[int], logprobs: list[float] | None) -> None:
        """Append tokens one by one, stopping at the first finish."""
        p = row.req.params
        limit = self.max_new_tokens(row)
        for j, t in enumerate(tokens):
            row.tokens.append(t)
            if row.req.return_logprob:
                row.logprobs.append(logprobs[j])
            out_len = len(row.tokens) - row.prompt_len
            matched = self._matched_stop_str(row) if p.stop else None
            if matched is not None:
                row.finish = {"type": "stop", "matched": matched}
            elif not p.ignore_eos and (t in self.eos_token_ids or t in p.stop_token_ids):
                row.finish = {"type": "stop", "matched": t}
            elif out_len >= limit:
                row.finish = {"type": "length", "length": limit}
            if row.finish is not None:
                return

    def _matched_stop_str(self, row: Row) -> str | None:
        p = row.req.params
        window = max(len(s) for s in p.stop) + 1
        tail = self.tokenizer.decode(row.output_ids[-window:])
        for s in p.stop:
            if s and s in tail:
                return s
        return None

    def output(self, row: Row) -> Output:
        """The finished row as returned: its tokens, the text with the stop trimmed, and its speculative counts."""
        p = row.req.params
        out = row.output_ids
        text_ids = out
        if row.finish and row.finish["type"] == "stop" and isinstance(row.finish["matched"], int) \
                and not p.no_stop_trim and out:
            text_ids = out[:-1]
        text = self.tokenizer.decode(text_ids, skip_special_tokens=p.skip_special_tokens)
        if row.finish and row.finish["type"] == "stop" and isinstance(row.finish["matched"], str) \
                and not p.no_stop_trim:
            pos = text.find(row.finish["matched"])
            text = text[:pos] if pos != -1 else text
        return Output(rid=row.req.rid, output_ids=list(out),
                      output_logprobs=list(row.logprobs) if row.req.return_logprob else None,
                      finish_reason=dict(row.finish), prompt_tokens=row.prompt_len, completion_tokens=len(out),
                      spec_verify_ct=row.verify_ct, spec_accept_token_num=row.accept_num,
                      spec_draft_token_num=row.draft_num, text=text)
