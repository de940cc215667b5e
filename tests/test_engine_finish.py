"""engine/managers/finish.py: a speculative step appends several tokens at once, and the row ends exactly where
appending them one at a time under SGLang's rules would (a stop token, max_new_tokens or the context length in the
middle of a chunk), logprobs included."""

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
