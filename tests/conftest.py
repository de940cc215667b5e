import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

# SGLANG_ARGS examples as users write them, carried by the repository (tests read nothing outside it).
EXAMPLES = Path(__file__).resolve().parent / "data" / "examples"


def write_config(dir_: Path, **fields) -> Path:
    """A tiny stand-in config.json (no weights) for checks that read only the config."""
    dir_.mkdir(parents=True, exist_ok=True)
    (dir_ / "config.json").write_text(json.dumps(fields))
    return dir_


@pytest.fixture
def llama8b(tmp_path):
    return write_config(tmp_path / "llama", architectures=["LlamaForCausalLM"], model_type="llama",
                        torch_dtype="bfloat16", max_position_embeddings=131072, hidden_size=4096,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                        intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
                        tie_word_embeddings=False)


@pytest.fixture
def eagle3_draft(tmp_path):
    return write_config(tmp_path / "eagle3", architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                        torch_dtype="float16", max_position_embeddings=2048)


@pytest.fixture
def mimo7b(tmp_path):
    return write_config(tmp_path / "mimo", architectures=["MiMoForCausalLM"], model_type="mimo",
                        torch_dtype="bfloat16", max_position_embeddings=32768, num_nextn_predict_layers=1,
                        hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                        intermediate_size=11008, vocab_size=151680, rope_theta=640000.0, rms_norm_eps=1e-5,
                        tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_mimo_engine(tmp_path_factory):
    """One embedded engine serving a tiny MiMo (tests/helpers/engine_server.py TINY, seed 0; EAGLE over its MTP
    layer) for every module that needs exactly that engine: an engine start costs about 34 CPU-seconds, an idle
    engine next to nothing. Each test takes it back to its checkpoint first (`EngineServer.reset`)."""
    from slime_spec.tools.tiny_model import make_tiny_model
    from tests.helpers.engine_server import EAGLE_FLAGS, TINY, EngineServer

    root = tmp_path_factory.mktemp("tiny_mimo_engine")
    served = make_tiny_model(root / "served", arch="mimo", seed=0, **TINY)
    with EngineServer(served, [*EAGLE_FLAGS, "--random-seed", "0"], log_path=root / "engine.log") as engine:
        yield engine
