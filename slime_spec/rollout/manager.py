"""`RolloutManager`: turns a rollout id into a list of finished `Sample`s, over an `EngineFleet`.

One Ray actor (async). Its `EngineFleet` (fleet/fleet.py) starts and owns the engines, routes
(least-loaded, at most `--sglang-server-concurrency` in flight per engine), restarts a dead engine and fences a
restarted one until the trainer has synced it. For each rollout every sample's request goes straight
to an engine URL through the engines' async client; a request that fails on a dead engine restarts it
and is resubmitted; one that keeps failing ends as an ABORTED sample carrying the error. Every sample
records the weight version it was generated with; one of another version than the policy's is
excluded (ABORTED, counted as `stale_samples`). The training loop uses `generate`, `eval`,
`get_last_metrics`, `engines` / `engine_urls`, `engines_needing_sync` / `confirm_weights` (weight sync),
`pause` / `resume`, `release_memory` / `resume_memory` (colocated), `shutdown`. With
`--load-debug-rollout-data` no engine starts and `generate` replays the saved rollout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import sys
import time
from pathlib import Path

import ray
from tqdm import tqdm

from slime_spec.cluster.placement import Placement, engines_to_start
from slime_spec.config.run_config import Config, EngineConfig, RolloutConfig, WandbConfig, in_flight_per_engine
from slime_spec.fleet.client import EngineAuth, EngineError, async_session
from slime_spec.fleet.fleet import EngineFleet
from slime_spec.fleet.process import ServerProcess
from slime_spec.rollout.data import PromptDataset
from slime_spec.rollout.debug_data import load_rollout, save_rollout
from slime_spec.rollout.dynamic_sampling import OverSampled, load_filter, over_sample
from slime_spec.rollout.generate import (
    GenerateFn,
    RolloutEngineClient,
    default_generate,
    default_generate_group,
    group_request,
    sends_groups,
)
from slime_spec.rollout.history_sync import make_history_sync
from slime_spec.rollout.metrics import (
    WandbLogger,
    format_metrics_line,
    rollout_metrics,
    server_spec_info,
    time_shares,
    write_metrics_line,
)
from slime_spec.rollout.progress import progress_bar, progress_done
from slime_spec.rollout.reward_runner import RewardRunner, report_failures, reward_failure_metrics
from slime_spec.rollout.rewards import load_function
from slime_spec.rollout.router import start_router
from slime_spec.rollout.sample import Sample, Status, exclude_stale, fresh_copy, groups_of, served_by
from slime_spec.rollout.sampling_params import sampling_params

# Silence of an engine on one request (no byte for this long) that counts as a failure; never a total bound.
DEFAULT_REQUEST_TIMEOUT_S = 1800.0


class RolloutFailed(RuntimeError):
    """Every sample of a rollout failed: nothing to train on, and the cause is the same everywhere."""


def check_not_all_failed(samples: list[Sample], desc: str) -> None:
    """Raise `RolloutFailed` naming the first sample's error when no sample of `desc` was generated."""
    if not samples or any(s.status != Status.ABORTED for s in samples):
        return
    first = next((s.error for s in samples if s.error), "no error recorded")
    raise RolloutFailed(f"all {len(samples)} samples of {desc} failed, so the run stops instead of training on "
                        f"nothing. The first sample's error: {first}")


def parse_eval_prompt_data(items: tuple[str, ...]) -> list[tuple[str, str]]:
    """slime's `--eval-prompt-data name1 path1 name2 path2 ...`; a single path is named 'eval'."""
    if len(items) == 1:
        return [("eval", items[0])]
    if len(items) % 2:
        raise ValueError(f"--eval-prompt-data {' '.join(items)}: expected pairs 'name path', got {len(items)} items")
    return [(items[i], items[i + 1]) for i in range(0, len(items), 2)]


