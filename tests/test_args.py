import argparse
import subprocess
from dataclasses import fields
from pathlib import Path

import pytest

from slime_spec.config import flags
from slime_spec.config.args import ArgsError, parse, parse_config
from slime_spec.config.run_config import (
    ClusterConfig,
    Config,
    RolloutConfig,
    TrainConfig,
    WandbConfig,
    WeightSyncConfig,
    resolve_transport,
)
from tests.conftest import EXAMPLES


def sglang_args_of(example: str) -> list[str]:
    """Expand an SGLANG_ARGS=( ... ) example exactly as bash does."""
    script = (EXAMPLES / example).read_text() + '\nprintf "%s\\n" "${SGLANG_ARGS[@]}"\n'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def test_eagle3_example_round_trips_to_exact_argv(llama8b, eagle3_draft):
    tokens = sglang_args_of("sglang-args-eagle3-llama3.1-8B.sh")
    tokens = [str(eagle3_draft) if t == "/root/sglang-EAGLE3-LLaMA3.1-Instruct-8B" else t for t in tokens]
    config, _ = parse_config(["--hf-checkpoint", str(llama8b), "--rollout-backend", "sglang", *tokens])
    argv = config.engine.server_argv("127.0.0.1", 31000, base_gpu_id=2, python="python3")
    assert argv == [
        "python3", "-m", "sglang.launch_server", "--model-path", str(llama8b), "--trust-remote-code",
        "--host", "127.0.0.1", "--port", "31000", "--tp-size", "1", "--random-seed", "1234", "--base-gpu-id", "2",
        "--mem-fraction-static", "0.8",
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(eagle3_draft),
        "--speculative-num-steps", "5", "--speculative-eagle-topk", "8", "--speculative-num-draft-tokens", "32",
        "--max-running-requests", "48", "--dtype", "float16", "--context-length", "2048",
        "--attention-backend", "fa3",
    ]
    sg = config.engine.server_args
    assert sg["speculative_eagle_topk"] == 8 and sg["context_length"] == 2048 and sg["dtype"] == "float16"
    assert config.cluster.rollout_num_gpus_per_engine == 1


def test_native_mtp_example_round_trips_with_renamed_cuda_graph_flag(mimo7b):
    tokens = sglang_args_of("sglang-args-native-mtp.sh")
    config, parsed = parse_config(["--hf-checkpoint", str(mimo7b), "--rollout-backend", "sglang", *tokens])
    bs = [*range(1, 33), *range(40, 65, 8), *range(80, 161, 16)]
    argv = config.engine.server_argv("127.0.0.1", 30000, python="python3")
    assert argv[argv.index("--random-seed") + 4:] == [
        "--mem-fraction-static", "0.7", "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4", "--attention-backend", "fa3",
        "--cuda-graph-bs-decode", *map(str, bs), "--max-running-requests", "128",
    ]
    # SGLang 0.5.23 split --cuda-graph-bs into -decode/-prefill; the old spelling is translated, not lost.
    assert parsed.renamed == [("--sglang-cuda-graph-bs", "--sglang-cuda-graph-bs-decode")]
    assert config.engine.server_args["cuda_graph_bs_decode"] == bs


def test_embedded_backend_uses_same_flags(mimo7b):
    config, _ = parse_config(["--hf-checkpoint", str(mimo7b), "--rollout-backend", "embedded",
                              "--sglang-speculative-algorithm", "NEXTN", "--rollout-num-engines", "2"])
    argv = config.engine.server_argv("127.0.0.1", 5000, python="python3")
    assert argv[:3] == ["python3", "-m", "slime_spec.engine"]
    assert argv[-2:] == ["--speculative-algorithm", "NEXTN"] and "--base-gpu-id" not in argv
    assert config.num_engines == 2


def test_unknown_sglang_flag_names_closest(mimo7b):
    with pytest.raises(ArgsError, match=r"--sglang-speculative-num-stepz.*did you mean --sglang-speculative-num-steps"):
        parse(["--hf-checkpoint", str(mimo7b), "--sglang-speculative-num-stepz", "3"])


def test_framework_owned_sglang_flag_refused(mimo7b):
    with pytest.raises(ArgsError,
                       match="--sglang-tp-size is not forwarded: it is set from --rollout-num-gpus-per-engine"):
        parse(["--hf-checkpoint", str(mimo7b), "--sglang-tp-size", "2"])


def test_bad_sglang_value_is_refused_by_sglangs_parser(mimo7b):
    with pytest.raises(ArgsError, match="speculative-num-steps"):
        parse(["--hf-checkpoint", str(mimo7b), "--sglang-speculative-num-steps", "three"])


