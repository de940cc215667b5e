"""engine/managers/finish.py: a speculative step appends several tokens at once, and the row ends exactly where
appending them one at a time under SGLang's rules would (a stop token, or max_new_tokens as SGLang clips it to the
context, in the middle of a chunk), logprobs included; where SGLang's own `Req.update_finish_state` ends it, over
the same chunks; and the clip is the one SGLang's own `Scheduler.init_req_max_new_tokens` makes."""

import random

from slime_spec.engine.managers.finish import FinishRules
from slime_spec.engine.managers.request import Request, Row, SamplingParams

EOS = {2}
PROMPT = [5, 6, 7]


def one_at_a_time(tokens, logprobs, params: SamplingParams, context_length: int):
    """SGLang's order for each appended token (stop strings aside): a stop token unless ignore_eos, then
    max_new_tokens as its scheduler clips it to the context (checked against SGLang's own clip below);
    (tokens, logprobs, finish) of the row."""
    out, lps = list(PROMPT), []
    limit = max(0, min(params.max_new_tokens, context_length - 2 - len(PROMPT)))
    for t, lp in zip(tokens, logprobs):
        out.append(t)
        lps.append(lp)
        if not params.ignore_eos and (t in EOS or t in params.stop_token_ids):
            return out, lps, {"type": "stop", "matched": t}
        if len(out) - len(PROMPT) >= limit:
            return out, lps, {"type": "length", "length": limit}
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


def sglang_clipped_max_new_tokens(max_new_tokens: int, prompt_len: int, context_length: int) -> int:
    """SGLang's own Scheduler.init_req_max_new_tokens on a request, its scheduler stood in by what that method
    reads, with a KV pool ample for a whole context per request (as the embedded engine's static cache is) and the
    pool's own clip from SGLang's base allocator."""
    from types import SimpleNamespace

    from slime_spec.engine import sglang_stand_ins
    sglang_stand_ins.install()
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangParams

    pool = 64 * context_length  # tokens: many requests' worth
    allocator = SimpleNamespace(page_size=1)
    allocator.max_new_tokens_for_memory = BaseTokenToKVPoolAllocator.max_new_tokens_for_memory.__get__(allocator)
    scheduler = SimpleNamespace(max_new_tokens_limit=None, max_req_len=min(context_length - 1, pool - 1),
                                max_total_num_tokens=pool, kv_shard_widening=1, page_size=1,
                                token_to_kv_pool_allocator=allocator, sliding_window_size=None,
                                chunked_prefill_size=8192)
    req = SimpleNamespace(rid="r", origin_input_ids=list(range(prompt_len)),
                          sampling_params=SGLangParams(max_new_tokens=max_new_tokens))
    Scheduler.init_req_max_new_tokens(scheduler, req)
    return req.sampling_params.max_new_tokens


def test_max_new_tokens_is_clipped_to_the_context_as_sglangs_scheduler_clips_it():
    rng = random.Random(2)
    for case in range(200):
        context_length = rng.randint(8, 64)
        prompt_len = rng.randint(1, context_length - 1)
        max_new_tokens = rng.randint(0, context_length - prompt_len)  # TokenizerManager refuses more
        rules = FinishRules(tokenizer=None, eos_token_ids=EOS, context_length=context_length)
        row = Row(Request(f"c{case}", list(range(prompt_len)), SamplingParams(max_new_tokens=max_new_tokens)),
                  tokens=list(range(prompt_len)))
        want = sglang_clipped_max_new_tokens(max_new_tokens, prompt_len, context_length)
        assert rules.max_new_tokens(row) == want, (context_length, prompt_len, max_new_tokens)
