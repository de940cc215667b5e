"""Accept length and accept rate, defined once, read from the meta_info keys SGLang 0.5.23 writes."""

from types import SimpleNamespace

import pytest

from slime_spec.speculative.stats import SpecStats, accept_length, accept_rate, mean_accept_length


def sglang_meta_info(monkeypatch, completion_tokens: int, verify_ct: int, correct: int, num_draft_tokens: int) -> dict:
    """The speculative keys SGLang 0.5.23's own TokenizerManager puts into one request's meta_info."""
    from slime_spec.engine.sglang_stand_ins import install
    install()
    from sglang.srt.managers import tokenizer_manager

    monkeypatch.setattr(tokenizer_manager, "get_spec", lambda: SimpleNamespace(
        speculative_num_draft_tokens=num_draft_tokens))
    monkeypatch.setattr(tokenizer_manager, "_ragged_verify_cap_accept", lambda: False)
    recv = SimpleNamespace(spec_verify_ct=[verify_ct], spec_num_correct_drafts=[correct],
                           completion_tokens=[completion_tokens], spec_correct_drafts_histogram=None)
    meta = {"completion_tokens": completion_tokens}
    tokenizer_manager.TokenizerManager._calculate_spec_decoding_metrics(None, meta, recv, 0)
    return meta


def test_definitions_equal_sglangs_own_per_request_ratios(monkeypatch):
    meta = sglang_meta_info(monkeypatch, completion_tokens=30, verify_ct=12, correct=17, num_draft_tokens=4)
    stats = SpecStats.from_meta_info(meta)
    assert (stats.completion_tokens, stats.verify_ct, stats.accept_token_num, stats.draft_token_num) == (30, 12, 17, 36)
    assert stats.accept_length == pytest.approx(meta["spec_accept_length"]) == pytest.approx(30 / 12)
    assert stats.accept_rate == pytest.approx(meta["spec_accept_rate"]) == pytest.approx(17 / 36)


def test_a_request_without_a_verify_pass_has_no_spec_keys_and_counts_as_plain_decoding(monkeypatch):
    meta = sglang_meta_info(monkeypatch, completion_tokens=5, verify_ct=0, correct=0, num_draft_tokens=4)
    assert meta == {"completion_tokens": 5}
    stats = SpecStats.from_meta_info(meta)
    assert (stats.accept_length, stats.accept_rate, stats.draft_token_num) == (1.0, None, None)


def test_the_older_counter_names_are_read_where_0_5_23s_are_absent():
    older = SpecStats.from_meta_info({"completion_tokens": 9, "spec_verify_ct": 3, "spec_accept_token_num": 6,
                                      "spec_draft_token_num": 9})
    both = SpecStats.from_meta_info({"completion_tokens": 9, "spec_verify_ct": 3, "spec_num_correct_drafts": 6,
                                     "spec_accept_token_num": 6, "spec_num_proposed_drafts": 9,
                                     "spec_draft_token_num": 9})
    assert older == both == SpecStats(9, 3, 6, 9)


def test_totals_are_token_weighted_and_differ_from_slimes_per_sample_mean():
    short, long = SpecStats(4, 1, 3, 3), SpecStats(100, 50, 50, 150)  # 4.0 and 2.0 tokens per verify pass
    total = SpecStats.total([short, long])
    assert total.accept_length == pytest.approx(104 / 51)
    assert mean_accept_length([short, long]) == pytest.approx(3.0)
    assert total.accept_rate == pytest.approx(53 / 153)
    # the draft counters are summed over the items that report both, so the rate compares like with like
    assert SpecStats.total([short, SpecStats(10, 5)]) == SpecStats(14, 6, 3, 3)
    assert SpecStats.total([SpecStats(10, 5)]).accept_rate is None
    assert mean_accept_length([SpecStats(7, 0)]) == 1.0 and mean_accept_length([]) == 1.0


def test_the_ratios_alone():
    assert accept_length(10, 4) == 2.5 and accept_length(10, 0) == 1.0
    assert accept_rate(3, 4) == 0.75 and accept_rate(0, 0) is None and accept_rate(None, 4) is None