def test_yaml_then_cli_precedence(tmp_path, mimo7b):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"hf-checkpoint: {mimo7b}\nrollout_batch_size: 4\nlr: 0.001\nuse-kl-loss: true\n"
                   "sglang-speculative-algorithm: NGRAM\nrollout-stop: ['a', 'b']\n")
    config, parsed = parse_config(["--config", str(cfg), "--rollout-batch-size", "16",
                                   "--sglang-speculative-algorithm", "NEXTN"])
    assert config.rollout.rollout_batch_size == 16  # CLI wins
    assert config.train.lr == 0.001 and config.train.use_kl_loss  # from YAML
    assert config.rollout.rollout_stop == ("a", "b")
    assert config.engine.server_args["speculative_algorithm"] == "NEXTN"


def test_existing_slime_flags_parse_and_unknown_ones_are_collected(mimo7b):
    slime_script_flags = [
        "--swiglu", "--num-layers", "36", "--hidden-size", "4096", "--ffn-hidden-size", "11008",
        "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
        "--use-rotary-position-embeddings", "--disable-bias-linear", "--add-qkv-bias", "--normalization", "RMSNorm",
        "--norm-epsilon", "1e-05", "--rotary-base", "640000", "--vocab-size", "151680",
        "--untie-embeddings-and-output-weights", "--max-position-embeddings", "32768",
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity", "full",
        "--recompute-method", "uniform", "--recompute-num-layers", "1", "--use-dynamic-batch-size",
        "--max-tokens-per-gpu", "9216", "--optimizer", "adam", "--lr-decay-style", "constant",
        "--eval-prompt-data", "aime", "/root/aime.jsonl", "--kl-loss-type", "low_var_kl", "--balance-data",
        "--attention-backend", "flash", "--accumulate-allreduce-grads-in-fp32", "--some-future-megatron-flag", "7",
    ]
    with pytest.raises(ArgsError, match="unknown flag.*--some-future-megatron-flag.*--allow-unknown-flags"):
        parse_config(["--hf-checkpoint", str(mimo7b), *slime_script_flags])
    config, parsed = parse_config(["--hf-checkpoint", str(mimo7b), *slime_script_flags, "--allow-unknown-flags"])
    assert config.train.tensor_model_parallel_size == 2
    assert config.eval_prompt_data == ("aime", "/root/aime.jsonl")
    assert parsed.unknown_flags == ["--some-future-megatron-flag"]
    assert "recompute_granularity" in parsed.set_flags


def test_missing_hf_checkpoint_is_a_clear_error():
    p = parse(["--rollout-batch-size", "2"])
    from slime_spec.config.args import to_config
    with pytest.raises(ArgsError, match="--hf-checkpoint is required"):
        to_config(p)


def test_help_lists_framework_owned_flags():
    from slime_spec.config.args import build_parser
    text = " ".join(build_parser().format_help().split())
    assert "--tp-size (set from --rollout-num-gpus-per-engine)" in text
    assert "--sglang-<flag>" in text


SUB_CONFIGS = (ClusterConfig, RolloutConfig, TrainConfig, WeightSyncConfig, WandbConfig)


def test_every_config_field_is_a_flag_dest():
    """One name per setting: each field is the dest of the flag it comes from."""
    sub_config_fields = {"cluster", "engine", "rollout", "train", "weight_sync", "wandb"}
    for cls in (*SUB_CONFIGS, Config):
        names = {f.name for f in fields(cls)} - sub_config_fields
        assert names <= set(flags.DEFAULTS), f"{cls.__name__}: {sorted(names - set(flags.DEFAULTS))}"
    assert flags.ACTED_ON <= set(flags.DEFAULTS) and set(flags.MODEL_SHAPE_FLAGS) <= set(flags.DEFAULTS)


def test_config_defaults_are_the_flag_defaults():
    config, _ = parse_config(["--hf-checkpoint", "/m", "--rollout-backend", "embedded"])
    assert config.cluster == ClusterConfig()
    assert config.rollout == RolloutConfig(hf_checkpoint="/m")
    assert config.train == TrainConfig(hf_checkpoint="/m")
    assert config.weight_sync == WeightSyncConfig()
    wandb = WandbConfig(wandb_dir=flags.default("output_dir"))  # wandb's files: under the run's output dir
    assert config.wandb == wandb
    assert config == Config(cluster=ClusterConfig(), engine=config.engine, rollout=RolloutConfig(hf_checkpoint="/m"),
                            train=TrainConfig(hf_checkpoint="/m"), weight_sync=WeightSyncConfig(),
                            wandb=wandb)
    assert config.engine.seed == flags.default("seed") == 1234
    with pytest.raises(KeyError, match="not a flag dest"):
        flags.default("max_concurrency")


