"""bench/engine.py's row list: rows the embedded engine refuses are skipped with the doctor's reason, the rest run."""

from pathlib import Path

import pytest

from bench import engine


def test_refused_rows_are_skipped_with_the_reason(tmp_path, capsys):
    draft = tmp_path / "draft"
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 4}
    chain = engine.Setting("EAGLE3 chain k=3", engine.eagle3(draft, 3))
    # EAGLE (NEXTN) with an external draft path: the embedded engine refuses it (it drafts with MTP layers)
    refused = engine.Setting("EAGLE with a draft path", {**engine.nextn(2), "speculative_algorithm": "EAGLE",
                                                          "speculative_draft_model_path": str(draft)})
    kept = engine.servable([engine.Setting("plain"), chain, refused], llama, "r")
    assert [s.method for s in kept] == ["plain", "EAGLE3 chain k=3"]
    assert "r: skipping 'EAGLE with a draft path': SPEC_UNSUPPORTED_BY_BACKEND" in capsys.readouterr().out


@pytest.mark.parametrize("topk, tokens", [(1, 4), (4, 16), (8, 32)])
def test_eagle3_rows_have_the_documented_shapes(topk, tokens):
    steps = 3 if topk == 1 else engine.EAGLE3_TREE_STEPS
    args = engine.eagle3(Path("d"), steps, topk)
    assert (args["speculative_eagle_topk"], args["speculative_num_draft_tokens"]) == (topk, tokens)
    assert tokens <= topk * steps + 1  # SGLang's tree-size rule
