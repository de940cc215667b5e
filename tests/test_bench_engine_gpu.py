"""bench/engine_gpu.py's pieces that decide what its speculative table means: the trained MTP layer is what an
EAGLE/NEXTN row serves, the distillation counts only continuation tokens up to EOS, and no held-out prompt is handed
out twice."""


import pytest
import torch
from transformers import AutoTokenizer

from bench import engine_gpu
from slime_spec.engine.model_executor.cuda_graph import CudaGraphSettings
from slime_spec.engine.model_executor.model import load_model
from slime_spec.speculative.settings import SpecConfig
from slime_spec.tools.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("mimo") / "m", arch="mimo", mtp_layers=1, hidden_size=32,
                           num_layers=2, intermediate_size=64, max_position_embeddings=128)


def test_eagle_rows_serve_the_mtp_layer_trained_in_the_bench(mimo):
    """The rows once served the checkpoint's untrained MTP layer: the weights were loaded only when the drafter
    exposed the target model, which the EAGLE drafter (MTP + history) does not."""
    trained = [(n, torch.randn_like(t)) for n, t in load_model(mimo)[0].state_dict().items() if "mtp_layers" in n]
    for spec, expect_trained in ((SpecConfig("EAGLE", 2, 1, 3), True), (None, False)):
        core = engine_gpu.serving_engine(engine_gpu.Row(mimo, spec, {}, "plain"), 64, device="cpu",
                                         max_running_requests=2, cuda_graph=CudaGraphSettings(disable=True),
                                         mtp_weights=trained)
        served = dict(core.model.state_dict())
        same = [torch.equal(served[n].float(), t.to(torch.bfloat16).float()) for n, t in trained]
        assert all(same) if expect_trained else not any(same)


def test_the_corpus_counts_continuation_positions_up_to_eos(mimo):
    core = engine_gpu.EngineCore(str(mimo), None, context_length=64, max_running_requests=4)
    teacher, _ = load_model(mimo)
    batch = [[5, 6, 7], [8, 9, 10, 11, 12]]
    corpus = engine_gpu.greedy_corpus(core, teacher, batch, new_tokens=6)
    for row, prompt in enumerate(batch):
        valid = corpus.valid[row].tolist()
        first, count = valid.index(True), sum(valid)
        assert first == len(prompt) - 1  # the position whose next token is the first continuation token
        assert valid[first:first + count] == [True] * count  # one run, to the last generated token
        generated = corpus.tokens[row, len(prompt):first + count + 1].tolist()
        assert 1 <= count <= 6 and len(generated) == count
        assert generated[:-1].count(2) == 0  # no EOS (id 2) before the last counted token


def test_held_out_prompts_are_handed_out_once_and_refused_when_spent(mimo):
    task = engine_gpu.ScratchpadTask(AutoTokenizer.from_pretrained(str(mimo)), digits=3)
    seen = [tuple(p) for _ in range(3) for p in task.take(20)]
    assert len(set(seen)) == len(seen) == 60
    assert all(tuple(p) not in set(map(tuple, task.trained_on[3])) for p in seen)
    with pytest.raises(ValueError, match="--repeats or smaller --spec-batches"):
        task.take(2000)
    mixed = task.mixed(400, seed=0)
    short = sum(len(p) == len("1+2=") for p in mixed)
    assert 150 < short < 250  # about half the rollout-shaped batch asks 1-digit sums
