"""--bf16: a bfloat16 model with float32 master weights in the optimizer (on CPU too, where it is sound
but slower than float32), and the flags that select packing and precision reach the TrainConfig."""

from __future__ import annotations

import pytest
import torch

from slime_spec.config import flags
from slime_spec.config.args import parse_config
from slime_spec.config.run_config import TrainConfig
from slime_spec.tools.tiny_model import make_tiny_model
from slime_spec.trainer import parallel
from slime_spec.trainer.precision import MasterParams
from slime_spec.trainer.trainer import Trainer
from tests.test_trainer_packing import mixed_rollout


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    parallel.init_single_process(seed=0)
    return make_tiny_model(tmp_path_factory.mktemp("mimo"), arch="mimo", mtp_layers=1, num_layers=2, seed=4)


def config(path, **kw) -> TrainConfig:
    base = dict(hf_checkpoint=str(path), mtp_num_layers=1, enable_mtp_training=True, lr=1e-3, global_batch_size=4,
                micro_batch_size=2, n_samples_per_prompt=2, max_tokens_per_gpu=24)
    return TrainConfig(**{**base, **kw})


def test_flags_reach_the_train_config(mimo7b):
    config_, _ = parse_config(["--hf-checkpoint", str(mimo7b), "--rollout-backend", "embedded", "--bf16",
                               "--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192"])
    assert config_.train.bf16 and config_.train.use_dynamic_batch_size and config_.train.max_tokens_per_gpu == 8192
    assert {"bf16", "max_tokens_per_gpu", "use_dynamic_batch_size"} <= flags.ACTED_ON
    assert flags.NOT_ACTED_ON["fp16"].refuses(True) and "--bf16" in flags.NOT_ACTED_ON["fp16"].fix


def test_master_params_accumulate_and_update_in_float32():
    layer = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    master = MasterParams(list(layer.parameters()))
    assert master.mixed and master.params[0].dtype == torch.float32
    assert torch.equal(master.params[0].to(torch.bfloat16), layer.weight)
    for _ in range(2):  # two micro-batches: each backward adds its gradient into the float32 master at once
        layer(torch.ones(1, 4, dtype=torch.bfloat16)).sum().backward()
        assert layer.weight.grad is None
    assert master.params[0].grad.dtype == torch.float32
    torch.testing.assert_close(master.params[0].grad, torch.full((4, 4), 2.0))
    with torch.no_grad():
        master.params[0].add_(1e-4)  # far below a bfloat16 step at ~0.5: the master keeps it, the model cannot
    master.copy_to_model()
    assert not torch.equal(master.params[0], layer.weight.float())
    assert torch.equal(master.params[0].to(torch.bfloat16), layer.weight)
    fp32 = torch.nn.Linear(2, 2)
    assert MasterParams(list(fp32.parameters())).params[0] is fp32.weight  # float32: no copies


def test_bf16_trainer_keeps_float32_masters_and_tracks_the_float32_step(mimo, tmp_path):
    samples = mixed_rollout(seed=2)
    fp32 = Trainer(config(mimo))
    bf16 = Trainer(config(mimo, bf16=True, save=str(tmp_path)))
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for g in bf16.optimizer.param_groups for p in g["params"])
    g32, g16 = fp32.gradients(samples), bf16.gradients(samples)
    for name in g32:  # the same gradient up to bfloat16 rounding of the forward
        assert g16[name].dtype == torch.float32
        cos = torch.nn.functional.cosine_similarity(g16[name].flatten(), g32[name].flatten(), dim=0)
        assert cos > 0.98, (name, float(cos))
    m32, m16 = fp32.train_step(samples, 0), bf16.train_step(samples, 0)
    assert m16["loss"] == pytest.approx(m32["loss"], abs=0.05)
    assert m16["mtp_loss"] == pytest.approx(m32["mtp_loss"], rel=0.02)
    for p, m in zip(bf16.master.model_params, bf16.master.params):
        assert torch.equal(m.to(torch.bfloat16), p)
    bf16.save(0)
    resumed = Trainer(config(mimo, bf16=True, load=str(tmp_path)))
    assert all(torch.equal(a, b) for a, b in zip(bf16.master.params, resumed.master.params))  # float32 restored
