"""slime_spec.speculative.settings: SGLang 0.5.23's resolution of the speculative flags, once; and the doctor-code
registry."""

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from slime_spec.doctor.codes import CODES, LEVELS, Rule
from slime_spec.speculative import settings as spec
from slime_spec.speculative.settings import Algorithm, SpecConfig, SpecError, check_resolved, resolve, resolve_or_raise

ROOT = Path(__file__).resolve().parents[1]
MIMO = {"architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": 1}
LLAMA = {"architectures": ["LlamaForCausalLM"]}


def shape(config: SpecConfig) -> tuple:
    return (config.speculative_algorithm, config.speculative_num_steps, config.speculative_eagle_topk,
            config.speculative_num_draft_tokens)


def found(server_args, target=MIMO, backend="sglang"):
    return {f.code: f for f in resolve(server_args, target_config=target, backend=backend)[1]}


def test_algorithm_names_and_aliases():
    assert [a.value for a in Algorithm] == ["EAGLE", "EAGLE3", "STANDALONE", "NGRAM", "FROZEN_KV_MTP", "DFLASH",
                                            "UNO", "DSPARK"]
    assert Algorithm.parse("nextn") is Algorithm.parse("Eagle") is Algorithm.EAGLE
    assert Algorithm.parse("eagle3") is Algorithm.EAGLE3 and f"{Algorithm.NGRAM}" == "NGRAM"
    with pytest.raises(ValueError, match="'FOO'"):
        Algorithm.parse("FOO")
    assert SpecConfig("nextn", 3, 1, 4).speculative_algorithm is Algorithm.EAGLE


def test_algorithms_match_the_installed_sglang():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import _RESERVED_ALIASES

    assert {a.name for a in SpeculativeAlgorithm} - {"NONE"} == {a.value for a in Algorithm}
    assert set(spec.ALIASES) == set(_RESERVED_ALIASES)


def test_defaults_match_the_installed_sglang():
    from sglang.srt.speculative.adaptive_spec_params import DEFAULT_ADAPTIVE_CONFIG

    from slime_spec.engine.server_args import defaults_of, sglang_parser
    defaults = defaults_of(sglang_parser())
    assert defaults["speculative_ngram_max_bfs_breadth"] == spec.NGRAM_MAX_BFS_BREADTH
    assert defaults["speculative_ngram_max_trie_depth"] == spec.NGRAM_MAX_TRIE_DEPTH
    # SpecConfig's fields are SGLang's own dest names: one name from the flag to the drafter.
    assert set(spec.SPEC_DESTS) <= set(defaults)
    assert {int(bs): tuple(t["candidate_steps"]) for bs, t in DEFAULT_ADAPTIVE_CONFIG.items()} == spec.ADAPTIVE_TIERS


