"""`--spec-speedup-interval N`: is speculation paying in this run? Measured, not assumed.

On the first rollout, every N-th and the last (`due`), after the weight sync, the driver sends the prompts of that
rollout (every sample's prompt ids, the rollout's sampling params) twice: once to speculative engine 0, once to a
plain engine (the same server flags without `--speculative-*`) that has just loaded the same weights. Both halves go
through the same client with the same concurrency, back to back, on the same machine, the order alternating between
measurements; `spec_speedup` = plain seconds / speculative seconds.

Why a plain engine beside the fleet rather than speculation switched off per request: neither SGLang nor
the embedded engine can turn speculation off for one request. The price is one more engine process (one
more copy of the weights) and, each measurement, the trainer's weights written once to disk for it
(`update_weights_from_disk`) plus two extra generations of one rollout batch. Embedded backend only: on
SGLang the plain engine would need GPUs of its own.

Sampling is random, so the two halves do not produce identical tokens; both token counts are reported,
and `spec_speedup_tokens_per_s` compares throughputs for readers who prefer that normalisation.

`--spec-speedup-repeats R` times every engine R times per measurement, the order rotating each round, and takes
each engine's median pass: on the 2-core demo machine two identical engines ran up to 14% apart in one pass, and
`spec_speedup` itself moved by 11%, which a median of three halved (`bench/speedup_noise.py`).

`--spec-speedup-frozen-draft` (with a draft trained online) adds a third engine, speculative like engine 0, whose
draft stays as launched while its target loads the same current weights: `spec_speedup_frozen` = plain seconds /
its seconds on the same prompts. What training the draft online buys is then measured on one policy trajectory,
side by side, instead of across two runs whose policies drift apart. The three halves rotate their order.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import shutil
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from slime_spec.config.run_config import Config, EngineConfig
from slime_spec.rollout.generate import batched_body, sends_groups
from slime_spec.rollout.sample import groups_of
from slime_spec.speculative.stats import SpecStats, accept_length, accept_rate


def without_speculative_flags(argv: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Forwarded server argv with every `--speculative-*` flag (and its values) removed."""
    out: list[str] = []
    skipping = False
    for token in argv:
        if token.startswith("--"):
            skipping = token.startswith("--speculative-")
        if not skipping:
            out.append(token)
    return tuple(out)


def plain_engine_config(engine: EngineConfig) -> EngineConfig:
    """The same engine without speculation (our own speculative options --spec-auto / --spec-draft-sampling off too:
    the plain server refuses them)."""
    server_args = {k: v for k, v in engine.server_args.items() if not k.startswith("speculative_")}
    return replace(engine, forwarded_argv=without_speculative_flags(engine.forwarded_argv), server_args=server_args,
                   spec_auto=False, spec_draft_sampling=False)


def check_config(config: Config) -> None:
    """Refuse a setting the measurement cannot honour, before anything starts."""
    n = config.spec_speedup_interval
    if n is None:
        for flag, value, default in (("--spec-speedup-frozen-draft", config.spec_speedup_frozen_draft, False),
                                     ("--spec-speedup-repeats", config.spec_speedup_repeats, 1)):
            if value != default:
                raise ValueError(f"{flag} is part of the speed-up measurement: set --spec-speedup-interval N too, "
                                 "or drop it")
        return
    if n < 1:
        raise ValueError(f"--spec-speedup-interval={n}: must be >= 1 (rollouts between measurements), or leave it out")
    if config.spec_speedup_repeats < 1:
        raise ValueError(f"--spec-speedup-repeats={config.spec_speedup_repeats}: must be >= 1 (timed passes per engine "
                         "per measurement; 3 lets the median reject one pass the machine slowed)")
    if config.engine.backend != "embedded":
        raise ValueError("--spec-speedup-interval needs --rollout-backend embedded (the plain engine it starts beside "
                         "the fleet would need GPUs of its own on SGLang); drop the flag on SGLang")
    if not config.engine.server_args.get("speculative_algorithm"):
        raise ValueError("--spec-speedup-interval compares speculative against plain rollout, but no "
                         "--sglang-speculative-algorithm is set; set one or drop the flag")
    if config.debug_rollout_only or config.debug_train_only:
        raise ValueError("--spec-speedup-interval runs inside the training loop; drop it with --debug-rollout-only "
                         "or --debug-train-only")
    if config.spec_speedup_frozen_draft and not (config.train.enable_mtp_training
                                                 or config.train.enable_draft_training):
        raise ValueError("--spec-speedup-frozen-draft compares the draft trained online with it frozen, but neither "
                         "--enable-mtp-training nor --enable-draft-training is set: this run's draft is frozen "
                         "already; add one of them or drop the flag")


