"""`RolloutManager`: owns the engines and turns a rollout id into a list of finished `Sample`s.

One Ray actor (async). It starts `num_engines` `EngineActor`s (on GPUs: one per
`rollout_num_gpus / num_gpus_per_engine` bundles of a placement group, as slime does; otherwise
CPU engines), then for each rollout sends every sample's request straight to an engine URL over
aiohttp: least-loaded engine first, at most `--sglang-server-concurrency` in flight per engine. A
request that fails on a dead engine restarts that engine (same argv) and is resubmitted (up to
`--rollout-request-retries` times); a request that keeps failing ends as an ABORTED sample
carrying the error. The training loop uses `generate`, `eval`, `get_last_metrics`, `engines` /
`engine_urls` (weight sync), `pause` / `resume`, `release_memory` / `resume_memory` (colocated),
`shutdown`. With `--load-debug-rollout-data` no engine starts and `generate` replays the saved
rollout.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import importlib.util
import os
import sys
import time
from pathlib import Path

import aiohttp
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tqdm import tqdm

from slime_spec.config import Config, EngineConfig, RolloutConfig, WandbConfig
from slime_spec.net import free_port
from slime_spec.rollout.data import PromptDataset
from slime_spec.rollout.debug_data import load_rollout, save_rollout
from slime_spec.rollout.engine_actor import EngineActor, EngineHTTPError
from slime_spec.rollout.engine_process import ServerProcess
from slime_spec.rollout.generate import EngineClient, GenerateFn, default_generate
from slime_spec.rollout.metrics import WandbLogger, format_metrics_line, rollout_metrics, write_metrics_line
from slime_spec.rollout.rewards import assign_reward, load_function, make_reward_fn
from slime_spec.rollout.routing import Router
from slime_spec.rollout.sample import Sample, Status
from slime_spec.rollout.sampling_params import sampling_params

DEFAULT_REQUEST_TIMEOUT_S = 1800.0
# Failures that mean "this engine may be gone": check it, restart it if dead, resubmit.
CONNECTION_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)


@ray.remote(num_cpus=0, num_gpus=0)
def _bundle_gpu() -> tuple[str, int]:
    """(node address, GPU id) of the placement-group bundle this task lands on."""
    ids = ray.get_gpu_ids()
    if len(ids) != 1:
        raise RuntimeError(f"expected one GPU per rollout bundle, Ray gave {ids}")
    return ray.util.get_node_ip_address(), int(ids[0])


def fresh_copy(s: Sample) -> Sample:
    """A copy whose mutable fields are new objects (deepcopy's per-token recursion costs ~1 ms a sample)."""
    return dataclasses.replace(s, tokens=list(s.tokens), rollout_log_probs=list(s.rollout_log_probs),
                               loss_mask=None if s.loss_mask is None else list(s.loss_mask),
                               meta_info=copy.deepcopy(s.meta_info), spec=dataclasses.replace(s.spec),
                               metadata=copy.deepcopy(s.metadata))


def parse_eval_prompt_data(items: tuple[str, ...]) -> list[tuple[str, str]]:
    """slime's `--eval-prompt-data name1 path1 name2 path2 ...`; a single path is named 'eval'."""
    if len(items) == 1:
        return [("eval", items[0])]
    if len(items) % 2:
        raise ValueError(f"--eval-prompt-data {' '.join(items)}: expected pairs 'name path', got {len(items)} items")
    return [(items[i], items[i + 1]) for i in range(0, len(items), 2)]


class RolloutManager:
    def __init__(self, rollout: RolloutConfig, engine: EngineConfig, num_engines: int, *,
                 wandb: WandbConfig | None = None, rollout_num_gpus: int = 0, placement_group=None,
                 bundle_indices: list[int] | None = None, eval_prompt_data: tuple[str, ...] = (),
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
        self.sampling_params = sampling_params(rollout)
        self.reward_fn = make_reward_fn(rollout)
        self.generate_fn: GenerateFn = (load_function(rollout.custom_generate_function_path,
                                                      "--custom-generate-function-path")
                                        if rollout.custom_generate_function_path else default_generate)
        self.last_metrics: dict = {}
        self.total_restarts = 0
        self._session: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()
        self._own_pg = None
        self._router_process: ServerProcess | None = None
        self.wandb = None
        self.engine_actors: list = []
        self.urls: list[str] = []
        # Replaying saved rollouts (--debug-train-only) needs no engine.
        if rollout.load_debug_rollout_data is None:
            self._launch_engines(rollout_num_gpus, placement_group, bundle_indices)
        try:  # the data loads while the engines start
            self.tokenizer = self._load_tokenizer() if (rollout.prompt_data or eval_prompt_data) else None
            self.dataset = self._dataset(rollout.prompt_data) if rollout.prompt_data else None
            eval_sets = parse_eval_prompt_data(eval_prompt_data) if eval_prompt_data else []
            self.eval_datasets = {name: self._dataset(path) for name, path in eval_sets}
            if self.engine_actors:
                self._wait_for_engines()
            self.wandb = WandbLogger(wandb, {"rollout": vars(rollout)}) if wandb and wandb.use_wandb else None
        except BaseException:
            self._stop_engines_blocking()
            raise

    # ---- set-up ----
    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.rollout.hf_checkpoint, trust_remote_code=True)

    def _dataset(self, path: str) -> PromptDataset:
        r = self.rollout
        return PromptDataset(path, self.tokenizer, input_key=r.input_key, label_key=r.label_key,
                             apply_chat_template=r.apply_chat_template, max_prompt_len=r.rollout_max_prompt_len,
                             shuffle=r.rollout_shuffle, seed=r.rollout_seed)

    def _launch_engines(self, rollout_num_gpus: int, pg, bundle_indices: list[int] | None) -> None:
        kwargs = dict(log_dir=self.log_dir, start_timeout_s=self.rollout.engine_start_timeout)
        try:
            if rollout_num_gpus:
                self._launch_gpu_engines(rollout_num_gpus, pg, bundle_indices, kwargs)
            else:
                for i in range(self.num_engines):
                    self.engine_actors.append(EngineActor.options(num_cpus=0).remote(self.engine_cfg, i, **kwargs))
        except BaseException:
            self._stop_engines_blocking()
            raise

    def _wait_for_engines(self) -> None:
        # Waits for every engine's /health; an EngineStartError (with the log tail) surfaces here. This
        # blocking get is intended (the constructor has no event loop to yield to): silence Ray's warning.
        os.environ["RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"] = "0"
        self.urls = ray.get([a.get_url.remote() for a in self.engine_actors])
        self.router = Router(self.num_engines, self.rollout.sglang_server_concurrency)
        self._generation = [0] * self.num_engines  # bumped on every restart of an engine
        self._recover_locks = [asyncio.Lock() for _ in range(self.num_engines)]
        if self.rollout.use_sglang_router:
            self._start_sglang_router()
        print(f"[rollout] {self.num_engines} engine(s) ready: {' '.join(self.urls)}", flush=True)

    def _launch_gpu_engines(self, rollout_num_gpus: int, pg, bundle_indices, kwargs) -> None:
        per_engine = self.engine_cfg.num_gpus_per_engine
        if rollout_num_gpus % per_engine or rollout_num_gpus // per_engine != self.num_engines:
            raise ValueError(f"--rollout-num-gpus={rollout_num_gpus} must be num_engines={self.num_engines} x "
                             f"--rollout-num-gpus-per-engine={per_engine}")
        if pg is None:
            pg = self._own_pg = placement_group([{"GPU": 1, "CPU": 1}] * rollout_num_gpus, strategy="PACK")
            ray.get(pg.ready())
            bundle_indices = list(range(rollout_num_gpus))
        if bundle_indices is None or len(bundle_indices) != rollout_num_gpus:
            raise ValueError(f"the rollout placement group needs {rollout_num_gpus} one-GPU bundles, "
                             f"got bundle_indices={bundle_indices}")
        strategy = lambda b: PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b)  # noqa: E731
        gpus = ray.get([_bundle_gpu.options(num_gpus=0.01, scheduling_strategy=strategy(b)).remote()
                        for b in bundle_indices])
        for i in range(self.num_engines):
            chunk = gpus[i * per_engine:(i + 1) * per_engine]
            if len({node for node, _ in chunk}) != 1:
                raise ValueError(f"engine {i} spans nodes {sorted({n for n, _ in chunk})}: one engine's GPUs must "
                                 "be on one node (check --rollout-num-gpus-per-engine)")
            first_bundle = bundle_indices[i * per_engine]
            self.engine_actors.append(
                EngineActor.options(num_cpus=0, num_gpus=0.01, scheduling_strategy=strategy(first_bundle))
                .remote(self.engine_cfg, i, gpu_ids=[g for _, g in chunk], **kwargs))

    def _start_sglang_router(self) -> None:
        """sglang-router in front of the engines; all requests then go through it (it does the routing)."""
        port = free_port()
        self._router_process = ServerProcess(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--worker-urls", *self.urls], url=f"http://127.0.0.1:{port}",
            log_path=Path(self.log_dir) / "sglang_router.log")
        self._router_process.start(self.rollout.engine_start_timeout)

    # ---- what the training loop calls ----
    def engines(self) -> list:
        return list(self.engine_actors)

    def engine_urls(self) -> list[str]:
        return list(self.urls)

    def get_last_metrics(self) -> dict:
        return dict(self.last_metrics)

    async def generate(self, rollout_id: int) -> list[Sample]:
        r = self.rollout
        if r.load_debug_rollout_data:
            samples = load_rollout(r.load_debug_rollout_data, rollout_id)
            self.last_metrics = rollout_metrics(rollout_id, samples, 0.0)
            return samples
        if self.dataset is None:
            raise ValueError("the rollout needs --prompt-data (a JSONL file of prompts)")
        samples = self.dataset.batch(rollout_id, r.rollout_batch_size, r.n_samples_per_prompt)
        restarts_before = self.total_restarts
        samples, elapsed = await self._run(samples, f"rollout {rollout_id}")
        metrics = rollout_metrics(rollout_id, samples, elapsed, self.total_restarts - restarts_before)
        metrics["engine_restarts_total"] = self.total_restarts
        metrics.update(await self._server_spec_info())
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
            m = rollout_metrics(rollout_id, samples, elapsed)
            out.update({f"eval/{name}/{k}": v for k, v in m.items() if k != "rollout_id"})
        if self.wandb and len(out) > 1:
            self.wandb.log(out, step=rollout_id)
        return out

    async def pause(self) -> None:
        await asyncio.gather(*[a.pause_generation.remote() for a in self.engine_actors])

    async def resume(self) -> None:
        await asyncio.gather(*[a.continue_generation.remote() for a in self.engine_actors])

    async def release_memory(self, tags: list[str] | None = None) -> None:
        """Colocated training: free the engines' weights / KV cache (SGLang tags) before the train step."""
        await asyncio.gather(*[a.release_memory_occupation.remote(tags) for a in self.engine_actors])

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await asyncio.gather(*[a.resume_memory_occupation.remote(tags) for a in self.engine_actors])

    async def shutdown(self) -> None:
        """Stop every engine server (and the router); safe to call twice."""
        refs = [a.shutdown.remote() for a in self.engine_actors]
        results = await asyncio.gather(*refs, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._release(results)

    def _stop_engines_blocking(self) -> None:
        """`shutdown` for the constructor's failure path (no event loop running yet)."""
        refs = [a.shutdown.remote() for a in self.engine_actors]
        results = []
        for ref in refs:
            try:
                results.append(ray.get(ref, timeout=60))
            except (ray.exceptions.RayError, TimeoutError) as e:
                results.append(e)
        self._release(results)

    def _release(self, stop_results: list) -> None:
        if self._router_process is not None:
            self._router_process.stop()
        for a in self.engine_actors:
            ray.kill(a)
        self.engine_actors = []
        if self._own_pg is not None:
            remove_placement_group(self._own_pg)
            self._own_pg = None
        if self.wandb:
            self.wandb.finish()
            self.wandb = None
        gone = [r for r in stop_results if isinstance(r, BaseException)]
        if gone:  # an actor that died took its server with it (PR_SET_PDEATHSIG); say so, do not hide it
            print(f"[rollout] shutdown: {len(gone)} engine actor(s) were already gone: {str(gone[0])[:300]}",
                  flush=True)

    # ---- the rollout ----
    async def _run(self, samples: list[Sample], desc: str, params: dict | None = None) -> tuple[list[Sample], float]:
        if not self.engine_actors:
            raise RuntimeError("no rollout engines: this manager was built to replay --load-debug-rollout-data")
        async with self._lock:
            if self._session is None:
                self._session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0),
                    timeout=aiohttp.ClientTimeout(total=self.request_timeout_s))
            start = time.perf_counter()
            bar = tqdm(total=len(samples), desc=desc, disable=not self.show_progress, mininterval=1.0,
                       file=sys.stderr)
            tasks = [asyncio.create_task(self._sample_task(s, bar, params or self.sampling_params)) for s in samples]
            try:
                done = await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            finally:
                bar.close()
            return sorted(done, key=lambda s: s.index), time.perf_counter() - start

    async def _sample_task(self, sample: Sample, bar: tqdm, params: dict) -> Sample:
        result = await self._generate_one(sample, params)
        await assign_reward(self.reward_fn, result)
        bar.update(1)
        return result

    async def _generate_one(self, sample: Sample, params: dict) -> Sample:
        attempts = 1 + self.rollout.rollout_request_retries
        errors = []
        for attempt in range(attempts):
            idx = await self.router.acquire()
            generation = self._generation[idx]
            url = self._router_process.url if self._router_process else self.urls[idx]
            client = EngineClient(url, idx, self._session, self.rollout, self.tokenizer)
            work = fresh_copy(sample)  # a retry starts from the untouched sample
            try:
                result = await self.generate_fn(client, work, dict(params))
            except CONNECTION_ERRORS as e:
                errors.append(f"engine {idx}: {type(e).__name__}: {e}")
                await self.router.release(idx)
                await self._recover(idx, generation)
                continue
            except EngineHTTPError as e:
                errors.append(f"engine {idx}: {e}")
                await self.router.release(idx)
                await asyncio.sleep(min(0.1 * 2 ** attempt, 2.0))
                continue
            except BaseException:
                await self.router.release(idx)
                raise
            await self.router.release(idx)
            result.engine_index = idx
            if attempt:
                result.metadata["attempts"] = attempt + 1
            return result
        sample.status = Status.ABORTED
        sample.error = f"request failed {attempts} times: " + " | ".join(errors)
        return sample

    async def _recover(self, idx: int, generation: int) -> None:
        """Restart engine `idx` if it died; only the first failure of an engine generation does this."""
        async with self._recover_locks[idx]:
            if self._generation[idx] != generation or self.router.dead[idx]:
                return
            await self.router.set_available(idx, False)
            try:
                restarted = await self.engine_actors[idx].ensure_alive.remote()
            except ray.exceptions.RayError as e:  # the restart failed (EngineStartError) or the actor is gone
                self._generation[idx] += 1
                print(f"[rollout] engine {idx} could not be restarted; routing around it:\n{e}", flush=True)
                await self.router.set_available(idx, False, dead=True)
                return
            if restarted:
                self._generation[idx] += 1
                self.total_restarts += 1
                self.urls[idx] = await self.engine_actors[idx].get_url.remote()
                print(f"[rollout] engine {idx} had died and was restarted ({self.urls[idx]})", flush=True)
            await self.router.set_available(idx, True)

    async def _server_spec_info(self) -> dict:
        """The engines' own running average accept length (GET /get_server_info), for cross-checking."""
        out = {}
        for i, url in enumerate(self.urls):
            if self.router.dead[i]:
                continue
            async with self._session.get(f"{url}/get_server_info") as r:
                if r.status != 200:
                    print(f"[rollout] engine {i}: GET /get_server_info answered HTTP {r.status}", flush=True)
                    continue
                info = await r.json()
            states = info.get("internal_states") or [{}]
            if states[0].get("avg_spec_accept_length") is not None:
                out[f"engine_{i}/server_avg_spec_accept_length"] = float(states[0]["avg_spec_accept_length"])
        return out


RolloutManagerActor = ray.remote(RolloutManager)


def start_rollout_manager(config: Config, **kwargs):
    """The RolloutManager actor for a full config (GPU engines for backend sglang with --rollout-num-gpus)."""
    c = config.cluster
    gpus = c.rollout_num_gpus if (config.engine.backend == "sglang" and c.rollout_num_gpus) else 0
    kwargs.setdefault("log_dir", str(Path(config.output_dir) / "engine_logs"))
    return RolloutManagerActor.options(num_cpus=0).remote(
        config.rollout, config.engine, config.num_engines, wandb=config.wandb, rollout_num_gpus=gpus,
        eval_prompt_data=config.eval_prompt_data, **kwargs)
