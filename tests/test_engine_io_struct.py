"""SGLang's io_struct messages to and from the engine (pure functions, no server): requests in with SGLang's own
SamplingParams, `BatchTokenIDOutput` out, read back by SGLang's own DetokenizerManager decoding."""

import pytest

from slime_spec.engine import sglang_stand_ins
from slime_spec.engine.managers.io_struct import (
    OutputChunk,
    UnsupportedRequest,
    ends_in_stop_prefix,
    history_extra_key,
    history_of,
    rejection,
    to_core_request,
    token_id_output,
)
from slime_spec.engine.managers.request import Output

sglang_stand_ins.install()


def tokenized(rid="r", ids=(5, 6, 7), extra_key=None, **sampling):
    """A TokenizedGenerateReqInput as SGLang's TokenizerManager builds it (sampling params normalized)."""
    from array import array

    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    sp = SamplingParams(**sampling)
    sp.normalize(None)
    sp.verify(101)
    return TokenizedGenerateReqInput(rid=rid, input_text=None, input_ids=array("l", ids), input_embeds=None,
                                     mm_inputs=None, token_type_ids=None, sampling_params=sp, return_logprob=False,
                                     logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False,
                                     extra_key=extra_key)


def test_sampling_params_from_sglangs_normalized_struct():
    req = to_core_request(tokenized(temperature=0, max_new_tokens=None, stop_token_ids=[9]), context_length=64)
    p = req.params
    assert req.input_ids == [5, 6, 7] and req.history is None
    assert p.temperature == 0.0 and p.top_k == 1  # SGLang's greedy: temperature 0 -> top_k 1
    assert p.max_new_tokens == 61  # SGLang: until the context is full
    assert p.stop_token_ids == [9]
    sampled = to_core_request(tokenized(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=4), 64).params
    assert (sampled.temperature, sampled.top_k, sampled.top_p, sampled.max_new_tokens) == (0.7, 5, 0.9, 4)


@pytest.mark.parametrize("field, value", [("frequency_penalty", 0.5), ("repetition_penalty", 1.2),
                                          ("presence_penalty", 0.3), ("regex", "a+")])
def test_unsupported_sampling_is_refused_by_name(field, value):
    with pytest.raises(UnsupportedRequest, match=f"sampling_params.{field}"):
        to_core_request(tokenized(**{field: value}), 64)


def test_history_extension_round_trips_through_extra_key():
    key = history_extra_key({"group": "0/7", "corpus_id": None})
    ref = history_of(key)
    assert (ref.group, ref.corpus_id) == ("0/7", None)
    assert to_core_request(tokenized(extra_key=key), 64).history == ref
    assert history_of(None) is None and history_of("user-salt") is None  # a user's own extra_key is no history
    for bad in ({"group": 3}, {"other": "x"}, "g"):
        with pytest.raises(ValueError, match="slime_history"):
            history_extra_key(bad)


def output(ids, finish=None, logprobs=None, verify=0, accept=0):
    return Output(rid="r", output_ids=list(ids), output_logprobs=logprobs, finish_reason=finish, prompt_tokens=9,
                  completion_tokens=len(ids), spec_verify_ct=verify, spec_accept_token_num=accept,
                  spec_draft_token_num=3 * verify, text="")


def test_token_id_output_is_what_sglangs_detokenizer_reads():
    """The one message of a finished request: prompt tail + output ids, read offset at the output, counters."""
    from sglang.srt.managers.io_struct import BatchTokenIDOutput

    req = tokenized(ids=list(range(3, 12)), temperature=0, max_new_tokens=3)
    out = output([20, 21, 2], finish={"type": "stop", "matched": 2}, verify=2, accept=1)
    msg = token_id_output([OutputChunk(req, out)], spec_enabled=True)
    assert isinstance(msg, BatchTokenIDOutput) and msg.rids == ["r"]
    assert list(msg.decode_ids[0]) == [7, 8, 9, 10, 11, 20, 21, 2] and msg.read_offsets == [5]
    assert list(msg.output_ids[0]) == [20, 21, 2] and msg.finished_reasons == [{"type": "stop", "matched": 2}]
    assert msg.spec_verify_ct == [2] and msg.spec_num_correct_drafts == [1]
    assert msg.completion_tokens == [3] and msg.prompt_tokens == [9] and msg.retraction_counts == [0]
    plain = token_id_output([OutputChunk(req, out)], spec_enabled=False)
    assert plain.spec_verify_ct is None  # SGLang sends no spec counters without speculation


def test_streamed_messages_carry_only_the_new_tokens():
    """As SGLang's output streamer: the first message has the prompt tail, later ones only the ids (and logprobs)
    since the last; counters are cumulative; finish_reason is None until the last."""
    req = tokenized(ids=list(range(3, 12)), temperature=0, max_new_tokens=4)
    req.return_logprob = True
    first = token_id_output([OutputChunk(req, output([20], logprobs=[-0.5], verify=1))], spec_enabled=True)
    assert list(first.decode_ids[0]) == [7, 8, 9, 10, 11, 20] and first.finished_reasons == [None]
    assert first.output_token_logprobs_val == [[-0.5]] and first.output_token_logprobs_idx == [[20]]
    last = token_id_output([OutputChunk(req, output([20, 21, 22, 23], finish={"type": "length", "length": 4},
                                                    logprobs=[-0.5, -1.0, -1.5, -2.0], verify=3, accept=1),
                                        sent=1)], spec_enabled=True)
    assert list(last.decode_ids[0]) == [21, 22, 23] and list(last.output_ids[0]) == [21, 22, 23]
    assert last.output_token_logprobs_val == [[-1.0, -1.5, -2.0]]
    assert last.completion_tokens == [4] and last.spec_verify_ct == [3]
    assert last.finished_reasons == [{"type": "length", "length": 4}]


def test_stop_string_prefix_holds_a_stream_back():
    """SGLang's Req.check_match_stop_str_prefix."""
    assert ends_in_stop_prefix("the answer is 4\nEN", ["\nEND"])
    assert ends_in_stop_prefix("done END more", ["END"])
    assert not ends_in_stop_prefix("the answer is 4", ["\nEND"])
    assert not ends_in_stop_prefix("abc", [""])


def test_a_refusal_is_sglangs_abort_with_a_status():
    msg = rejection("r", "sampling_params.regex='a' is not supported", "ipc://x", 400)
    assert msg.rid == "r" and msg.http_worker_ipc == "ipc://x"
    assert msg.finished_reason == {"type": "abort", "message": "sampling_params.regex='a' is not supported",
                                   "status_code": 400}