def test_resolve_follows_sglang():
    assert resolve({}, target_config=MIMO, backend="embedded") == (None, [])
    eagle = resolve_or_raise({"speculative_algorithm": "eagle"}, target_config=MIMO)
    assert shape(eagle) == ("EAGLE", 3, 1, 4)
    llama = resolve_or_raise({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/d"},
                             target_config=LLAMA, backend="sglang")
    assert shape(llama)[1:] == (5, 4, 8)
    chain, findings = resolve({"speculative_algorithm": "NEXTN", "speculative_num_steps": 2,
                               "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 7},
                              target_config=MIMO, backend="embedded")
    assert chain.speculative_num_draft_tokens == 3  # SGLang adjusts a chain to num_steps + 1
    assert [f.level for f in findings] == ["warning"] and "overrides" in findings[0].message
    # NGRAM: 12 draft tokens by default, top-k = max BFS breadth, num_steps = draft tokens // top-k.
    ngram = resolve_or_raise({"speculative_algorithm": "NGRAM", "speculative_ngram_max_trie_depth": 6},
                             target_config=LLAMA)
    assert (ngram.speculative_num_draft_tokens, ngram.speculative_num_steps, ngram.speculative_eagle_topk,
            ngram.speculative_ngram_max_trie_depth) == (12, 1, 10, 6)
    assert ngram.num_steps == 11  # the embedded engine drafts a chain of 11
    with pytest.raises(SpecError, match="SPEC_STANDALONE_NO_DRAFT: STANDALONE needs --speculative-draft-model-path"):
        resolve_or_raise({"speculative_algorithm": "STANDALONE"}, target_config=LLAMA)
    with pytest.raises(SpecError, match="SPEC_UNSUPPORTED_BY_BACKEND"):
        resolve_or_raise({"speculative_algorithm": "DFLASH"}, target_config=LLAMA)
    with pytest.raises(SpecError, match="together"):
        resolve_or_raise({"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 1}, target_config=MIMO)


def test_unknown_algorithm_recommends_what_the_backend_runs():
    embedded = found({"speculative_algorithm": "EAGLE4"}, backend="embedded")["SPEC_UNKNOWN_ALGORITHM"]
    assert "EAGLE3" in embedded.fix and "NGRAM" in embedded.fix and "DFLASH" not in embedded.fix
    assert "DFLASH" in found({"speculative_algorithm": "EAGLE4"})["SPEC_UNKNOWN_ALGORITHM"].fix


def test_embedded_backend_runs_eagle_eagle3_standalone_ngram_chains_and_trees():
    assert sorted(spec.EMBEDDED_ALGORITHMS) == ["EAGLE", "EAGLE3", "NGRAM", "STANDALONE"]
    assert found({"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "/d"}, backend="embedded") == {}
    for name in ("FROZEN_KV_MTP", "UNO"):
        assert found({"speculative_algorithm": name, "speculative_draft_model_path": "/d"},
                     backend="embedded")["SPEC_UNSUPPORTED_BY_BACKEND"].level == "error"
    tree = found({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/d",
                  "speculative_num_steps": 2, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 4},
                 backend="embedded")
    assert tree == {}  # tree drafting (engine/speculative/tree.py); SGLang's tree-size checks still apply:
    too_big = found({"speculative_algorithm": "EAGLE", "speculative_num_steps": 2, "speculative_eagle_topk": 2,
                     "speculative_num_draft_tokens": 8}, backend="embedded")
    assert too_big["SPEC_TOPK_TOKENS"].level == "error" and "at most 7 nodes" in too_big["SPEC_TOPK_TOKENS"].message
    external = found({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/d"}, backend="embedded")
    assert "STANDALONE" in external["SPEC_UNSUPPORTED_BY_BACKEND"].fix
    assert found({"speculative_algorithm": "NGRAM"}, backend="embedded") == {}  # NGRAM's top-k is not a tree


def test_shape_rules():
    f = found({"speculative_algorithm": "EAGLE", "speculative_num_steps": 3})["SPEC_TOPK_TOKENS"]
    assert f.level == "error" and "TypeError" in f.message and "--sglang-speculative-eagle-topk 1" in f.fix
    f = found({"speculative_algorithm": "EAGLE", "speculative_num_steps": 0, "speculative_eagle_topk": 1})
    assert f["SPEC_TOPK_TOKENS"].level == "error" and ">= 1" in f["SPEC_TOPK_TOKENS"].message
    tree = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "/d", "speculative_num_steps": 3,
            "speculative_eagle_topk": 2}
    assert "without --sglang-speculative-num-draft-tokens" in found(tree)["SPEC_TOPK_TOKENS"].message
    assert found({**tree, "speculative_num_draft_tokens": 3})["SPEC_TOPK_TOKENS"].level == "warning"
    assert "at most 11 nodes" in found({**tree, "speculative_num_draft_tokens": 12})["SPEC_TOPK_TOKENS"].message
    paged = {**tree, "speculative_num_draft_tokens": 8, "page_size": 16}
    assert "refuses torch_native" in found({**paged, "attention_backend": "torch_native"})["SPEC_TOPK_TOKENS"].message
    assert found({**paged, "attention_backend": "fa3"}) == {}
    ngram_paged = {"speculative_algorithm": "NGRAM", "page_size": 16, "attention_backend": "fa3"}
    assert "max-bfs-breadth 10" in found(ngram_paged)["SPEC_TOPK_TOKENS"].message
    assert found(ngram_paged, backend="embedded") == {}  # page size and attention backend are speed-only there
    few = found({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 1}, backend="embedded")
    assert "at least one draft" in few["SPEC_TOPK_TOKENS"].message


def test_drafts():
    assert found({"speculative_algorithm": "NEXTN"}, target=LLAMA)["SPEC_NO_MTP"].level == "error"
    assert "SPEC_NO_MTP" not in found({"speculative_algorithm": "NEXTN"}, target=None)  # unknown target
    assert found({"speculative_algorithm": "EAGLE3"})["SPEC_EAGLE3_NO_DRAFT"].level == "error"
    standalone = found({"speculative_algorithm": "STANDALONE"})
    assert set(standalone) == {"SPEC_STANDALONE_NO_DRAFT"}


def test_adaptive():
    on = {"speculative_algorithm": "EAGLE", "speculative_adaptive": True}
    config, findings = resolve(on, target_config=MIMO, backend="sglang")
    # Starts at the middle of the candidate steps [0, 1, 3, 5, 7], top-k 1, a chain of steps + 1.
    assert shape(config) == ("EAGLE", 3, 1, 4) and config.speculative_adaptive and findings == []
    f = found({**on, "speculative_num_steps": 2, "speculative_eagle_topk": 1})["SPEC_ADAPTIVE"]
    assert f.level == "error" and "[0, 1, 3, 5, 7]" in f.message
    config, findings = resolve({**on, "speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/d"},
                               target_config=MIMO, backend="sglang")
    assert not config.speculative_adaptive and shape(config)[1:] == (3, 1, 4)
    assert findings[0].code == "SPEC_ADAPTIVE" and "only EAGLE/EAGLE3" in findings[0].message
    # Adaptive turned off for top-k 4, then SGLang's assert: top-k without num-steps.
    assert set(found({**on, "speculative_eagle_topk": 4})) == {"SPEC_ADAPTIVE", "SPEC_TOPK_TOKENS"}


def test_adaptive_config_file(tmp_path):
    good = tmp_path / "tiers.json"
    good.write_text('{"1": {"candidate_steps": [2, 4]}, "16": {"candidate_steps": [1]}, "note": "x"}')
    assert spec.adaptive_candidate_steps(str(good)) == [1, 2, 4]
    config = resolve_or_raise({"speculative_algorithm": "EAGLE", "speculative_adaptive": True,
                               "speculative_adaptive_config": str(good)}, target_config=MIMO)
    assert shape(config)[1:] == (2, 1, 3)
    bad = tmp_path / "bad.json"
    bad.write_text('{"1": {"candidate_steps": []}}')
    f = found({"speculative_algorithm": "EAGLE", "speculative_adaptive": True,
               "speculative_adaptive_config": str(bad)})["SPEC_ADAPTIVE"]
    assert f.level == "error" and "non-empty list" in f.message


def test_resolved_configs_are_fixed_points_and_others_are_refused():
    for args, target in (({"speculative_algorithm": "NEXTN"}, MIMO),
                         ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 5,
                           "speculative_ngram_max_bfs_breadth": 2}, LLAMA),
                         ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/d"}, LLAMA)):
        config = resolve_or_raise(args, target_config=target)
        assert resolve_or_raise(config.server_args(), target_config=target) == config
        check_resolved(config, target_config=target)
    with pytest.raises(SpecError, match="not resolved.*speculative_num_steps \\+ 1 = 4"):
        check_resolved(SpecConfig("EAGLE", 3, 1, 6), target_config=MIMO)
    with pytest.raises(SpecError, match="not resolved"):  # NGRAM's top-k is its BFS breadth
        check_resolved(SpecConfig("NGRAM", 11, 1, 12), target_config=LLAMA)
    with pytest.raises(SpecError, match="SPEC_NO_MTP"):
        check_resolved(SpecConfig("EAGLE", 3, 1, 4), target_config=LLAMA)


def test_spec_does_not_import_torch():
    code = ("import sys, slime_spec.speculative.settings, slime_spec.doctor.spec_checks; "
            "assert 'torch' not in sys.modules, 'torch'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ---------------------------------------------------------------- agreement with SGLang's own resolution

SGLANG_CASES = [
    ("LlamaForCausalLM", {"speculative_algorithm": "eagle"}),
    ("MiMoForCausalLM", {"speculative_algorithm": "NEXTN"}),
    ("MiMoForCausalLM", {"speculative_algorithm": "NEXTN", "speculative_num_steps": 3}),
    ("MiMoForCausalLM", {"speculative_algorithm": "NEXTN", "speculative_eagle_topk": 1}),
    ("MiMoForCausalLM", {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2, "speculative_eagle_topk": 1,
                         "speculative_num_draft_tokens": 7}),
    ("MiMoForCausalLM", {"speculative_algorithm": "EAGLE", "speculative_adaptive": True}),
    ("MiMoForCausalLM", {"speculative_algorithm": "EAGLE", "speculative_adaptive": True,
                         "speculative_num_steps": 2}),
    ("MiMoForCausalLM", {"speculative_algorithm": "EAGLE", "speculative_adaptive": True,
                         "speculative_num_steps": 5, "speculative_num_draft_tokens": 2}),
    ("MiMoForCausalLM", {"speculative_algorithm": "EAGLE", "speculative_adaptive": True,
                         "speculative_eagle_topk": 4}),
    ("LlamaForCausalLM", {"speculative_algorithm": "NGRAM"}),
    ("LlamaForCausalLM", {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 5,
                          "speculative_ngram_max_bfs_breadth": 2}),
    ("LlamaForCausalLM", {"speculative_algorithm": "NGRAM", "speculative_num_steps": 4,
                          "speculative_adaptive": True}),
    ("LlamaForCausalLM", {"speculative_algorithm": "STANDALONE"}),
    ("MiMoForCausalLM", {"speculative_algorithm": "STANDALONE", "speculative_adaptive": True}),
    ("Grok1ForCausalLM", {"speculative_algorithm": "EAGLE"}),
    ("LlamaForCausalLM", {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 5,
                          "speculative_eagle_topk": 8, "speculative_num_draft_tokens": 32}),
    ("LlamaForCausalLM", {"speculative_algorithm": "EAGLE", "speculative_num_steps": 2, "speculative_eagle_topk": 4,
                          "speculative_num_draft_tokens": 8, "page_size": 16, "attention_backend": "torch_native"}),
    ("LlamaForCausalLM", {"speculative_algorithm": "EAGLE", "speculative_num_steps": 2, "speculative_eagle_topk": 4,
                          "speculative_num_draft_tokens": 8, "page_size": 16, "attention_backend": "triton"}),
    ("LlamaForCausalLM", {"speculative_algorithm": "FOO"}),
]


def sglang_resolution(monkeypatch, arch: str, server_args: dict):
    """The speculative settings SGLang's own handle_speculative_decoding resolves, or the exception it raises."""
    view = sglang_resolved_view(monkeypatch, arch, server_args)
    if isinstance(view, Exception):
        return view
    return (view.speculative_algorithm, view.speculative_num_steps, view.speculative_eagle_topk,
            view.speculative_num_draft_tokens, view.speculative_adaptive)


def sglang_resolved_view(monkeypatch, arch: str, server_args: dict):
    """SGLang's own handle_speculative_decoding on a ServerArgs: its resolved view, or the exception it raises.

    Two test doubles stand in for what cannot run here: the target's model config (SGLang loads it through
    modules that need torchvision) becomes an object with `architectures`, and the IQuest-Q1 draft hook
    (which imports every model config) reports "not an IQuest model", which is true of every case here.
    """
    import sglang.srt.arg_groups.speculative_hook as hook
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.server_args import ServerArgs

    fake_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(architectures=[arch]))
    monkeypatch.setattr(hook, "model_config_of", lambda server_args: fake_config)
    monkeypatch.setattr(hook, "_handle_iquest_q1_mtp_draft", lambda server_args: False)
    args = ServerArgs(model_path="/nonexistent-target", device="cpu", **{"page_size": 1, **server_args})
    args._resolved_overrides = []
    try:
        hook.handle_speculative_decoding(args)
    except (AssertionError, TypeError, ValueError) as e:
        return e
    return resolved_view(args)


@pytest.mark.parametrize("algorithm", ["NEXTN", "EAGLE3", "STANDALONE", "NGRAM", None])
def test_the_embedded_servers_running_request_limit_is_sglangs(monkeypatch, tmp_path, algorithm):
    """Unset, SGLang resets --max-running-requests to 48 with speculative decoding and leaves it to its KV pool
    without; the embedded server takes SGLang's 48 and keeps its own static-cache default without. Set, it is
    the user's in both."""
    from slime_spec.engine.server_args import PLAIN_MAX_RUNNING_REQUESTS, parse_server_args
    from slime_spec.tools.tiny_model import make_tiny_model

    target = make_tiny_model(tmp_path / "t", arch="mimo" if algorithm == "NEXTN" else "llama", num_layers=2,
                             hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1)
    flags = {"NEXTN": {"speculative_algorithm": "NEXTN", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
                       "speculative_num_draft_tokens": 4},
             "EAGLE3": {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(target)},
             "STANDALONE": {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(target)},
             "NGRAM": {"speculative_algorithm": "NGRAM"}, None: {}}[algorithm]
    if algorithm is None:
        theirs = None  # no speculative hook runs: the limit waits for SGLang's KV pool
    else:
        # without the draft's path: SGLang would read the draft's config through modules that cannot import here
        sglang_flags = {k: v for k, v in flags.items() if k != "speculative_draft_model_path"}
        view = sglang_resolved_view(monkeypatch, "MiMoForCausalLM" if algorithm == "NEXTN" else "LlamaForCausalLM",
                                    sglang_flags)
        assert not isinstance(view, Exception), view
        theirs = view.max_running_requests
    argv = ["--model-path", str(target)] + [t for k, v in flags.items()
                                            for t in (f"--{k.replace('_', '-')}", str(v))]
    ours = parse_server_args(argv, cuda_available=False)
    assert ours.max_running_requests == (PLAIN_MAX_RUNNING_REQUESTS if theirs is None else theirs)
    assert (theirs is not None) == any("reset to 48" in n for n in ours.spec_warnings)
    assert parse_server_args(argv + ["--max-running-requests", "128"], cuda_available=False).max_running_requests \
        == 128


@pytest.mark.parametrize("arch,server_args", SGLANG_CASES)
def test_resolve_agrees_with_sglang(monkeypatch, arch, server_args):
    """Where SGLang fails at start, resolve reports an error; where it resolves, resolve gives the same values."""
    theirs = sglang_resolution(monkeypatch, arch, server_args)
    config, findings = resolve(server_args, target_config={"architectures": [arch], "num_nextn_predict_layers": 1},
                               backend="sglang")
    shape_errors = [f for f in findings if f.level == "error" and f.code not in ("SPEC_EAGLE3_NO_DRAFT",
                                                                                  "SPEC_STANDALONE_NO_DRAFT")]
    if isinstance(theirs, Exception):
        assert shape_errors, (theirs, findings)
        return
    assert not shape_errors, (theirs, findings)
    ours, _ = resolve({**server_args, "speculative_draft_model_path": "/d"},
                      target_config={"architectures": [arch], "num_nextn_predict_layers": 1}, backend="sglang")
    assert (*shape(ours), ours.speculative_adaptive) == theirs


# ---------------------------------------------------------------- the doctor-code registry


def test_registry_rules_are_complete():
    assert all(r.level in LEVELS and re.fullmatch(r"[A-Z][A-Z0-9_]+", r.code) for r in Rule)
    for rule in Rule:  # every template renders with the fields its checks give (none left unfilled)
        fields = set(re.findall(r"{(\w+)", rule.value.message + rule.value.fix)) - {"sg"}
        f = rule.finding(**{k: "X" for k in fields})
        assert f.code == rule.code and "{" not in f.message.replace("{{", "")


# SGLang environment variables the embedded engine honours: code-shaped, but not doctor codes.


def sglang_env_vars() -> set[str]:
    """SGLang's own environment variables, which slime_spec may read or set by name: its registry, and one it
    reads with os.getenv (entrypoints/http_server.py)."""
    from sglang.srt.environ import envs

    return {name for name in dir(envs) if name.startswith("SGLANG_")} | {"SGLANG_HEALTH_CHECK_TIMEOUT"}


def codes_used_in_source() -> set[str]:
    """Every code-like literal in slime_spec/ that a finding or a refusal could carry."""
    pattern = re.compile(r"[\"']((?:SPEC|COLOCATE|MODEL|CONFIG|PROMPT|ARGS|UNKNOWN|SGLANG|TRAINER|FLAG|BACKEND|"
                         r"EMBEDDED)_[A-Z0-9_]+)[\"':]")
    found_codes = set()
    for path in (ROOT / "slime_spec").rglob("*.py"):
        if path.relative_to(ROOT) != Path("slime_spec/doctor/codes.py"):
            found_codes |= set(pattern.findall(path.read_text()))
    return found_codes - sglang_env_vars()


def test_every_code_used_in_slime_spec_is_in_the_registry():
    used = codes_used_in_source()
    assert used - CODES == set()
    # Checks reach codes only through the registry: no Finding is built from a literal code.
    for path in (ROOT / "slime_spec").rglob("*.py"):
        if path.relative_to(ROOT) != Path("slime_spec/doctor/codes.py"):
            assert not re.search(r"Finding\(\s*[\"']", path.read_text()), path


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_speculative_guide_lists_exactly_the_registry(lang):
    text = (ROOT / "docs" / lang / "speculative.md").read_text()
    doc_section = text[text.index("## Doctor " + ("codes" if lang == "en" else "错误码")):]
    listed = set(re.findall(r"^\| `([A-Z][A-Z0-9_]+)` \|", doc_section, flags=re.M))
    assert listed == CODES
    for rule in Rule:  # each code's levels appear in its rows
        rows = re.findall(rf"^\| `{rule.code}` \| (\w+) \|", doc_section, flags=re.M)
        assert rule.level in rows, (rule.code, rule.level, rows)
