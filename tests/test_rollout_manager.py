"""RolloutManager on real Ray with embedded engines (tiny models): rollouts, metrics, replay, faults."""

import json
import os
import textwrap

import pytest
import ray

from slime_spec.config.run_config import EngineConfig, RolloutConfig
from slime_spec.fleet.client import EngineError
from slime_spec.rollout.debug_data import load_rollout
from slime_spec.rollout.manager import RolloutFailed, RolloutManagerActor, check_not_all_failed
from slime_spec.rollout.metrics import REQUIRED_KEYS
from slime_spec.rollout.sample import Sample, Status
from slime_spec.tools.tiny_model import make_tiny_model

BATCH, N_SAMPLES, MAX_LEN = 4, 2, 12


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    make_tiny_model(root / "llama", arch="llama", seed=0)
    (root / "prompts.jsonl").write_text("\n".join(json.dumps({"input": f"{i}+{i}=", "label": str(2 * i)})
                                                  for i in range(6)) + "\n")
    # Test hook for the fault tests, a generate function that generates as usual unless armed:
    # with a PID in `kill_pid`, it SIGKILLs that engine server while the rollout's first requests are
    # in flight; with `overlong` present, sample 1's prompt exceeds the context (the engine answers 400);
    # with `all_overlong` present, every sample's does.
    (root / "rollout_fault_hook.py").write_text(textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from slime_spec.rollout.generate import default_generate
        PID_FILE, OVERLONG = Path({str(root / "kill_pid")!r}), Path({str(root / "overlong")!r})
        ALL_OVERLONG = Path({str(root / "all_overlong")!r})
        async def generate_killing_engine(client, sample, sampling_params):
            if sample.index == 3 and PID_FILE.exists():
                pid = int(PID_FILE.read_text())
                PID_FILE.unlink()
                os.kill(pid, signal.SIGKILL)
            if (sample.index == 1 and OVERLONG.exists()) or ALL_OVERLONG.exists():
                sample.tokens = sample.tokens * 1000
            return await default_generate(client, sample, sampling_params)
    """))
    # Two logical GPUs: the manager below takes the GPU placement path (a placement group of one-GPU
    # bundles, one engine per bundle, CUDA_VISIBLE_DEVICES from the bundle); the servers still run on CPU.
    if ray.is_initialized():  # another module's cluster: this module needs its own resources
        ray.shutdown()
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(root)}})
    yield root
    ray.shutdown()


@pytest.fixture(scope="module")
def managers(workdir):
    """The manager most tests share, and one whose engine fails at start (both start at once, to save time)."""
    rollout = RolloutConfig(
        hf_checkpoint=str(workdir / "llama"), prompt_data=str(workdir / "prompts.jsonl"), label_key="label",
        rm_type="math", rollout_batch_size=BATCH, n_samples_per_prompt=N_SAMPLES, rollout_max_response_len=MAX_LEN,
        sglang_server_concurrency=2, metrics_jsonl=str(workdir / "metrics.jsonl"),
        save_debug_rollout_data=str(workdir / "debug" / "rollout_{rollout_id}.pt"),
        custom_generate_function_path="rollout_fault_hook.generate_killing_engine")
    engine = EngineConfig(backend="embedded", model_path=str(workdir / "llama"),
                          forwarded_argv=("--speculative-algorithm", "NGRAM"))
    good = RolloutManagerActor.options(num_cpus=0).remote(rollout, engine, 2, log_dir=str(workdir / "logs"),
                                                          rollout_num_gpus=2, show_progress=False,
                                                          eval_prompt_data=("arith", str(workdir / "prompts.jsonl")))
    bad_engine = EngineConfig(backend="embedded", model_path=str(workdir / "llama"),
                              forwarded_argv=("--speculative-algorithm", "NOT_AN_ALGORITHM"))
    bad = RolloutManagerActor.options(num_cpus=0).remote(
        RolloutConfig(hf_checkpoint=str(workdir / "llama"), engine_start_timeout=120), bad_engine, 1,
        log_dir=str(workdir / "bad_logs"))
    # The grouped manager's prompts: its rollout 1 holds prompt 5, past the engine's context
    lines = [json.dumps({"input": ("9" * 3000 if i == 5 else f"{i}+{i}="), "label": str(2 * i)}) for i in range(8)]
    (workdir / "group_prompts.jsonl").write_text("\n".join(lines) + "\n")
    grouped = RolloutManagerActor.options(num_cpus=0).remote(  # the default generate function: a group per request
        RolloutConfig(hf_checkpoint=str(workdir / "llama"), prompt_data=str(workdir / "group_prompts.jsonl"),
                      label_key="label", rm_type="math", rollout_batch_size=BATCH, n_samples_per_prompt=N_SAMPLES,
                      rollout_max_response_len=MAX_LEN),
        EngineConfig(backend="embedded", model_path=str(workdir / "llama")), 1, log_dir=str(workdir / "group_logs"),
        show_progress=False)
    yield good, bad, grouped
    ray.get([good.shutdown.remote(), grouped.shutdown.remote()])


@pytest.fixture(scope="module")
def manager(managers):
    return managers[0]


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _server_env(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)


def test_engines_get_their_bundle_gpu(manager):
    pids = [ray.get(e.pid.remote()) for e in ray.get(manager.engines.remote())]
    assert sorted(_server_env(pid)[b"CUDA_VISIBLE_DEVICES"] for pid in pids) == [b"0", b"1"]


def test_generate_metrics_and_replay(manager, workdir):
    samples = ray.get(manager.generate.remote(0))
    metrics = ray.get(manager.get_last_metrics.remote())
    assert len(samples) == BATCH * N_SAMPLES
    assert [s.group_index for s in samples] == [g for g in range(BATCH) for _ in range(N_SAMPLES)]
    for s in samples:
        assert s.status in (Status.COMPLETED, Status.TRUNCATED) and s.error is None
        assert 0 < s.response_length <= MAX_LEN
        assert len(s.rollout_log_probs) == s.response_length == len(s.tokens) - s.prompt_length
        assert all(lp <= 0 for lp in s.rollout_log_probs)
        assert s.spec.completion_tokens == s.response_length and s.spec.verify_ct >= 1
        assert s.reward in (0.0, 1.0)
    assert {s.engine_index for s in samples} == {0, 1}  # least-loaded routing used both engines
    assert set(REQUIRED_KEYS) <= set(metrics)
    assert metrics["response_tokens"] == sum(s.response_length for s in samples) == metrics["spec_completion_tokens"]
    assert metrics["spec_verify_ct"] == sum(s.spec.verify_ct for s in samples)
    assert metrics["spec_accept_length"] >= 1.0 and metrics["spec_accept_length_token_weighted"] >= 1.0
    assert metrics["engine_0/num_samples"] + metrics["engine_1/num_samples"] == len(samples)
    assert metrics["engine_restarts"] == 0
    line = json.loads((workdir / "metrics.jsonl").read_text().splitlines()[0])
    assert line["rollout_id"] == 0 and line["response_tokens"] == metrics["response_tokens"]
    assert load_rollout(str(workdir / "debug" / "rollout_{rollout_id}.pt"), 0) == samples


def test_group_samples_differ_across_engines_at_temperature_one(manager):
    """Engine i runs with --random-seed seed + i: the n samples of one GRPO group, spread over two engines (one
    request per sample, as a custom generate function sends them), must not be the same draws (with one seed for
    all, two fresh engines answer one prompt identically)."""
    engines = ray.get(manager.engines.remote())
    seeds = [ray.get(e.server_info.remote())["random_seed"] for e in engines]
    assert seeds == [1234, 1235]
    samples = ray.get(manager.generate.remote(4))
    for g in range(BATCH):
        group = [s for s in samples if s.group_index == g]
        assert len(group) == N_SAMPLES and all(s.weight_version == "default" for s in group)
        if len({s.engine_index for s in group}) > 1:
            assert len({tuple(s.tokens) for s in group}) == N_SAMPLES, f"group {g} drew identical samples"


def test_the_default_generate_sends_each_group_as_one_batched_request(managers, workdir):
    grouped = managers[2]
    ray.get(grouped.engine_urls.remote())  # its engine ready: SGLang's warm-up /generate at start is in the log
    log = workdir / "group_logs" / "engine_0.log"
    posts_before = log.read_text().count("POST /generate ")
    samples = ray.get(grouped.generate.remote(0))
    assert log.read_text().count("POST /generate ") - posts_before == BATCH  # SGLang's access log: one per group
    assert [s.group_index for s in samples] == [g for g in range(BATCH) for _ in range(N_SAMPLES)]
    for s in samples:
        assert s.status in (Status.COMPLETED, Status.TRUNCATED) and s.error is None, s.error
        assert 0 < s.response_length <= MAX_LEN and s.engine_index == 0 and s.weight_version == "default"
        assert len(s.rollout_log_probs) == s.response_length == len(s.tokens) - s.prompt_length
        assert s.reward in (0.0, 1.0)
    for g in range(BATCH):  # the group's samples are separate draws, not one answer repeated
        assert len({tuple(s.tokens) for s in samples if s.group_index == g}) == N_SAMPLES


def test_a_group_whose_batched_request_fails_goes_one_request_per_sample(managers):
    samples = ray.get(managers[2].generate.remote(1))  # prompts 4-7; prompt 5 is past the context
    failed = [s for s in samples if s.status == Status.ABORTED]
    assert [s.group_index for s in failed] == [1] * N_SAMPLES  # the rollout's second group
    assert all("request failed" in s.error and "400" in s.error for s in failed), [s.error for s in failed]
    assert all(s.status != Status.ABORTED and s.response_length > 0 for s in samples if s.group_index != 1)


def test_killed_engine_is_restarted_and_nothing_is_lost(manager, workdir):
    engines = ray.get(manager.engines.remote())
    old_pid = ray.get(engines[0].pid.remote())
    (workdir / "kill_pid").write_text(str(old_pid))
    samples = ray.get(manager.generate.remote(1))
    metrics = ray.get(manager.get_last_metrics.remote())
    assert not (workdir / "kill_pid").exists()  # the hook fired during this rollout
    assert not _pid_alive(old_pid)
    new_pid = ray.get(engines[0].pid.remote())
    assert new_pid != old_pid and _pid_alive(new_pid)
    assert len(samples) == BATCH * N_SAMPLES and [s.index for s in samples] == list(range(len(samples)))
    assert all(s.status != Status.ABORTED and s.response_length > 0 for s in samples), [s.error for s in samples]
    assert any(s.metadata.get("attempts", 1) > 1 for s in samples)  # some requests were resubmitted
    assert metrics["engine_restarts"] == 1 and metrics["engine_restarts_total"] == 1
    # the restarted engine serves the next rollout
    after = ray.get(manager.generate.remote(2))
    assert all(s.status != Status.ABORTED for s in after)
    assert ray.get(manager.get_last_metrics.remote())["engine_restarts"] == 0


def test_request_failing_every_time_ends_aborted(manager, workdir):
    (workdir / "overlong").write_text("")
    try:
        samples = ray.get(manager.generate.remote(3))
    finally:
        (workdir / "overlong").unlink()
    bad = samples[1]
    assert bad.status == Status.ABORTED and bad.reward == 0.0 and bad.response_length == 0
    assert "failed 4 times" in bad.error and "HTTP 400" in bad.error
    assert all(s.status != Status.ABORTED for s in samples if s.index != 1)
    metrics = ray.get(manager.get_last_metrics.remote())
    assert metrics["aborted"] == 1 and metrics["engine_restarts"] == 0


def test_a_rollout_whose_samples_all_fail_raises_naming_the_cause(manager, workdir):
    (workdir / "all_overlong").write_text("")
    try:
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(manager.generate.remote(5))
    finally:
        (workdir / "all_overlong").unlink()
    assert isinstance(info.value.as_instanceof_cause(), RolloutFailed)
    assert f"all {BATCH * N_SAMPLES} samples of rollout 5 failed" in str(info.value) and "HTTP 400" in str(info.value)
    assert all(s.status != Status.ABORTED for s in ray.get(manager.generate.remote(6)))  # the manager still serves


def test_engine_command_lines_are_written_once_to_the_log_dir(manager, workdir):
    lines = (workdir / "logs" / "engine_commands.txt").read_text().splitlines()
    assert [x.split(":")[0] for x in lines] == ["engine 0", "engine 1"]
    assert all("-m slime_spec.engine --model-path" in x and "--speculative-algorithm NGRAM" in x for x in lines)


def test_progress_off_a_terminal_is_one_line_per_rollout():
    """Under Ray stderr is a file: a tqdm bar would print a line per refresh; one line per rollout instead."""
    import io
    import time

    from slime_spec.rollout.progress import progress_bar, progress_done
    stream = io.StringIO()  # not a tty, like a Ray worker's stderr
    bar = progress_bar(50, "rollout 7", True, stream)
    for _ in range(50):
        bar.update(1)
        time.sleep(0.03)  # 1.5 s: a terminal bar (mininterval 1 s) would have redrawn
    progress_done(bar, "rollout 7", stream, 1.5)
    assert stream.getvalue().splitlines() == ["rollout 7: 50/50 samples in 1.5s"]
    quiet = io.StringIO()
    progress_done(progress_bar(3, "eval", False, quiet), "eval", quiet, 0.1)
    assert quiet.getvalue() == ""


def test_all_failed_names_the_first_error_and_the_api_key_fix():
    err = EngineError("http://127.0.0.1:1", "/generate", 401, '{"error": "Unauthorized"}')
    samples = [Sample(index=i, group_index=0, prompt="p", status=Status.ABORTED, error=f"request failed: {err}")
               for i in range(3)]
    with pytest.raises(RolloutFailed, match="all 3 samples of rollout 0 failed.*HTTP 401.*--sglang-api-key"):
        check_not_all_failed(samples, "rollout 0")
    samples[1].status = Status.COMPLETED
    check_not_all_failed(samples, "rollout 0")  # one sample made it: the rollout goes on
    check_not_all_failed([], "rollout 0")


def test_eval_after_pause_and_memory_release(manager):
    ray.get(manager.pause.remote())
    ray.get(manager.resume.remote())
    ray.get(manager.release_memory.remote())
    ray.get(manager.resume_memory.remote())
    out = ray.get(manager.eval.remote(5))
    assert out["eval/arith/num_samples"] == 6 and out["eval/arith/spec_accept_length"] >= 1.0
    assert out["eval/arith/aborted"] == 0


def test_engine_that_fails_at_start_reports_log_tail(managers):
    with pytest.raises(ray.exceptions.RayActorError) as e:
        ray.get(managers[1].engine_urls.remote())
    msg = str(e.value)
    assert "exited before becoming healthy" in msg and "slime-spec doctor" in msg
    assert "NOT_AN_ALGORITHM" in msg.split("last 40 lines of the server log")[1]  # the server's own words