def due(interval: int | None, rollout_id: int, num_rollout: int, first_rollout: int = 0) -> bool:
    """Measure on the run's first rollout, every `interval`-th and the last: the first is the baseline (an online
    draft has trained one step, so it and a frozen one still agree) and says at once whether speculation pays; the
    last ends every run with a number. `first_rollout`: where a resumed run starts."""
    if not interval:
        return False
    return rollout_id == first_rollout or (rollout_id + 1) % interval == 0 or rollout_id + 1 == num_rollout


@dataclass
class TimedHalf:
    seconds: float
    response_tokens: int
    verify_ct: int
    accepted: int = 0  # draft tokens accepted (meta_info spec_num_correct_drafts, summed)
    drafted: int = 0  # draft tokens proposed (meta_info spec_num_proposed_drafts)
    passes: int = 1  # timed passes over the prompts the counters sum (`seconds`: their median)

    @property
    def tokens_per_pass(self) -> float:
        return self.response_tokens / self.passes

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_pass / self.seconds if self.seconds > 0 else 0.0

    @property
    def accept_length(self) -> float:
        """Token-weighted (speculative/stats.py): tokens per verify pass; 1.0 without speculation."""
        return accept_length(self.response_tokens, self.verify_ct)

    @property
    def accept_rate(self) -> float | None:
        """Accepted over drafted tokens: the draft's quality, apart from the k a policy chose."""
        return accept_rate(self.accepted, self.drafted)


def median_half(passes: list[TimedHalf]) -> TimedHalf:
    """One engine's passes of a measurement as one half (pure): the median pass's seconds, so one pass slowed by
    the machine does not move it, and the counters summed over every pass (accept length and rate over all)."""
    return TimedHalf(statistics.median(p.seconds for p in passes), sum(p.response_tokens for p in passes),
                     sum(p.verify_ct for p in passes), sum(p.accepted for p in passes),
                     sum(p.drafted for p in passes), sum(p.passes for p in passes))


HALVES = ("spec", "plain", "frozen")


def half_order(count: int, frozen: bool) -> tuple[str, ...]:
    """The order of a measurement's halves, rotated each measurement so none always runs first (pure)."""
    names = HALVES if frozen else HALVES[:2]
    k = count % len(names)
    return names[k:] + names[:k]


def speedup_metrics(spec: TimedHalf, plain: TimedHalf, spec_first: bool, frozen: TimedHalf | None = None) -> dict:
    """The step keys of one measurement (pure); `frozen`: the frozen-draft engine's half, if measured."""
    out = {
        "spec_speedup": plain.seconds / spec.seconds if spec.seconds > 0 else None,
        "spec_speedup_tokens_per_s": spec.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s > 0 else None,
        "spec_speedup_spec_s": spec.seconds,
        "spec_speedup_plain_s": plain.seconds,
        "spec_speedup_spec_tokens": spec.tokens_per_pass,
        "spec_speedup_plain_tokens": plain.tokens_per_pass,
        "spec_speedup_passes": spec.passes,
        "spec_speedup_accept_length": spec.accept_length,
        "spec_speedup_accept_rate": spec.accept_rate,
        "spec_speedup_spec_first": spec_first,
    }
    if frozen is not None:
        out.update({
            "spec_speedup_frozen": plain.seconds / frozen.seconds if frozen.seconds > 0 else None,
            "spec_speedup_frozen_s": frozen.seconds,
            "spec_speedup_frozen_tokens": frozen.tokens_per_pass,
            "spec_speedup_frozen_accept_length": frozen.accept_length,
            "spec_speedup_frozen_accept_rate": frozen.accept_rate,
        })
    return out


def step_speedup(step_time_s: float, rollout_time_s: float, rollout_speedup: float | None) -> float | None:
    """The whole step's speed-up that a rollout speed-up gives (pure): the step's time with its rollout decoded
    plainly (the rollout's measured time x the plain / speculative ratio measured beside it) over the step's
    measured time; training, sync and memory release take the same time either way. None without a ratio."""
    if rollout_speedup is None or step_time_s <= 0:
        return None
    return (step_time_s + rollout_time_s * (rollout_speedup - 1.0)) / step_time_s