def test_derived_values():
    base = ["--hf-checkpoint", "/m", "--rollout-backend", "embedded"]
    config, _ = parse_config([*base, "--rollout-batch-size", "4", "--n-samples-per-prompt", "3", "--colocate",
                              "--loss-type", "sft_loss", "--sglang-server-concurrency", "5"])
    assert config.train.global_batch_size == 12
    assert config.weight_sync.weight_sync_transport == "tensor"
    assert config.train.loss_type == "sft"
    assert config.rollout.sglang_server_concurrency == 5
    config, _ = parse_config([*base, "--global-batch-size", "2", "--colocate", "--weight-sync-transport", "disk"])
    assert config.train.global_batch_size == 2 and config.weight_sync.weight_sync_transport == "disk"
    # slime's --num-steps-per-rollout: the rollout's samples over that many optimizer steps
    config, _ = parse_config([*base, "--rollout-batch-size", "4", "--n-samples-per-prompt", "3",
                              "--num-steps-per-rollout", "3"])
    assert config.train.global_batch_size == 4
    with pytest.raises(ValueError, match="--weight-sync-transport 'nccl': choose distributed, tensor or disk"):
        resolve_transport("nccl", colocate=False)


def test_unknown_flag_stops_with_the_closest_match(mimo7b):
    with pytest.raises(ArgsError, match=r"--rollout-batch-sise; did you mean --rollout-batch-size\?"):
        parse_config(["--hf-checkpoint", str(mimo7b), "--rollout-batch-sise", "4"])
    config, parsed = parse_config(["--hf-checkpoint", str(mimo7b), "--rollout-batch-sise", "4",
                                   "--allow-unknown-flags"])
    assert parsed.unknown_flags == ["--rollout-batch-sise"] and config.rollout.rollout_batch_size == 8


def test_every_flag_is_acted_on_or_classified():
    """Each flag either works (ACTED_ON) or says what ignoring it means (NOT_ACTED_ON): exactly one."""
    assert set(flags.NOT_ACTED_ON) | flags.ACTED_ON == set(flags.DEFAULTS)
    assert not set(flags.NOT_ACTED_ON) & flags.ACTED_ON
    assert all(i.why and (i.accepted is None or i.fix) for i in flags.NOT_ACTED_ON.values())


def test_slime_extension_points_parse_and_are_refused_by_name():
    p = parse(["--rollout-function-path", "my.fn", "--custom-loss-function-path", "my.loss", "--rm-url", "http://x"])
    assert p.unknown_flags == [] and {"rollout_function_path", "custom_loss_function_path", "rm_url"} <= p.set_flags
    for dest in ("rollout_function_path", "custom_loss_function_path", "rm_url"):
        assert flags.NOT_ACTED_ON[dest].refuses(getattr(p.namespace, dest))
    # slime's own default rollout function is what slime-spec's rollout does: accepted
    assert not flags.NOT_ACTED_ON["rollout_function_path"].refuses("slime.rollout.sglang_rollout.generate_rollout")


@pytest.mark.parametrize("size_name", ["smoke", "full"])
def test_demo_argv_parses_and_passes_doctor(tmp_path, mimo7b, size_name):
    from slime_spec.demo.run import SIZES, grpo_argv
    from slime_spec.doctor.diagnose import diagnose
    data = tmp_path / "t.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    argv = grpo_argv(mimo7b, data, data, tmp_path / "run", SIZES[size_name], 0)
    parsed = parse(argv)
    assert parsed.unknown_flags == []
    _, findings = diagnose(parsed, launching=False)
    assert [f for f in findings if f.level == "error"] == []


SLIME_FLAGS = (Path(__file__).parent / "data" / "slime_scripts" / "slime_flags.txt").read_text().split()


def test_every_flag_of_slime_and_its_scripts_parses_and_is_classified():
    """slime_flags.txt: every flag of slime's train.py (slime/utils/arguments.py) and every Megatron flag that
    slime's scripts/*.sh and scripts/models/*.sh pass. Each parses and is acted on or classified."""
    options = {opt for entries in flags.GROUPS.values() for opt, _ in entries}
    options |= {"--no-" + opt[2:] for entries in flags.GROUPS.values() for opt, kw in entries
                if kw.get("action") is argparse.BooleanOptionalAction}
    assert len(SLIME_FLAGS) > 300 and not [f for f in SLIME_FLAGS if f not in options]


