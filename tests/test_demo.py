"""The demo's summary of where rollout time went and of accept length (pure functions of the run's metrics)."""

import pytest

from slime_spec.demo.run import format_time_and_accept, online_draft_gain, run_time_and_accept


def test_time_shares_are_weighted_by_rollout_time_and_accept_length_reported_both_ways():
    rollouts = [
        {"rollout_time_s": 1.0, "time_share_engine": 0.9, "time_share_outside_engine": 0.1, "time_share_draft": 0.2,
         "time_share_verify": 0.5, "time_share_sampling": 0.1, "time_share_plain": 0.1, "spec_completion_tokens": 300,
         "spec_verify_ct": 100, "spec_accept_length": 3.5},
        {"rollout_time_s": 3.0, "time_share_engine": 0.5, "time_share_outside_engine": 0.5, "time_share_draft": 0.4,
         "time_share_verify": 0.3, "time_share_sampling": 0.1, "time_share_plain": 0.0, "spec_completion_tokens": 100,
         "spec_verify_ct": 100, "spec_accept_length": 1.5},
    ]
    m = run_time_and_accept(rollouts)
    assert m["time_share_engine"] == pytest.approx((0.9 + 3 * 0.5) / 4)
    assert m["time_share_draft"] == pytest.approx((0.2 + 3 * 0.4) / 4)
    assert m["accept_length_token_weighted"] == pytest.approx(2.0) and m["accept_length_per_sample"] == 2.5
    line = format_time_and_accept(m)
    assert "accept length 2.00 token-weighted, 2.50 per sample" in line
    assert "engine steps 60% (draft 35%, verify 35%, sampling 10%, plain 2% of them)" in line
    assert "outside the engine (HTTP, queues) 40%" in line
    on_gpu = format_time_and_accept(m, device_async=True)  # host times: not said to be where the GPU spent its time
    assert "engine steps 60% (host time by phase, the GPU's work showing where the host waits for it: draft 35%, " \
           "verify 35%, sampling 10%, plain 2%)" in on_gpu


def test_a_run_without_counters_reports_accept_length_only():
    m = run_time_and_accept([{"rollout_time_s": 1.0, "spec_completion_tokens": 10, "spec_verify_ct": 5,
                              "spec_accept_length": 2.0}])
    assert m["time_share_engine"] is None
    assert format_time_and_accept(m) == "accept length 2.00 token-weighted, 2.00 per sample"


def test_online_draft_gain_is_frozen_time_over_online_time_on_the_same_prompts():
    rollouts = [{"rollout_id": 0},
                {"rollout_id": 4, "spec_speedup_spec_s": 2.0, "spec_speedup_frozen_s": 2.2},
                {"rollout_id": 9, "spec_speedup_spec_s": 1.0, "spec_speedup_frozen_s": 1.3}]
    gain = online_draft_gain(rollouts)
    assert gain["online_draft_gain"] == pytest.approx(3.5 / 3.0)
    assert gain["online_draft_gain_each"] == pytest.approx([1.1, 1.3])
    assert online_draft_gain([{"rollout_id": 0}]) == {"online_draft_gain": None, "online_draft_gain_each": []}


def test_bf16_sft_only_where_the_cpu_multiplies_bfloat16_natively():
    from slime_spec.demo.run import cpu_has_bf16
    zen4 = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n"
    sapphire = "flags\t\t: avx2 avx512f amx_bf16 amx_tile\n"
    older = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw\nbugs\t\t: avx512_bf16_lookalike\n"
    assert cpu_has_bf16(zen4) and cpu_has_bf16(sapphire)
    assert not cpu_has_bf16(older) and not cpu_has_bf16("")


def test_gpu_layouts_train_in_bf16_on_one_gpu_each_one_shared_or_two_shared_at_tp2_or_pp2():
    from slime_spec.demo.run import gpu_layout_argv
    split, colocate, tp2 = gpu_layout_argv("split"), gpu_layout_argv("colocate"), gpu_layout_argv("colocate-tp2")
    pp2 = gpu_layout_argv("colocate-pp2")
    for argv, gpus in ((split, "1"), (colocate, "1"), (tp2, "2"), (pp2, "2")):
        assert "--bf16" in argv and argv[argv.index("--sglang-dtype") + 1] == "bfloat16"
        assert argv[argv.index("--rollout-num-gpus") + 1] == gpus
        assert argv[argv.index("--actor-num-gpus-per-node") + 1] == gpus
    assert "--colocate" in colocate and "--colocate" in tp2 and "--colocate" not in split
    assert tp2[tp2.index("--tensor-model-parallel-size") + 1] == "2"
    assert tp2[tp2.index("--rollout-num-engines") + 1] == "2"
    assert pp2[pp2.index("--pipeline-model-parallel-size") + 1] == "2" and "--colocate" in pp2
    assert pp2[pp2.index("--rollout-num-engines") + 1] == "2"
    assert "--tensor-model-parallel-size" not in split + colocate + pp2
    assert gpu_layout_argv(None) == []
    with pytest.raises(ValueError, match="--layout='tp2'"):
        gpu_layout_argv("tp2")


def test_device_and_layout_follow_the_gpus_seen_and_refuse_what_cannot_run():
    from slime_spec.demo.run import resolve_device, resolve_layout
    assert resolve_device("auto", 0) == "cpu" and resolve_device("auto", 2) == "cuda"
    with pytest.raises(ValueError, match="--device cuda: torch sees no CUDA device"):
        resolve_device("cuda", 0)
    assert resolve_layout(None, 2) == "split" and resolve_layout(None, 1) == "colocate"
    assert resolve_layout("colocate", 2) == "colocate"
    with pytest.raises(ValueError, match="--layout split needs two GPUs, and torch sees 1; use --layout colocate"):
        resolve_layout("split", 1)
    with pytest.raises(ValueError, match="--layout colocate-tp2 needs two GPUs"):
        resolve_layout("colocate-tp2", 1)
    assert resolve_layout("colocate-tp2", 2) == "colocate-tp2"
    with pytest.raises(ValueError, match="--layout colocate-pp2 needs two GPUs"):
        resolve_layout("colocate-pp2", 1)
