"""`--spec-speedup-interval N`: is speculation paying in this run? Measured, not assumed.

Every N rollouts, after the weight sync, the driver sends the prompts of that rollout (every sample's
prompt ids, the rollout's sampling params) twice: once to speculative engine 0, once to a plain engine
(the same server flags without `--speculative-*`) that has just loaded the same weights. Both halves go
through the same client with the same concurrency, back to back, on the same machine, the order
alternating between measurements; `spec_speedup` = plain seconds / speculative seconds.

Why a plain engine beside the fleet rather than speculation switched off per request: neither SGLang nor
the embedded engine can turn speculation off for one request. The price is one more engine process (one
more copy of the weights) and, each measurement, the trainer's weights written once to disk for it
(`update_weights_from_disk`) plus two extra generations of one rollout batch. Embedded backend only: on
SGLang the plain engine would need GPUs of its own.

Sampling is random, so the two halves do not produce identical tokens; both token counts are reported,
and `spec_speedup_tokens_per_s` compares throughputs for readers who prefer that normalisation.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

from slime_spec.config import Config, EngineConfig


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
        return
    if n < 1:
        raise ValueError(f"--spec-speedup-interval={n}: must be >= 1 (rollouts between measurements), or leave it out")
    if config.engine.backend != "embedded":
        raise ValueError("--spec-speedup-interval needs --rollout-backend embedded (the plain engine it starts beside "
                         "the fleet would need GPUs of its own on SGLang); drop the flag on SGLang")
    if not config.engine.server_args.get("speculative_algorithm"):
        raise ValueError("--spec-speedup-interval compares speculative against plain rollout, but no "
                         "--sglang-speculative-algorithm is set; set one or drop the flag")
    if config.debug_rollout_only or config.debug_train_only:
        raise ValueError("--spec-speedup-interval runs inside the training loop; drop it with --debug-rollout-only "
                         "or --debug-train-only")


def due(interval: int | None, rollout_id: int, num_rollout: int) -> bool:
    """Measure on every `interval`-th rollout and on the last one (so every run ends with a number)."""
    if not interval:
        return False
    return (rollout_id + 1) % interval == 0 or rollout_id + 1 == num_rollout


@dataclass
class TimedHalf:
    seconds: float
    response_tokens: int
    verify_ct: int

    @property
    def accept_length(self) -> float:
        """Token-weighted (SGLang's meaning): tokens per verify pass; 1.0 without speculation."""
        return self.response_tokens / self.verify_ct if self.verify_ct else 1.0


def speedup_metrics(spec: TimedHalf, plain: TimedHalf, spec_first: bool) -> dict:
    """The step keys of one measurement (pure)."""
    spec_tps = spec.response_tokens / spec.seconds if spec.seconds > 0 else 0.0
    plain_tps = plain.response_tokens / plain.seconds if plain.seconds > 0 else 0.0
    return {
        "spec_speedup": plain.seconds / spec.seconds if spec.seconds > 0 else None,
        "spec_speedup_tokens_per_s": spec_tps / plain_tps if plain_tps > 0 else None,
        "spec_speedup_spec_s": spec.seconds,
        "spec_speedup_plain_s": plain.seconds,
        "spec_speedup_spec_tokens": spec.response_tokens,
        "spec_speedup_plain_tokens": plain.response_tokens,
        "spec_speedup_accept_length": spec.accept_length,
        "spec_speedup_spec_first": spec_first,
    }


async def time_generation(url: str, auth, prompts: list[list[int]], params: dict, concurrency: int,
                          read_timeout_s: float) -> TimedHalf:
    """Every prompt through /generate on one engine, at most `concurrency` in flight; wall time of the batch."""
    from slime_spec.engines.client import AsyncEngineClient, async_session

    gate = asyncio.Semaphore(concurrency)
    async with async_session(read_timeout_s) as session:
        client = AsyncEngineClient(url, session, auth)

        async def one(ids: list[int]) -> dict:
            async with gate:
                out = await client.generate({"input_ids": ids, "sampling_params": dict(params),
                                             "return_logprob": True})
            return out["meta_info"]

        start = time.perf_counter()
        metas = await asyncio.gather(*(one(ids) for ids in prompts))
        seconds = time.perf_counter() - start
    return TimedHalf(seconds, sum(int(m.get("completion_tokens", 0)) for m in metas),
                     sum(int(m.get("spec_verify_ct", 0)) for m in metas))


class SpeedupProbe:
    """The plain engine and the measurement; `measure` is called by the driver after a weight sync."""

    def __init__(self, config: Config, spec_url: str):
        from slime_spec.engines.client import EngineAuth, EngineClient
        from slime_spec.engines.process import engine_server_process
        from slime_spec.rollout.sampling_params import sampling_params

        check_config(config)
        self.config, self.spec_url = config, spec_url
        self.dir = Path(config.output_dir) / "spec_speedup"
        self.weights_dir = self.dir / "weights"
        engine = plain_engine_config(config.engine)
        self.auth = EngineAuth.from_server_args(engine.server_args)
        self.params = sampling_params(config.rollout)
        self.process = engine_server_process(engine, log_path=self.dir / "plain_engine.log")
        self.process.start(config.rollout.engine_start_timeout)
        self.client = EngineClient(self.process.url, self.auth)
        self.count = 0
        print(f"[spec_speedup] plain engine (no speculation) at {self.process.url} for the speed-up measurement "
              f"every {config.spec_speedup_interval} rollout(s)", flush=True)

    def load_weights(self, state_dict: dict, version: str) -> None:
        """The trainer's current target weights into the plain engine (it has no MTP layer), through disk."""
        from safetensors.torch import save_file

        from slime_spec.weight_sync.gather import hf_mtp_matcher

        is_mtp = hf_mtp_matcher(json.loads((Path(self.config.engine.model_path) / "config.json").read_text()))
        state_dict = {k: v for k, v in state_dict.items() if not is_mtp(k)}
        if self.weights_dir.exists():
            shutil.rmtree(self.weights_dir)
        self.weights_dir.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in state_dict.items()}, str(self.weights_dir / "model.safetensors"),
                  metadata={"format": "pt"})
        out = self.client.post("/update_weights_from_disk", {"model_path": str(self.weights_dir),
                                                             "weight_version": version})
        if not out.get("success"):
            raise RuntimeError(f"--spec-speedup-interval: the plain engine did not load weights {version!r}: "
                               f"{out.get('message')} (log {self.process.log_path})")

    def measure(self, samples: list, state_dict: dict, version: str) -> dict:
        """Time the samples' prompts on the speculative engine and on the plain one (same weights, `version`)."""
        self.load_weights(state_dict, version)
        prompts = [list(s.tokens[:s.prompt_length]) for s in samples]
        spec_first = self.count % 2 == 0
        self.count += 1
        r = self.config.rollout

        def half(url: str) -> TimedHalf:
            return asyncio.run(time_generation(url, self.auth, prompts, self.params, r.sglang_server_concurrency,
                                               r.engine_start_timeout))

        if spec_first:
            spec, plain = half(self.spec_url), half(self.process.url)
        else:
            plain, spec = half(self.process.url), half(self.spec_url)
        return speedup_metrics(spec, plain, spec_first)

    def shutdown(self) -> None:
        self.client.close()
        self.process.stop()
