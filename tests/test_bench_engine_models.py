"""bench/engine_models.py's EAGLE3 builder: a draft trained on a target's own outputs learns (its training-time-test
loss falls) and is written in SGLang's EAGLE3 layout, loadable by the engine."""

from pathlib import Path

import torch

from bench import engine_models
from slime_spec.common import eagle3_draft
from slime_spec.engine.model_executor.model import load_model
from slime_spec.tools.tiny_model import LLAMA31_ROPE_SCALING, make_tiny_model


def test_eagle3_draft_learns_from_the_targets_own_outputs(tmp_path):
    torch.manual_seed(0)
    target = make_tiny_model(tmp_path / "target", arch="llama", hidden_size=32, num_layers=4, intermediate_size=64,
                             max_position_embeddings=128, rope_scaling=LLAMA31_ROPE_SCALING)
    prompts = [[5 + i, 6 + i, 7] for i in range(16)]
    own = engine_models.sample_outputs(target, prompts, max_new=16, seed=0)
    assert all(len(seq) > n for seq, n in own)
    out = engine_models.train_eagle3_draft(target, own, tmp_path / "draft", steps=12, lr=1e-2, draft_vocab=60)

    model, _ = load_model(target)
    ids, mask = engine_models.batch_tensors(own)

    def loss_of(path: Path) -> float:
        draft = eagle3_draft.load_draft(path, model.args.num_layers)
        aux_ids = eagle3_draft.aux_layer_ids(draft.config, model.args.num_layers)
        with torch.no_grad():
            return float(engine_models.eagle3_loss(draft, aux_ids, ttt_steps=3)(model, ids, mask))

    before, after = loss_of(tmp_path / "draft_init"), loss_of(out)
    assert after < 0.8 * before, (before, after)
    config = eagle3_draft.read_draft_config(out)
    assert config["draft_vocab_size"] == 60 and config["target_hidden_size"] == 32
