"""bench/family_loop_gpu.py: the loop it runs per family and the row it prints (pure parts; the run is the GPU's)."""

from pathlib import Path

from bench import family_loop_gpu as bench


def test_families_with_an_mtp_layer_train_it_and_draft_with_it_others_use_ngram():
    mtp = bench.train_argv(Path("m"), Path("d"), Path("o"), has_mtp=True, device="cpu")
    plain = bench.train_argv(Path("m"), Path("d"), Path("o"), has_mtp=False, device="cpu")
    assert "--enable-mtp-training" in mtp and mtp[mtp.index("--sglang-speculative-algorithm") + 1] == "NEXTN"
    assert "--enable-mtp-training" not in plain and plain[plain.index("--sglang-speculative-algorithm") + 1] == "NGRAM"
    assert "--check-weight-sync" in mtp and "--colocate" not in mtp


def test_on_cuda_the_run_is_colocated_on_one_gpu_in_bfloat16():
    argv = bench.train_argv(Path("m"), Path("d"), Path("o"), has_mtp=True, device="cuda")
    assert argv[argv.index("--actor-num-gpus-per-node") + 1] == argv[argv.index("--rollout-num-gpus") + 1] == "1"
    assert "--colocate" in argv and "--bf16" in argv


def test_a_row_says_what_the_steps_say_or_why_the_run_failed():
    steps = [{"weight_sync_checked": 1, "train_rollout_logprob_abs_diff": 0.01, "spec_accept_length": 1.5,
              "weight_sync_s": 0.2, "grad_norm": 0.0},
             {"weight_sync_checked": 1, "train_rollout_logprob_abs_diff": 0.02, "spec_accept_length": 1.25,
              "weight_sync_s": 0.1, "grad_norm": 0.3}]
    assert bench.summary("qwen3", 0, 12.0, steps, "") == \
        "| qwen3 | exit 0 | 2 | yes | 2.00e-02 | 1.50, 1.25 | 0.20, 0.10 | 12 | policy moved |"
    steps[1]["weight_sync_checked"] = 0
    assert "| NO |" in bench.summary("qwen3", 0, 12.0, steps, "")
    failed = bench.summary("glm4_moe", 1, 3.0, [], "a\nb\nValueError: --x is refused\n")
    assert failed.startswith("| glm4_moe | exit 1 | 0 |") and "ValueError: --x is refused" in failed


def test_the_reward_flag_names_a_function_that_varies_with_the_response():
    from types import SimpleNamespace

    from slime_spec.rollout.rewards import load_function

    argv = bench.train_argv(Path("m"), Path("d"), Path("o"), has_mtp=False, device="cpu")
    reward = load_function(argv[argv.index("--custom-rm-path") + 1], "--custom-rm-path")
    assert reward(SimpleNamespace(response="12ab")) == 0.5 and reward(SimpleNamespace(response="")) == 0.0
