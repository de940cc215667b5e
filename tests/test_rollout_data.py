import json

import pytest
import torch

from slime_spec.config.run_config import RolloutConfig
from slime_spec.rollout.data import PromptDataError, PromptDataset
from slime_spec.rollout.debug_data import load_rollout, save_rollout
from slime_spec.rollout.sample import Sample, SpecStats, Status
from slime_spec.rollout.sampling_params import sampling_params


class CharTokenizer:
    """Test double for a HF tokenizer: one id per character, a fixed chat template."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def _write(tmp_path, rows):
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(p)


def test_batches_wrap_and_group(tmp_path):
    path = _write(tmp_path, [{"input": f"q{i}", "label": str(i)} for i in range(5)])
    ds = PromptDataset(path, CharTokenizer(), label_key="label")
    b0 = ds.batch(0, 3, 2)
    assert [s.group_index for s in b0] == [0, 0, 1, 1, 2, 2]
    assert [s.index for s in b0] == list(range(6))
    assert [s.prompt for s in b0[::2]] == ["q0", "q1", "q2"]
    assert b0[0].tokens == [ord("q"), ord("0")] and b0[0].label == "0"
    b1 = ds.batch(1, 3, 1)  # positions 3, 4, then epoch 1 wraps to q0
    assert [s.prompt for s in b1] == ["q3", "q4", "q0"]
    assert b1[2].metadata["epoch"] == 1


def test_shuffle_is_seeded_per_epoch(tmp_path):
    path = _write(tmp_path, [{"input": f"q{i}"} for i in range(20)])
    a = PromptDataset(path, CharTokenizer(), shuffle=True, seed=1)
    b = PromptDataset(path, CharTokenizer(), shuffle=True, seed=1)
    c = PromptDataset(path, CharTokenizer(), shuffle=True, seed=2)
    prompts = lambda ds, r: [s.prompt for s in ds.batch(r, 20, 1)]  # noqa: E731
    assert prompts(a, 0) == prompts(b, 0) != prompts(c, 0)
    assert sorted(prompts(a, 0)) == sorted(prompts(a, 1)) and prompts(a, 0) != prompts(a, 1)


def test_chat_template_and_errors(tmp_path):
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    path = _write(tmp_path, [{"q": "hi"}, {"q": chat}])
    ds = PromptDataset(path, CharTokenizer(), input_key="q", apply_chat_template=True)
    assert [p.text for p in ds.prompts] == ["<user>hi<assistant>", "<system>s<user>u<assistant>"]
    with pytest.raises(ValueError, match="--apply-chat-template"):
        PromptDataset(path, CharTokenizer(), input_key="q")
    with pytest.raises(PromptDataError, match="--input-key"):
        PromptDataset(path, CharTokenizer(), input_key="input")
    with pytest.raises(PromptDataError, match="--label-key"):
        PromptDataset(path, CharTokenizer(), input_key="q", apply_chat_template=True, label_key="answer")
    with pytest.raises(FileNotFoundError, match="--prompt-data"):
        PromptDataset(str(tmp_path / "none.jsonl"), CharTokenizer())


def test_max_prompt_len_filters(tmp_path):
    path = _write(tmp_path, [{"input": "short"}, {"input": "a much longer prompt"}])
    ds = PromptDataset(path, CharTokenizer(), max_prompt_len=6)
    assert len(ds) == 1 and ds.num_filtered == 1


def test_sampling_params_match_slime():
    cfg = RolloutConfig(hf_checkpoint="x", rollout_temperature=0.7, rollout_top_p=0.9, rollout_top_k=5,
                        rollout_max_response_len=33, rollout_stop=("\n\n",), rollout_stop_token_ids=(2,))
    p = sampling_params(cfg)
    assert p == dict(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=33, stop=["\n\n"], stop_token_ids=[2],
                     skip_special_tokens=False, no_stop_trim=True, spaces_between_special_tokens=False)
    with pytest.raises(ValueError, match="--rollout-max-response-len"):
        sampling_params(RolloutConfig(hf_checkpoint="x", rollout_max_response_len=0))


def test_save_load_roundtrip(tmp_path):
    samples = [Sample(index=i, group_index=i // 2, prompt="p", label="l", tokens=[1, 2, 3, 4], response="ab",
                      response_length=2, rollout_log_probs=[-0.5, -0.25], reward=1.0,
                      status=[Status.COMPLETED, Status.TRUNCATED, Status.ABORTED][i % 3],
                      error="boom" if i % 3 == 2 else None, meta_info={"spec_verify_ct": 1},
                      spec=SpecStats(2, 1, 1, 3), engine_index=i % 2, metadata={"k": [i]}) for i in range(4)]
    template = str(tmp_path / "d" / "rollout_{rollout_id}.pt")
    path = save_rollout(template, 3, samples, {"x": 1})
    assert path.name == "rollout_3.pt"
    assert load_rollout(template, 3) == samples
    assert torch.load(path, weights_only=False)["metrics"] == {"x": 1}
    with pytest.raises(FileNotFoundError, match="--save-debug-rollout-data"):
        load_rollout(template, 4)
    with pytest.raises(ValueError, match="rollout_id"):
        save_rollout(str(tmp_path / "fixed.pt"), 0, samples)


def test_manager_replays_saved_rollout_without_engines(tmp_path):
    import asyncio

    from slime_spec.config.run_config import EngineConfig
    from slime_spec.rollout.manager import RolloutManager
    samples = [Sample(index=i, group_index=i, prompt="p", tokens=[1, 2, 3], response_length=1,
                      spec=SpecStats(1, 1)) for i in range(3)]
    template = str(tmp_path / "rollout_{rollout_id}.pt")
    save_rollout(template, 2, samples)
    m = RolloutManager(RolloutConfig(hf_checkpoint="x", load_debug_rollout_data=template),
                       EngineConfig(backend="embedded", model_path="x"), 1)
    assert m.engines() == [] and asyncio.run(m.generate(2)) == samples
    assert m.get_last_metrics()["num_samples"] == 3


def test_sglang_router_asked_but_not_installed(tmp_path):
    import importlib.util

    from slime_spec.config.run_config import EngineConfig
    from slime_spec.rollout.manager import RolloutManager
    if importlib.util.find_spec("sglang_router") is not None:
        pytest.skip("sglang-router is installed here: the missing-package error cannot happen")
    with pytest.raises(ImportError, match="--use-sglang-router.*not installed"):
        RolloutManager(RolloutConfig(hf_checkpoint="x", use_sglang_router=True),
                       EngineConfig(backend="embedded", model_path="x"), 1)


def test_fresh_copy_shares_no_mutable_state():
    from slime_spec.rollout.sample import fresh_copy
    s = Sample(index=0, group_index=0, prompt="p", tokens=[1], rollout_log_probs=[-1.0], loss_mask=[1],
               meta_info={"a": [1]}, spec=SpecStats(1, 1), metadata={"k": [1]})
    c = fresh_copy(s)
    assert c == s
    c.tokens.append(2), c.rollout_log_probs.append(0.0), c.loss_mask.append(0), c.meta_info["a"].append(2)
    c.spec.add_meta_info({"completion_tokens": 3, "spec_verify_ct": 1}), c.metadata["k"].append(2)
    assert s == Sample(index=0, group_index=0, prompt="p", tokens=[1], rollout_log_probs=[-1.0], loss_mask=[1],
                       meta_info={"a": [1]}, spec=SpecStats(1, 1), metadata={"k": [1]})