def step_speedup_metrics(step: dict) -> dict:
    """A step's `spec_speedup_step` (and `_frozen`) from its step_time_s, rollout_time_s and measured ratios."""
    out = {}
    for key in ("spec_speedup", "spec_speedup_frozen"):
        value = step_speedup(step["step_time_s"], step["rollout_time_s"], step.get(key))
        if value is not None:
            out[key.replace("spec_speedup", "spec_speedup_step")] = value
    return out


@contextlib.contextmanager
def collector_paused():
    """Python's garbage collector off for the block (a measurement's passes), after one collection: the driver's
    heap (Ray, torch, the trainer's state dict) made one generation-2 pass take 0.36 s in the middle of a timed half,
    during which no request reached the engine (its wall time exceeded its stepping time by 0.41 s; 0.04 s
    otherwise). One collection per measurement, not per pass: each costs as long as that stall."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


async def time_generation(url: str, auth, groups: list[list[list[int]]], params: dict, concurrency: int,
                          read_timeout_s: float, batched: bool = True) -> TimedHalf:
    """Every prompt through /generate on one engine as the rollout sends it (`batched`: a group of several as one
    batched request, as the default generate function's groups go; else one request per prompt), at most
    `concurrency` prompts in flight; wall time of the batch. Callers time it inside `collector_paused`."""
    from slime_spec.fleet.client import AsyncEngineClient, async_session
    requests = list(groups) if batched else [[ids] for g in groups for ids in g]
    gate = asyncio.Semaphore(max(1, concurrency // max(len(r) for r in requests)))
    async with async_session(read_timeout_s) as session:
        client = AsyncEngineClient(url, session, auth)

        async def one(inputs: list[list[int]]) -> list[dict]:
            async with gate:
                if len(inputs) == 1:
                    outs = [await client.generate({"input_ids": inputs[0], "sampling_params": dict(params),
                                                   "return_logprob": True})]
                else:
                    outs = await client.generate_batch(batched_body(inputs, dict(params)))
            return [out["meta_info"] for out in outs]

        start = time.perf_counter()
        metas = [m for ms in await asyncio.gather(*(one(inputs) for inputs in requests)) for m in ms]
        seconds = time.perf_counter() - start

    total = SpecStats.total(SpecStats.from_meta_info(m) for m in metas)
    return TimedHalf(seconds, total.completion_tokens, total.verify_ct, total.accept_token_num or 0,
                     total.draft_token_num or 0)


class SpeedupProbe:
    """The plain engine (and the frozen-draft one) and the measurement; `measure` is called by the driver after
    a weight sync.

    Its engines are launched as the fleet launches a CPU engine (an `EngineActor` with no CPU reserved), so each
    runs in the environment engine 0 runs in: Ray's workers get `OMP_NUM_THREADS=1` and a raised niceness, and a
    plain engine started from the driver instead ran two threads at normal priority against engine 0's one. On GPUs
    they run on engine 0's GPUs (`beside_engine`), so the three engines are timed on the same device.
    """

    def __init__(self, config: Config, placement=None):
        """Launches the probe's engines and returns: they start while the fleet's engines and the trainer do (one
        engine start, 15-80 s, instead of two in a row); `connect` waits for them. `placement`: the run's engines'
        (cluster/placement.py); the probe's engines then share engine 0's GPUs."""
        from slime_spec.cluster.placement import beside_engine
        from slime_spec.fleet.actor import EngineActor
        from slime_spec.fleet.client import EngineAuth
        from slime_spec.rollout.sampling_params import sampling_params
        check_config(config)
        self.config = config
        self.dir = Path(config.output_dir) / "spec_speedup"
        self.weights_dir = self.dir / "weights"
        engines = {"plain": plain_engine_config(config.engine)}
        if config.spec_speedup_frozen_draft:
            engines["frozen"] = config.engine  # engine 0's flags; its draft is never sent weights
        self.auth = EngineAuth.from_server_args(config.engine.server_args)
        self.params = sampling_params(config.rollout)
        self.clients: dict = {}
        options, gpu_ids = beside_engine(placement)
        self.actors = {name: EngineActor.options(num_cpus=0, **options).remote(
            engine, 0, log_dir=str(self.dir / f"{name}_engine"), start_timeout_s=config.rollout.engine_start_timeout,
            gpu_ids=gpu_ids) for name, engine in engines.items()}  # the starts overlap
        self.count = 0  # rounds timed so far: each starts the rotation one place on

    def connect(self, spec_url: str) -> None:
        """Wait until the probe's engines serve; `spec_url`: engine 0's, timed against them."""
        import ray

        from slime_spec.fleet.client import EngineClient
        from slime_spec.weight_sync import fp8
        from slime_spec.weight_sync.gather import hf_mtp_matcher
        self.urls = dict(zip(self.actors, ray.get([a.get_url.remote() for a in self.actors.values()])))
        self.spec_url = spec_url
        self.clients = {name: EngineClient(url, self.auth) for name, url in self.urls.items()}
        hf_config = json.loads((Path(self.config.engine.model_path) / "config.json").read_text())
        self.is_mtp = hf_mtp_matcher(hf_config)
        self.fp8 = fp8.Fp8BlockScheme.from_hf_config(hf_config)  # an FP8 checkpoint's engines load it quantized
        frozen = (f", and a frozen-draft engine (speculative, its draft as launched) at {self.urls['frozen']}"
                  if "frozen" in self.urls else "")
        print(f"[spec_speedup] plain engine (no speculation) at {self.urls['plain']}{frozen} for the speed-up "
              f"measurement every {self.config.spec_speedup_interval} rollout(s)", flush=True)

    def load_weights(self, state_dict: dict, version: str) -> None:
        """The trainer's current target weights into the plain engine (it has no MTP layer) and the frozen-draft
        engine (its draft keeps what it launched with), through disk: no draft tensor is written. For an FP8
        checkpoint they are written as the sync sends them (quantized, with their scales), so all three engines
        serve the same values."""
        from safetensors.torch import save_file

        from slime_spec.weight_sync import fp8
        state_dict = {k: v for k, v in state_dict.items() if not self.is_mtp(k)}
        if self.fp8 is not None:
            state_dict = dict(fp8.quantize_named(state_dict.items(), self.fp8))
        if self.weights_dir.exists():
            shutil.rmtree(self.weights_dir)
        self.weights_dir.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in state_dict.items()}, str(self.weights_dir / "model.safetensors"),
                  metadata={"format": "pt"})
        for name, client in self.clients.items():
            out = client.post("/update_weights_from_disk", {"model_path": str(self.weights_dir),
                                                            "weight_version": version})
            if not out.get("success"):
                raise RuntimeError(f"--spec-speedup-interval: the {name} engine did not load weights {version!r}: "
                                   f"{out.get('message')} (log under {self.dir / f'{name}_engine'})")

    def measure(self, samples: list, state_dict: dict, version: str) -> dict:
        """Time the samples' prompts on the speculative engine, the plain one and the frozen-draft one if any (same
        target weights, `version`), one after another, `--spec-speedup-repeats` rounds in a rotating order."""
        self.load_weights(state_dict, version)
        groups = [[list(s.tokens[:s.prompt_length]) for s in g] for g in groups_of(samples)]
        r = self.config.rollout
        urls = {"spec": self.spec_url, **self.urls}

        def half(name: str) -> TimedHalf:  # sent as the rollout sends them (rollout/manager.py `_generate_group`)
            return asyncio.run(time_generation(urls[name], self.auth, groups, self.params,
                                               r.sglang_server_concurrency, r.engine_start_timeout,
                                               batched=sends_groups(r)))

        orders = [half_order(self.count + i, "frozen" in self.urls) for i in range(self.config.spec_speedup_repeats)]
        passes: dict[str, list[TimedHalf]] = {}
        with collector_paused():
            if self.count == 0:  # engine 0 is warm from the rollouts; the others get one untimed pass (first-call
                # costs, and with --spec-auto its measured step costs)
                for name in self.urls:
                    half(name)
            for order in orders:
                for name in order:
                    passes.setdefault(name, []).append(half(name))
        self.count += len(orders)
        halves = {name: median_half(p) for name, p in passes.items()}
        return speedup_metrics(halves["spec"], halves["plain"], orders[0][0] == "spec", halves.get("frozen"))

    def shutdown(self) -> None:
        import ray

        for client in self.clients.values():
            client.close()
        for name, actor in self.actors.items():
            try:
                ray.get(actor.shutdown.remote(), timeout=60)
            except (ray.exceptions.RayError, TimeoutError) as e:  # its server died with it (PR_SET_PDEATHSIG)
                print(f"[spec_speedup] shutdown: the {name} engine's actor was already gone: {str(e)[:300]}",
                      flush=True)
            ray.kill(actor)