class RolloutManager:
    def __init__(self, rollout: RolloutConfig, engine: EngineConfig, num_engines: int, *,
                 wandb: WandbConfig | None = None, rollout_num_gpus: int = 0, placement: Placement | None = None,
                 eval_prompt_data: tuple[str, ...] = (),
                 log_dir: str = "outputs/engine_logs", report_metrics: bool = True,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, show_progress: bool = True):
        if rollout.use_sglang_router and importlib.util.find_spec("sglang_router") is None:
            raise ImportError("--use-sglang-router: the sglang-router package is not installed "
                              "(pip install sglang-router), or drop the flag to use the built-in least-loaded routing")
        if num_engines < 1:
            raise ValueError(f"num_engines={num_engines}: need at least one rollout engine")
        self.rollout, self.engine_cfg, self.num_engines = rollout, engine, num_engines
        self.log_dir, self.report_metrics = log_dir, report_metrics
        self.request_timeout_s, self.show_progress = request_timeout_s, show_progress
        self.auth = EngineAuth.from_server_args(engine.server_args)
        self.sampling_params = sampling_params(rollout)
        self.rewards = RewardRunner(rollout)  # off the event loop, --rm-timeout, failures recorded per sample
        self.generate_fn: GenerateFn = (load_function(rollout.custom_generate_function_path,
                                                      "--custom-generate-function-path")
                                        if rollout.custom_generate_function_path else default_generate)
        self.last_metrics: dict = {}
        self._data_base = (0, 0)  # (rollout id, stream position it starts at); moved by restore_data_position
        self._stream_end: dict[int, int] = {}  # rollout id -> stream position after it (dynamic sampling varies it)
        # Dynamic sampling (rollout/dynamic_sampling.py) with over-sampling or a group filter; doctor checks the sizes
        self.dynamic_filter = load_filter(rollout.dynamic_sampling_filter_path)
        self.dynamic = rollout.over_sampling_batch_size is not None or self.dynamic_filter is not None
        self.history = make_history_sync(rollout, engine)  # --rollout-history-drafting
        self._session = None
        self._lock = asyncio.Lock()
        self._router_process: ServerProcess | None = None
        self.wandb = None
        self.fleet: EngineFleet | None = None
        # Replaying saved rollouts (--debug-train-only) needs no engine.
        if rollout.load_debug_rollout_data is None:
            self.fleet = EngineFleet(engine, num_engines, max_concurrency=rollout.sglang_server_concurrency,
                                     log_dir=log_dir, start_timeout_s=rollout.engine_start_timeout,
                                     rollout_num_gpus=rollout_num_gpus, placement=placement)
        try:  # the data loads while the engines start
            self.tokenizer = self._load_tokenizer() if (rollout.prompt_data or eval_prompt_data) else None
            self.dataset = self._dataset(rollout.prompt_data) if rollout.prompt_data else None
            eval_sets = parse_eval_prompt_data(eval_prompt_data) if eval_prompt_data else []
            self.eval_datasets = {name: self._dataset(path) for name, path in eval_sets}
            if self.fleet is not None:
                self.fleet.wait_ready()
                if rollout.use_sglang_router:
                    self._start_sglang_router()
            self.wandb = WandbLogger(wandb, {"rollout": vars(rollout)}) if wandb and wandb.use_wandb else None
        except BaseException:
            if self._router_process is not None:
                self._router_process.stop()
            if self.fleet is not None:
                self.fleet.stop_blocking()
            raise

    # ---- set-up ----
    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.rollout.hf_checkpoint, trust_remote_code=True)

    def _dataset(self, path: str) -> PromptDataset:
        r = self.rollout
        ds = PromptDataset(path, self.tokenizer, input_key=r.input_key, label_key=r.label_key,
                           apply_chat_template=r.apply_chat_template, max_prompt_len=r.rollout_max_prompt_len,
                           shuffle=r.rollout_shuffle, seed=r.rollout_seed, text_labels=not r.custom_rm_path)
        if ds.filtered_report():
            print(f"[rollout] {ds.filtered_report()}", flush=True)
        return ds

    def _start_sglang_router(self) -> None:
        """sglang-router in front of the engines; all requests then go through it (it does the routing)."""
        self._router_process = start_router(self.fleet.urls, self.rollout.engine_start_timeout,
                                            Path(self.log_dir) / "sglang_router.log")

    # ---- what the training loop calls ----
    def engines(self) -> list:
        return list(self.fleet.actors) if self.fleet else []

    def engine_urls(self) -> list[str]:
        return list(self.fleet.urls) if self.fleet else []

    def engines_needing_sync(self) -> list[int]:
        """Restarted engines fenced off until the trainer re-forms the weight-update group and syncs them."""
        return self.fleet.engines_needing_sync() if self.fleet else []

    async def check_engines(self, generate: bool = False) -> list[int]:
        """Every engine's liveness now; a dead or hung one is restarted and fenced (EngineFleet.check_engines)."""
        return await self.fleet.check_engines(generate) if self.fleet else []

    async def restart_stuck(self, urls: list[str], why: str) -> list[int]:
        """Restart engines found stuck where no probe sees it (EngineFleet.restart_stuck)."""
        return await self.fleet.restart_stuck(urls, why) if self.fleet else []

    async def confirm_weights(self, version: str) -> list[int]:
        """The trainer synced `version` into the engines: unfence those serving it; returns those still stale."""
        return await self.fleet.confirm_weights(version)

    def weight_version(self) -> str | None:
        return self.fleet.current_version if self.fleet else None

    def get_last_metrics(self) -> dict:
        return dict(self.last_metrics)

    # ---- the data position (saved in checkpoints; rollout/data.py) ----
    def _stream_start(self, rollout_id: int) -> int:
        if rollout_id - 1 in self._stream_end:
            return self._stream_end[rollout_id - 1]
        first_rollout, first_position = self._data_base
        return first_position + (rollout_id - first_rollout) * self.rollout.rollout_batch_size

    def data_position(self, rollout_id: int) -> dict | None:
        """Where the prompt stream stands once rollout `rollout_id` is done (what its checkpoint saves)."""
        return self.dataset.position(self._stream_start(rollout_id + 1)) if self.dataset is not None else None

    def restore_data_position(self, saved: dict, next_rollout_id: int) -> list[str]:
        """Rollout `next_rollout_id` continues the stream where a checkpoint saved it; returns notes to print."""
        if self.dataset is None:
            return []
        position, notes = self.dataset.resume_at(saved)
        self._data_base, self._stream_end = (next_rollout_id, position), {}
        return notes

    async def generate(self, rollout_id: int) -> list[Sample]:
        r = self.rollout
        if r.load_debug_rollout_data:
            samples = load_rollout(r.load_debug_rollout_data, rollout_id)
            self.last_metrics = rollout_metrics(rollout_id, samples, 0.0)
            return samples
        if self.dataset is None:
            raise ValueError("the rollout needs --prompt-data (a JSONL file of prompts)")
        start = self._stream_start(rollout_id)
        restarts_before = self.fleet.total_restarts
        states_before = await self._server_states()
        dynamic = None
        if self.dynamic:
            samples, elapsed, dynamic = await self._run_dynamic(rollout_id, start)
        else:
            samples = self.dataset.batch(rollout_id, r.rollout_batch_size, r.n_samples_per_prompt, start=start)
            if self.history is not None:
                self._session = self._session or async_session(self.request_timeout_s)
                clients = [RolloutEngineClient(u, self._session, self.auth) for u in self.fleet.urls]
                await self.history.before_rollout(clients, samples, rollout_id, self.tokenizer)
            samples, elapsed = await self._run(samples, f"rollout {rollout_id}")
        self._stream_end[rollout_id] = start + (dynamic.prompts_taken if dynamic else r.rollout_batch_size)
        check_not_all_failed(samples, f"rollout {rollout_id}")
        if self.history is not None:
            self.history.after_rollout(samples, rollout_id)
        stale = exclude_stale(samples, self.fleet.current_version)
        metrics = rollout_metrics(rollout_id, samples, elapsed, self.fleet.total_restarts - restarts_before)
        metrics["engine_restarts_total"] = self.fleet.total_restarts
        metrics["stale_samples"] = stale
        metrics.update(reward_failure_metrics(samples))
        if dynamic is not None:
            metrics.update(dynamic.metrics())
        report_failures(samples, f"rollout {rollout_id}")
        if stale:
            print(f"[rollout] {stale} sample(s) of rollout {rollout_id} were generated with stale weights and are "
                  "excluded from training (see their error)", flush=True)
        states = await self._server_states()
        metrics.update(server_spec_info(states))
        metrics.update(time_shares(states_before, states, elapsed))
        self.last_metrics = metrics
        if self.report_metrics:  # else the training loop prints and writes one merged line per step
            print(f"[rollout] {format_metrics_line(metrics)}", flush=True)
        if r.metrics_jsonl and self.report_metrics:
            write_metrics_line(r.metrics_jsonl, metrics)
        if self.wandb:
            self.wandb.log(metrics, step=rollout_id)
        if r.save_debug_rollout_data:
            save_rollout(r.save_debug_rollout_data, rollout_id, samples, metrics)
        return samples

    async def eval(self, rollout_id: int) -> dict:
        """`--n-samples-per-eval-prompt` samples per prompt of every eval dataset, with the `--eval-*` sampling
        flags (each falls back to its rollout flag); metrics keyed `eval/{name}/...`."""
        out: dict = {"rollout_id": rollout_id}
        r = self.rollout
        params = sampling_params(dataclasses.replace(
            r, rollout_temperature=r.rollout_temperature if r.eval_temperature is None else r.eval_temperature,
            rollout_top_p=r.rollout_top_p if r.eval_top_p is None else r.eval_top_p,
            rollout_top_k=r.rollout_top_k if r.eval_top_k is None else r.eval_top_k,
            rollout_max_response_len=r.eval_max_response_len or r.rollout_max_response_len))
        for name, ds in self.eval_datasets.items():
            samples, elapsed = await self._run(ds.batch(0, len(ds), r.n_samples_per_eval_prompt), f"eval {name}",
                                               params)
            check_not_all_failed(samples, f"eval {name}")
            m = rollout_metrics(rollout_id, samples, elapsed)
            m.update(reward_failure_metrics(samples))
            out.update({f"eval/{name}/{k}": v for k, v in m.items() if k != "rollout_id"})
        if self.wandb and len(out) > 1:
            self.wandb.log(out, step=rollout_id)
        return out

    async def pause(self) -> None:
        await self.fleet.call_all("pause_generation")

    async def resume(self) -> None:
        await self.fleet.call_all("continue_generation")

    async def release_memory(self, tags: list[str] | None = None) -> None:
        """Colocated training: free the engines' weights / KV cache (SGLang tags) before the train step."""
        await self.fleet.call_all("release_memory_occupation", tags)

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self.fleet.call_all("resume_memory_occupation", tags)

    async def shutdown(self) -> None:
        """Stop every engine server (and the router); safe to call twice."""
        try:
            if self.fleet is not None:
                await self.fleet.shutdown()
        finally:
            if self._session is not None:
                await self._session.close()
                self._session = None
            if self._router_process is not None:
                self._router_process.stop()
            if self.wandb:
                self.wandb.finish()
                self.wandb = None
            self.rewards.close()

    # ---- the rollout ----
    async def _run(self, samples: list[Sample], desc: str, params: dict | None = None) -> tuple[list[Sample], float]:
        if self.fleet is None:
            raise RuntimeError("no rollout engines: this manager was built to replay --load-debug-rollout-data")
        async with self._lock:
            if self._session is None:
                self._session = async_session(self.request_timeout_s)
            start = time.perf_counter()
            bar = progress_bar(len(samples), desc, self.show_progress, sys.stderr)
            tasks = [asyncio.create_task(self._group_task(g, bar, params or self.sampling_params))
                     for g in groups_of(samples)]
            try:
                done = [s for group in await asyncio.gather(*tasks) for s in group]
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            finally:
                progress_done(bar, desc, sys.stderr, time.perf_counter() - start)
            return sorted(done, key=lambda s: s.index), time.perf_counter() - start

    async def _group_task(self, group: list[Sample], bar: tqdm | None, params: dict) -> list[Sample]:
        """One GRPO group's samples generated (one batched request where the default generate function runs, else
        one request each) and rewarded."""
        results = await self._generate_group(group, params)
        await asyncio.gather(*(self.rewards.assign(r) for r in results))
        if bar is not None:
            bar.update(len(results))
        return results

    async def _generate_group(self, group: list[Sample], params: dict) -> list[Sample]:
        """The group as one batched /generate on one engine; where that is not possible (a custom generate
        function, the sglang-router in front, a sample needing its own request) or fails, each sample through
        `_generate_one` with its own retries."""
        body = group_request(group, params) if len(group) > 1 and sends_groups(self.rollout) else None
        if body is not None:
            fleet = self.fleet
            idx = await fleet.router.acquire(len(group))
            generation, version = fleet.generation[idx], fleet.version_of(idx)
            try:
                results = await default_generate_group(self._generation_client(idx), [fresh_copy(s) for s in group],
                                                       body)
            except EngineError as e:
                await fleet.router.release(idx, len(group))
                print(f"[rollout] engine {idx}: a group's batched /generate failed ({e}); its {len(group)} samples "
                      "go one request each, with their retries", flush=True)
                if e.unreachable:  # the engine may be gone: check it, restart it if dead
                    await fleet.recover(idx, generation)
            except BaseException:
                await fleet.router.release(idx, len(group))
                raise
            else:
                await fleet.router.release(idx, len(group))
                return [served_by(r, idx, version) for r in results]
        return list(await asyncio.gather(*(self._generate_one(s, params) for s in group)))

    async def _run_dynamic(self, rollout_id: int, start: int) -> tuple[list[Sample], float, OverSampled]:
        """A rollout by dynamic sampling from stream position `start`: groups submitted, filtered and kept as
        rollout/dynamic_sampling.py says; the engines are told to abort what is still running once the batch is
        full (SGLang's abort_all), so none is busy when the step goes on."""
        r, desc = self.rollout, f"rollout {rollout_id}"
        n = r.n_samples_per_prompt

        def take(offset: int, count: int) -> list[list[Sample]]:
            batch = self.dataset.batch(rollout_id, count, n, start=start + offset)
            for s in batch:
                s.group_index, s.index = s.group_index + offset, s.index + offset * n
            return [batch[i:i + n] for i in range(0, len(batch), n)]

        async def run_group(group: list[Sample]) -> list[Sample]:
            return await self._group_task(group, None, self.sampling_params)

        async with self._lock:
            if self._session is None:
                self._session = async_session(self.request_timeout_s)
            t0 = time.perf_counter()
            bar = progress_bar(r.rollout_batch_size * n, desc, self.show_progress, sys.stderr)
            try:
                result = await over_sample(take, run_group, target=r.rollout_batch_size,
                                           over=r.over_sampling_batch_size or r.rollout_batch_size,
                                           filter_fn=self.dynamic_filter, filter_args=r,
                                           max_prompts=len(self.dataset), on_kept=lambda g: bar.update(len(g)))
            finally:
                progress_done(bar, desc, sys.stderr, time.perf_counter() - t0)
            if result.aborted_groups:
                await self._abort_cut_off()
            return result.samples, time.perf_counter() - t0, result

    async def _abort_cut_off(self) -> None:
        """SGLang's abort_all on every engine after a dynamic rollout cut groups off. Their requests were cancelled
        here already (SGLang aborts a request whose client left, within seconds), so an engine that cannot take the
        abort (one being restarted) is reported, not a failed rollout."""
        outcomes = await asyncio.gather(*[a.abort_request.remote() for a in self.fleet.actors], return_exceptions=True)
        for url, outcome in zip(self.fleet.urls, outcomes):
            if isinstance(outcome, BaseException):
                print(f"[rollout] {url}: /abort_request after dynamic sampling failed ({type(outcome).__name__}: "
                      f"{str(outcome)[:200]}); its cut-off requests end when SGLang sees their clients gone",
                      flush=True)

    def _generation_client(self, idx: int) -> RolloutEngineClient:
        """The client a generate function gets for engine `idx` (the sglang-router's URL where it is in front)."""
        url = self._router_process.url if self._router_process else self.fleet.urls[idx]
        return RolloutEngineClient(url, self._session, self.auth, engine_index=idx, config=self.rollout,
                                   tokenizer=self.tokenizer)

    async def _generate_one(self, sample: Sample, params: dict) -> Sample:
        fleet = self.fleet
        attempts = 1 + self.rollout.rollout_request_retries
        errors = []
        for attempt in range(attempts):
            idx = await fleet.router.acquire()
            generation, version = fleet.generation[idx], fleet.version_of(idx)
            work = fresh_copy(sample)  # a retry starts from the untouched sample
            try:
                result = await self.generate_fn(self._generation_client(idx), work, dict(params))
            except EngineError as e:
                errors.append(f"engine {idx}: {e}")
                await fleet.router.release(idx)
                if e.unreachable:  # the engine may be gone: check it, restart it if dead, resubmit
                    await fleet.recover(idx, generation)
                else:
                    await asyncio.sleep(min(0.1 * 2 ** attempt, 2.0))
                continue
            except BaseException:
                await fleet.router.release(idx)
                raise
            await fleet.router.release(idx)
            result = served_by(result, idx, version)
            if attempt:
                result.metadata["attempts"] = attempt + 1
            return result
        sample.status = Status.ABORTED
        sample.error = f"request failed {attempts} times: " + " | ".join(errors)
        return sample

    async def _server_states(self) -> dict[int, dict]:
        """Each live engine's internal state from GET /server_info (accept length, step-time counters)."""
        self._session = self._session or async_session(self.request_timeout_s)
        out = {}
        for i in self.fleet.live():
            client = RolloutEngineClient(self.fleet.urls[i], self._session, self.auth, engine_index=i)
            try:
                info = await client.server_info()
            except EngineError as e:
                print(f"[rollout] engine {i}: {e}", flush=True)
                continue
            out[i] = (info.get("internal_states") or [{}])[0]
        return out


RolloutManagerActor = ray.remote(RolloutManager)


def start_rollout_manager(config: Config, placement: Placement | None = None, **kwargs):
    """The RolloutManager actor for a full config. Engines run on `placement` (the driver's placement group)
    when given; else GPU engines for backend sglang with --rollout-num-gpus get a placement group of their own."""
    c = config.cluster
    gpus = c.rollout_num_gpus if (placement is None and config.engine.backend == "sglang" and c.rollout_num_gpus) \
        else 0
    kwargs.setdefault("log_dir", str(Path(config.output_dir) / "engine_logs"))
    engines = engines_to_start(config, placement)
    # the per-engine request cap of the engines actually started (the placement counts them on GPUs)
    engine = dataclasses.replace(config.engine, in_flight_per_engine=in_flight_per_engine(config.rollout, engines))
    return RolloutManagerActor.options(num_cpus=0).remote(
        config.rollout, engine, engines, wandb=config.wandb, rollout_num_gpus=gpus,
        placement=placement, eval_prompt_data=config.eval_prompt_data, **kwargs)
