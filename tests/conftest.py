import collections
import functools
import json
import os
from pathlib import Path

import pytest

from tests.helpers.triton_interpreter import interpreter, run_interpreted  # noqa: F401 (fixtures of kernel tests)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

# SGLANG_ARGS examples as users write them, carried by the repository (tests read nothing outside it).
EXAMPLES = Path(__file__).resolve().parent / "data" / "examples"

# `make test` runs the suite on two pytest-xdist workers. Each test module runs on one worker, so its module fixtures
# start once; the modules that use one of these costly session or package fixtures run on one worker together, so it
# starts once too. (xdist's own `loadgroup` marks do not group under pytest 9, which no longer derives a test's id
# from the `_nodeid` xdist rewrites: the grouping is done here, in the scheduler.)
SHARED_FIXTURE_GROUPS = ("tiny_mimo_engine", "sigterm_mid_training_run")
# Started first, so that the suite ends on short tests on both workers: the end-to-end runs, and the other modules
# that took 90 s or more in a suite run (`--durations`).
STARTED_FIRST = ("tests/e2e/", *SHARED_FIXTURE_GROUPS, "tests/test_engine_weight_updater.py",
                 "tests/test_engines_fleet.py", "tests/test_bench_speedup_noise.py", "tests/test_trainer_ep_loop.py",
                 "tests/test_rollout_manager.py")
_TESTS = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: every collected test is still in `items`
def pytest_collection_modifyitems(config, items):
    """A nightly test names the per-commit test of its capability (`covered_by`, a node id), which must not be
    nightly itself; judged here where both are collected. That every cover exists is checked over the whole suite
    (tests/test_suite_tiers.py), since a run of part of it may leave a cover out."""
    by_id = {item.nodeid: item for item in items}
    for item in items:
        mark = item.get_closest_marker("nightly")
        if mark is None:
            continue
        covered = mark.kwargs.get("covered_by")
        if not isinstance(covered, str) or "::" not in covered:
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.nightly needs covered_by='path::test' (the "
                                    "per-commit test of the same capability)")
        if covered in by_id and by_id[covered].get_closest_marker("nightly") is not None:
            raise pytest.UsageError(f"{item.nodeid}: covered_by {covered!r} is itself nightly")


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # workers share the cores: one intra-op thread each
        import torch

        torch.set_num_threads(1)


@functools.cache
def scheduling_group(module_path: str) -> str:
    """The scheduling unit of a test module (a path relative to the repository, as in a test id)."""
    source = (_TESTS.parent / module_path).read_text()
    return next((f for f in SHARED_FIXTURE_GROUPS if f in source), module_path)


class _FirstThingsFirst(collections.OrderedDict):
    """xdist's work queue (scope -> its tests), handing out STARTED_FIRST scopes first, then the scopes with the
    most tests; the queue's own order breaks ties."""

    def popitem(self, last: bool = True):
        if last:
            return super().popitem(last=True)
        _, scope = min((not scope.startswith(STARTED_FIRST), -len(tests), index, scope)
                       for index, (scope, tests) in enumerate(self.items()))[2:]
        return scope, self.pop(scope)


@pytest.hookimpl(optionalhook=True)  # a run without xdist (-p no:xdist) has no such hook
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        """Scopes are `scheduling_group`s; the queue is _FirstThingsFirst. (Only the queue's order changes: a worker
        is sent indices into its own collection, which must stay as it collected it.)"""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.workqueue = _FirstThingsFirst()

        def _split_scope(self, nodeid: str) -> str:
            return scheduling_group(nodeid.split("::", 1)[0])

    return ModuleGroups(config, log)


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
