"""The rollout-history store: per prompt, the last K rollouts' responses, bounded in tokens, oldest out first."""

import pytest

from slime_spec.rollout.history import HistoryStore, fit_documents, prompt_key


def test_prompt_key_is_stable_and_distinguishes_prompts():
    assert prompt_key([1, 2, 3]) == prompt_key([1, 2, 3])
    assert prompt_key([1, 2, 3]) != prompt_key([1, 23])
    assert prompt_key([12, 3]) != prompt_key([1, 23])


def test_keeps_the_last_k_rollouts_plus_the_current_group():
    store = HistoryStore(epochs=1, max_tokens=100)
    store.add("p", 0, [1, 2])
    store.add("p", 0, [3])
    store.add("p", 1, [4, 5])
    assert store.responses("p") == [(1, 2), (3,), (4, 5)]
    assert store.responses("p", before=1) == [(1, 2), (3,)]
    store.add("p", 2, [6])  # rollout 0 falls out of the window of 1 epoch + the current one
    assert store.responses("p") == [(4, 5), (6,)]
    assert store.responses("other") == []


def test_zero_epochs_keeps_only_the_current_group():
    store = HistoryStore(epochs=0, max_tokens=100)
    store.add("p", 3, [1])
    store.add("p", 4, [2])
    store.add("p", 4, [3])
    assert store.responses("p") == [(2,), (3,)]


def test_token_bound_evicts_oldest_first_and_trims_a_long_response():
    store = HistoryStore(epochs=5, max_tokens=5)
    store.add("p", 0, [1, 2], "ab")
    store.add("p", 1, [3, 4], "cd")
    store.add("p", 2, [5, 6], "ef")
    assert store.responses("p") == [(3, 4), (5, 6)]
    assert store.num_tokens() == 4
    store.add("p", 3, list(range(10, 20)), "long")
    assert store.responses("p") == [(15, 16, 17, 18, 19)]
    assert store.texts("p") == []  # the trimmed tokens no longer match the text
    store.add("q", 3, [], "")
    assert "q" not in store.keys()


def test_changed_keys_are_reported_once():
    store = HistoryStore()
    store.add("a", 0, [1])
    store.add("b", 0, [2])
    assert store.take_changed() == {"a", "b"}
    assert store.take_changed() == set()


def test_fit_documents_keeps_the_newest_within_budget():
    docs, lengths = ["old", "mid", "new"], [4, 3, 2]
    assert fit_documents(docs, lengths, 6) == ["mid", "new"]  # 3 + 1 separator + 2
    assert fit_documents(docs, lengths, 5) == ["new"]
    assert fit_documents(docs, lengths, 1) == []


@pytest.mark.parametrize("epochs,max_tokens,flag", [(-1, 10, "--rollout-history-epochs"),
                                                    (1, 0, "--rollout-history-max-tokens")])
def test_bad_bounds_name_the_flag(epochs, max_tokens, flag):
    with pytest.raises(ValueError, match=flag):
        HistoryStore(epochs, max_tokens)