def test_did_you_mean_only_for_near_misses_of_our_names(mimo7b):
    base = ["--hf-checkpoint", str(mimo7b)]
    assert parse([*base, "--no-rope-fusion", "--no-position-embedding", "--moe-token-drop-policy", "probs"]) \
        .unknown_flags == []
    with pytest.raises(ArgsError) as e:  # a valid Megatron flag slime's scripts do not pass: no guess
        parse_config([*base, "--no-bias-dropout-fusion"])
    assert "did you mean" not in str(e.value)
    with pytest.raises(ArgsError, match=r"--hiden-size; did you mean --hidden-size\?"):
        parse_config([*base, "--hiden-size", "8"])


def test_colocate_gets_slimes_engine_defaults(mimo7b):
    base = ["--hf-checkpoint", str(mimo7b), "--rollout-backend", "sglang", "--colocate", "--actor-num-gpus-per-node",
            "8", "--rollout-num-gpus-per-engine", "2"]
    config, _ = parse_config(base)
    assert config.cluster.rollout_num_gpus == 8 and config.num_engines == 4  # one engine per 2 of the 8 GPUs
    assert config.engine.forwarded_argv == ("--enable-memory-saver", "--enable-draft-weights-cpu-backup",
                                            "--cuda-graph-backend-prefill", "disabled")
    assert config.engine.server_args["enable_memory_saver"] is True
    config, _ = parse_config([*base, "--no-offload-rollout", "--rollout-num-gpus", "4"])
    assert config.num_engines == 2 and config.engine.forwarded_argv == ("--enable-draft-weights-cpu-backup",)
    config, _ = parse_config([*base, "--sglang-cuda-graph-backend-prefill", "full"])  # the user's choice stays
    assert config.engine.forwarded_argv == ("--cuda-graph-backend-prefill", "full", "--enable-memory-saver",
                                            "--enable-draft-weights-cpu-backup")
    for other in (["--debug-rollout-only"], ["--rollout-backend", "embedded"]):
        config, _ = parse_config([*base, *other])
        assert config.engine.forwarded_argv == ()
    config, _ = parse_config(base[:4] + ["--actor-num-gpus-per-node", "8"])  # not colocated: as given
    assert config.cluster.rollout_num_gpus is None


def test_slime_names_of_weight_sync_flags_act(mimo7b):
    base = ["--hf-checkpoint", str(mimo7b)]
    config, _ = parse_config([*base, "--check-weight-update-equal", "--update-weight-transport", "disk"])
    assert config.weight_sync.check_weight_sync and config.weight_sync.weight_sync_transport == "disk"
    config, _ = parse_config([*base, "--update-weight-transport", "nccl", "--colocate"])
    assert config.weight_sync.weight_sync_transport == "tensor"  # slime's colocated sync: CUDA tensors, not NCCL


def test_wandb_files_go_under_the_output_dir(mimo7b, tmp_path):
    config, _ = parse_config(["--hf-checkpoint", str(mimo7b), "--output-dir", str(tmp_path / "run")])
    assert config.wandb.wandb_dir == str(tmp_path / "run")
    config, _ = parse_config(["--hf-checkpoint", str(mimo7b), "--wandb-dir", str(tmp_path / "w")])
    assert config.wandb.wandb_dir == str(tmp_path / "w")


def test_slimes_tis_whitening_and_dual_clip_flags_reach_the_trainer(mimo7b):
    config, _ = parse_config(["--hf-checkpoint", str(mimo7b), "--use-tis", "--tis-clip", "1.5",
                              "--tis-clip-low", "0.5"])
    assert (config.train.use_tis, config.train.tis_clip, config.train.tis_clip_low) == (True, 1.5, 0.5)
    defaults, _ = parse_config(["--hf-checkpoint", str(mimo7b)])
    assert (defaults.train.use_tis, defaults.train.tis_clip, defaults.train.tis_clip_low) == (False, 2.0, 0.0)
    assert not defaults.train.normalize_advantages and defaults.train.eps_clip_c is None
    assert parse_config(["--hf-checkpoint", str(mimo7b), "--eps-clip-c", "3"])[0].train.eps_clip_c == 3.0
    train = parse_config(["--hf-checkpoint", str(mimo7b), "--disable-rewards-normalization",
                          "--disable-grpo-std-normalization"])[0].train
    assert train.disable_rewards_normalization and train.disable_grpo_std_normalization
    assert parse_config(["--hf-checkpoint", str(mimo7b), "--normalize-advantages"])[0].train.normalize_advantages
