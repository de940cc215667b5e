"""engine/managers/finish.py: a speculative step appends several tokens at once, and the row ends exactly where
appending them one at a time under SGLang's rules would (a stop token, max_new_tokens or the context length in the
middle of a chunk), logprobs included; and where SGLang's own `Req.update_finish_state` ends it, over the same
chunks."""

import random

from slime_spec.engine.managers.finish import FinishRules
from slime_spec.engine.managers.request import Request, Row, SamplingParams

EOS = {2}
PROMPT = [5, 6, 7]


def one_at_a_time(tokens, logprobs, params: SamplingParams, context_length: int):
    """SGLang's order for each appended token (stop strings aside): a stop token unless ignore_eos, then
    max_new_tokens, then the context length; (tokens, logprobs, finish) of the row."""
    out, lps = list(PROMPT), []
    for t, lp in zip(tokens, logprobs):
        out.append(t)
        lps.append(lp)
        if not params.ignore_eos and (t in EOS or t in params.stop_token_ids):
            return out, lps, {"type": "stop", "matched": t}
        if len(out) - len(PROMPT) >= params.max_new_tokens:
            return out, lps, {"type": "length", "length": params.max_new_tokens}
        if len(out) >= context_length:
            return out, lps, {"type": "length", "length": len(out) - len(PROMPT)}
    return out, lps, None


def test_chunked_appends_end_where_one_token_at_a_time_would():
    rng = random.Random(0)
    for case in range(400):
        params = SamplingParams(max_new_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.2,
                                stop_token_ids=rng.sample(range(3, 12), rng.randint(0, 2)))
        context_length = rng.randint(len(PROMPT) + 1, 20)
        tokens = [rng.randint(2, 40) for _ in range(16)]
        logprobs = [-rng.random() for _ in tokens]
        rules = FinishRules(tokenizer=None, eos_token_ids=EOS, context_length=context_length)
        row = Row(Request(f"r{case}", list(PROMPT), params, return_logprob=True), tokens=list(PROMPT))
        i = 0
        while row.finish is None and i < len(tokens):
            n = rng.randint(1, 5)  # a verify's accepted drafts plus one
            rules.append_tokens(row, tokens[i: i + n], logprobs[i: i + n])
            i += n
        want_tokens, want_logprobs, want_finish = one_at_a_time(tokens[:i], logprobs[:i], params, context_length)
        assert (row.tokens, row.logprobs, row.finish) == (want_tokens, want_logprobs, want_finish), (case, params)


def test_a_stop_string_is_checked_at_every_token():
    class Chars:  # a tokenizer whose token t is the character chr(t)
        @staticmethod
        def decode(ids, **_):
            return "".join(chr(t) for t in ids)

    params = SamplingParams(max_new_tokens=50, stop=["cd"])
    row = Row(Request("s", [ord("x")], params), tokens=[ord("x")])
    FinishRules(Chars(), EOS, 100).append_tokens(row, [ord(c) for c in "abcdef"], None)
    assert row.finish == {"type": "stop", "matched": "cd"} and Chars.decode(row.output_ids) == "abcd"


def sglang_finish(tokens, params: SamplingParams):
    """SGLang's own Req.update_finish_state over the same chunks: (output ids kept, finish_reason JSON or None)."""
    from slime_spec.engine import sglang_stand_ins
    sglang_stand_ins.install()
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangParams

    sp = SGLangParams(max_new_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids),
                      ignore_eos=params.ignore_eos)
    sp.normalize(None)
    req = Req.__new__(Req)  # only what update_finish_state reads: a Req's sampling state, no scheduler
    req.sampling_params, req.output_ids, req.eos_token_ids, req.tokenizer = sp, [], set(EOS), None
    req.finished_reason = req.to_finish = req.finished_len = req.grammar = None
    req.vocab_size = 1000
    for chunk in tokens:
        req.output_ids += chunk
        req.update_finish_state(len(chunk))
        if req.finished_reason is not None:
            kept = req.output_ids[: req.finished_len or len(req.output_ids)]
            return kept, req.finished_reason.to_json()
    return req.output_ids, None


def test_chunked_appends_finish_as_sglangs_own_request_does():
    rng = random.Random(1)
    for case in range(300):
        params = SamplingParams(max_new_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.2,
                                stop_token_ids=rng.sample(range(3, 12), rng.randint(0, 2)))
        chunks = [[rng.randint(2, 40) for _ in range(rng.randint(1, 5))] for _ in range(6)]
        rules = FinishRules(tokenizer=None, eos_token_ids=EOS, context_length=10_000)
        row = Row(Request(f"s{case}", list(PROMPT), params), tokens=list(PROMPT))
        for chunk in chunks:
            if row.finish is None:
                rules.append_tokens(row, chunk, None)
        assert (row.output_ids, row.finish) == sglang_finish(chunks, params), (case, params, chunks)
