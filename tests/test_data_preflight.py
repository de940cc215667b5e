"""--prompt-data checked line by line before any work: every bad line named with its number and field; labels
converted as slime reads them; the prompts --rollout-max-prompt-len drops counted; the data position a
checkpoint saves continues the stream whatever the batch size."""

from __future__ import annotations

import json

import pytest

from slime_spec.rollout.data import PromptDataError, PromptDataset, read_prompt_rows


class CharTokenizer:
    """Test double for a HF tokenizer: one id per character."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def write_lines(tmp_path, lines: list[bytes | str]) -> str:
    p = tmp_path / "prompts.jsonl"
    p.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    return str(p)


def test_every_bad_line_is_named_with_its_number_and_field(tmp_path):
    path = write_lines(tmp_path, [
        json.dumps({"input": "ok", "label": "1"}),
        "[1, 2]",                                     # 2: not an object
        b'{"input": "caf\xe9", "label": "1"}',         # 3: Latin-1, not UTF-8
        json.dumps({"input": "", "label": "1"}),       # 4: empty prompt
        json.dumps({"input": "q", "label": None}),     # 5: null label
        json.dumps({"input": "q", "label": [7]}),      # 6: a list can never equal a response
        "{not json",                                   # 7
        json.dumps({"label": "1"}),                    # 8: no input
    ])
    with pytest.raises(PromptDataError) as e:
        read_prompt_rows(path, label_key="label")
    msg = str(e.value)
    assert "7 line(s) cannot be used" in msg and "... and 2 more" in msg  # the first five, in file order
    assert "line 2: a JSON list, not an object" in msg and "line 3: not UTF-8" in msg
    assert "line 4: field 'input' is empty" in msg
    assert "line 5: field 'label': the label is null" in msg
    assert "line 6: field 'label': the label is a JSON list ([7])" in msg and "write it as a string" in msg
    fixed = write_lines(tmp_path, ["{not json", json.dumps({"label": "1"})])
    with pytest.raises(PromptDataError) as e:
        read_prompt_rows(fixed, label_key="label")
    assert "line 1: not valid JSON" in str(e.value)
    assert "line 2: no field 'input'" in str(e.value) and "--input-key" in str(e.value)


def test_labels_converted_as_slime_reads_them(tmp_path):
    path = write_lines(tmp_path, [json.dumps({"input": "a", "label": 7}), json.dumps({"input": "b", "label": 2.5}),
                                  json.dumps({"input": "c", "label": True}), json.dumps({"input": "d", "label": "x"})])
    assert [r.label for r in read_prompt_rows(path, label_key="label")] == ["7", "2.5", "True", "x"]
    custom = write_lines(tmp_path, [json.dumps({"input": "a", "label": {"answer": [7]}})])
    assert read_prompt_rows(custom, label_key="label", text_labels=False)[0].label == {"answer": [7]}


def test_prompt_that_renders_to_no_token_is_refused(tmp_path):
    class NoTokens(CharTokenizer):
        def encode(self, text, add_special_tokens=False):
            return []

    with pytest.raises(PromptDataError, match="line 1: field 'input' renders to no token"):
        PromptDataset(write_lines(tmp_path, [json.dumps({"input": "x"})]), NoTokens())


def test_max_prompt_len_drops_are_counted(tmp_path):
    path = write_lines(tmp_path, [json.dumps({"input": "x" * n}) for n in (2, 9, 3, 12)])
    ds = PromptDataset(path, CharTokenizer(), max_prompt_len=5)
    assert ds.filtered_report() == f"--rollout-max-prompt-len 5 leaves out 2 of 4 prompts of {path} (longer than " \
                                   "that); 2 remain"
    assert PromptDataset(path, CharTokenizer()).filtered_report() is None


@pytest.mark.parametrize("shuffle", [False, True])
def test_data_position_resumes_the_stream_whatever_the_batch_size(tmp_path, shuffle):
    path = write_lines(tmp_path, [json.dumps({"input": f"q{i}"}) for i in range(7)])
    first = PromptDataset(path, CharTokenizer(), shuffle=shuffle, seed=3)
    seen = [s.prompt for r in range(3) for s in first.batch(r, 2, 1)]  # 6 prompts with batch size 2
    saved = json.loads(json.dumps(first.position(6)))  # as checkpoint.write_data_position stores it
    assert saved == {"consumed": 6, "epoch": 0, "index": 6, "num_prompts": 7, "shuffle": shuffle, "seed": 3}
    second = PromptDataset(path, CharTokenizer(), shuffle=shuffle, seed=99)  # another seed on the command line
    start, notes = second.resume_at(saved)
    assert start == 6 and bool(notes) == shuffle  # the saved seed is kept, and said so
    rest = [s.prompt for s in second.batch(0, 3, 1, start=start)]  # batch size 3 now
    whole = [s.prompt for s in first.batch(0, 9, 1)]
    assert seen + rest == whole  # nothing skipped, nothing repeated; epoch 1 starts after the 7th
    assert sorted(seen + rest[:1]) == sorted(f"q{i}" for i in range(7))


# ---- the same checks in doctor (and so in training's preflight), before any engine or trainer starts ----

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from slime_spec.tools.tiny_model import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), arch="llama", hidden_size=32, num_layers=1,
                           intermediate_size=64, max_position_embeddings=64, seed=0)


def doctor(tiny, tmp_path, *argv) -> dict[str, list]:
    from slime_spec.config.args import parse
    from slime_spec.doctor.diagnose import diagnose
    _, findings = diagnose(parse(["--hf-checkpoint", str(tiny), "--rollout-backend", "embedded", "--output-dir",
                                  str(tmp_path / "out"), *argv]))
    out: dict[str, list] = {}
    for f in findings:
        out.setdefault(f.code, []).append(f)
    return out


def test_doctor_names_bad_lines_instead_of_a_traceback(tiny, tmp_path):
    path = write_lines(tmp_path, [json.dumps({"input": "1+1="}), "[1]", b'{"input": "\xff"}'])
    (f,) = doctor(tiny, tmp_path, "--prompt-data", path)["PROMPT_DATA_UNREADABLE"]
    assert f.level == "error" and "line 2: a JSON list" in f.message and "line 3: not UTF-8" in f.message


def test_doctor_counts_the_prompts_max_prompt_len_drops(tiny, tmp_path):
    path = write_lines(tmp_path, [json.dumps({"input": "x" * n}) for n in (3, 10, 20, 4)])
    (f,) = doctor(tiny, tmp_path, "--prompt-data", path, "--rollout-max-prompt-len", "8")["PROMPTS_DROPPED"]
    assert f.level == "warning" and "leaves out 2 of 4 prompts" in f.message and "longest has 20 tokens" in f.message
    (f,) = doctor(tiny, tmp_path, "--prompt-data", path, "--rollout-max-prompt-len", "2")["PROMPTS_DROPPED"]
    assert f.level == "error"


def test_a_prompt_longer_than_the_context_gets_a_fix_that_helps(tiny, tmp_path):
    path = write_lines(tmp_path, [json.dumps({"input": "x" * 80}), json.dumps({"input": "short"})])
    (f,) = doctor(tiny, tmp_path, "--prompt-data", path, "--rollout-max-response-len", "16")["SPEC_CONTEXT_LENGTH"]
    assert "leaves no room for a response in the context length 64" in f.message
    assert f.fix.startswith("--rollout-max-prompt-len 48 leaves the longer prompts out")
    assert "--rollout-max-response-len" not in f.fix
    assert "SPEC_CONTEXT_LENGTH" not in doctor(tiny, tmp_path, "--prompt-data", path, "--rollout-max-response-len",
                                               "16", "--rollout-max-prompt-len", "48")


def test_a_prompt_sglangs_scheduler_would_refuse_is_found_though_prompt_and_response_fit(tiny, tmp_path):
    """SGLang refuses a prompt of context length - 6 tokens or more (max_req_input_len), below the context."""
    path = write_lines(tmp_path, [json.dumps({"input": "x" * 58}), json.dumps({"input": "short"})])
    (f,) = doctor(tiny, tmp_path, "--prompt-data", path, "--rollout-max-response-len", "4")["SPEC_CONTEXT_LENGTH"]
    assert "refuses a prompt of 58 tokens or more" in f.message, f.message
    assert f.fix.startswith("--rollout-max-prompt-len 57 leaves the longer prompts out")
    assert "SPEC_CONTEXT_LENGTH" not in doctor(tiny, tmp_path, "--prompt-data", path, "--rollout-max-response-len",
                                               "4", "--rollout-max-prompt-len", "57")


def test_doctor_checks_the_output_dirs_and_room_for_a_checkpoint(tiny, tmp_path, monkeypatch):
    from collections import namedtuple

    from slime_spec.doctor import preflight as run_preflight
    a_file = tmp_path / "file"
    a_file.write_text("x")
    (f,) = doctor(tiny, tmp_path, "--save", str(a_file))["OUTPUT_NOT_WRITABLE"]
    assert f"--save {a_file}: it is a file" in f.message
    need = run_preflight.checkpoint_bytes(run_preflight_config(tiny))
    assert need == run_preflight.model_parameter_count(str(tiny)) * 12  # fp32 weights + two fp32 Adam moments
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(run_preflight.shutil, "disk_usage", lambda p: usage(need * 10, need * 10, need // 2))
    (f,) = doctor(tiny, tmp_path, "--save", str(tmp_path / "ckpt"))["OUTPUT_NO_ROOM"]
    assert f.level == "error" and f"--save {tmp_path / 'ckpt'}" in f.message


def test_doctor_refuses_a_load_save_pair_that_would_overwrite(tiny, tmp_path):
    from slime_spec.trainer import checkpoint
    save = tmp_path / "save"
    save.mkdir()
    checkpoint.mark_latest(save, 4)
    (f,) = doctor(tiny, tmp_path, "--load", str(tmp_path / "nope"), "--save", str(save))["CHECKPOINT_WOULD_OVERWRITE"]
    assert "holds checkpoints up to iteration 4" in f.message


def run_preflight_config(tiny):
    from slime_spec.config.args import parse_config
    return parse_config(["--hf-checkpoint", str(tiny)])[0]


def test_a_response_length_that_fills_the_context_gets_a_fix_that_helps(tiny, tmp_path):
    path = write_lines(tmp_path, [json.dumps({"input": "1+1="})])
    (f,) = doctor(tiny, tmp_path, "--prompt-data", path, "--rollout-max-response-len", "64")["SPEC_CONTEXT_LENGTH"]
    assert "--rollout-max-response-len 64 alone reaches the context length 64" in f.message
    assert f.fix.startswith("lower --rollout-max-response-len to at most 60")
    assert "--rollout-max-prompt-len" not in f.fix
