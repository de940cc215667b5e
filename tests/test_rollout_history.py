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
    store = HistoryStore(1, 100)
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


# ---------------------------------------------------------------- keeping engines' corpora in step
import asyncio  # noqa: E402

from slime_spec.rollout.history_sync import REQUEST_EXTENSION, HistorySync  # noqa: E402
from slime_spec.rollout.sample import Sample, Status  # noqa: E402


class SGLangCorpusDouble:
    """Test double of real SGLang 0.5.23's corpus routes (SGLang needs a GPU; it cannot run here): ids are
    unique, and the token budget covers every loaded corpus, as NgramCorpus.remaining_token_budget does."""

    def __init__(self, url: str, budget: int):
        self.url, self.budget, self.corpora, self.calls = url, budget, {}, []

    async def add_external_corpus(self, corpus_id, documents):
        self.calls.append(("add", corpus_id))
        assert corpus_id not in self.corpora, "SGLang refuses an existing id"
        size = sum(len(d) for d in documents) + len(documents) - 1
        assert size <= self.budget - sum(self.corpora.values()), "over SGLang's remaining token budget"
        self.corpora[corpus_id] = size
        return {"success": True}

    async def remove_external_corpus(self, corpus_id):
        self.calls.append(("remove", corpus_id))
        self.corpora.pop(corpus_id, None)
        return {"success": True}


def _samples(rollout_id, responses):
    out = []
    for i, (prompt, text) in enumerate(responses):
        s = Sample(index=i, group_index=prompt[0], prompt="p", tokens=list(prompt), response=text)
        s.tokens += [ord(c) for c in text]
        s.response_length = len(text)
        out.append(s)
    return out


def test_sglang_sync_keeps_one_global_corpus_within_budget():
    store = HistoryStore(epochs=1, max_tokens=100)
    sync = HistorySync(store, "sglang", corpus_max_tokens=12)
    engines = [SGLangCorpusDouble("a", 12), SGLangCorpusDouble("b", 12)]
    first = _samples(0, [([1], "aaaa"), ([1], "bbbb"), ([2], "cccc")])
    first[1].status = Status.ABORTED  # never stored
    asyncio.run(sync.before_rollout(engines, first, 0))
    assert engines[0].calls == [] and REQUEST_EXTENSION not in first[0].metadata  # real SGLang: no extension
    sync.after_rollout(first, 0)
    asyncio.run(sync.before_rollout(engines, _samples(1, [([1], "")]), 1))
    assert engines[0].corpora == {"slime-history/all/1": 9} == engines[1].corpora  # "aaaa" + sep + "cccc"
    sync.after_rollout(_samples(1, [([2], "dddddd")]), 1)
    asyncio.run(sync.before_rollout(engines, [], 2))
    # Removed before the new one is added: both never count against the budget together.
    assert engines[0].calls[-2:] == [("remove", "slime-history/all/1"), ("add", "slime-history/all/2")]
    assert engines[0].corpora == {"slime-history/all/2": 11}  # the newest that fit: "cccc" + sep + "dddddd"


def test_embedded_sync_names_group_and_prompt_corpus_per_request(tmp_path):
    from slime_spec.engine.managers.engine_core import EngineCore
    from slime_spec.speculative.settings import resolve_or_raise
    from slime_spec.tools.tiny_model import make_tiny_model
    engine = EngineCore(str(make_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, seed=1)),
                        resolve_or_raise({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 3}))

    class InProcess:  # the real drafter's corpus calls, without the HTTP hop (tested in test_engine_http_server)
        url = "in-process"

        async def add_external_corpus(self, corpus_id, documents):
            chunks = [engine.tokenizer.encode(d, add_special_tokens=False) for d in documents]
            return {"loaded_token_count": engine.drafter.add_corpus(corpus_id, chunks)}

        async def remove_external_corpus(self, corpus_id):
            engine.drafter.remove_corpus(corpus_id)
            return {}

    store = HistoryStore(epochs=1, max_tokens=100)
    sync = HistorySync(store, "embedded", corpus_max_tokens=10_000)
    step0 = _samples(0, [([7, 8], "hello"), ([9], "world")])
    asyncio.run(sync.before_rollout([InProcess()], step0, 0))
    assert step0[0].metadata[REQUEST_EXTENSION] == {"slime_history": {"group": "0/7"}}
    sync.after_rollout(step0, 0)
    step1 = _samples(1, [([7, 8], "")])
    asyncio.run(sync.before_rollout([InProcess()], step1, 1))
    ext = step1[0].metadata[REQUEST_EXTENSION]["slime_history"]
    assert ext["group"] == "1/7" and ext["corpus_id"] in engine.drafter.list_corpora()
    assert len(engine.drafter.list_corpora()) == 2  # one per prompt
    sync.after_rollout(_samples(1, [([7, 8], "again")]), 1)
    asyncio.run(sync.before_rollout([InProcess()], [], 2))
    assert ext["corpus_id"] not in engine.drafter.list_corpora()  # the old version was removed
    assert len(engine.drafter.list_corpora()) == 2


def test_doctor_accepts_nextn_with_history_on_the_embedded_engine_only():
    """The hybrid MTP + history drafter exists only in the embedded engine; SGLang still needs NGRAM."""
    from slime_spec.doctor.spec_checks import CheckInput, check_history
    nextn = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2, "speculative_eagle_topk": 1,
             "speculative_num_draft_tokens": 3}
    embedded = CheckInput(sglang=nextn, backend="embedded", sglang_version="0.5.23", target_config=None,
                          history_drafting=True)
    assert check_history(embedded) == []
    sglang = CheckInput(sglang=nextn, backend="sglang", sglang_version="0.5.23", target_config=None,
                        history_drafting=True)
    [finding] = check_history(sglang)
    assert finding.code == "SPEC_HISTORY" and "NGRAM" in finding.fix and "embedded" in finding.fix
