"""`python -m slime_spec.engine --model-path DIR [SGLang server flags]`: the embedded SGLang-compatible server."""

from __future__ import annotations

import logging
import sys

from slime_spec.engine.server_args import EngineServerArgs, ServerArgsError, parse_server_args

logger = logging.getLogger("slime_spec.engine")


def make_core_factory(args: EngineServerArgs):
    def make_core():
        import torch

        from slime_spec.engine.core import EngineCore

        torch.manual_seed(args.random_seed)
        return EngineCore(args.model_path, args.spec, dtype=args.dtype, device=args.device,
                          max_running_requests=args.max_running_requests, context_length=args.context_length,
                          seed=args.random_seed, draft_sampling=args.spec_draft_sampling, spec_auto=args.spec_auto,
                          cuda_graph=args.cuda_graph, overlap_schedule=args.overlap_schedule,
                          kernels=args.kernels)
    return make_core


def main(argv: list[str] | None = None) -> int:
    from slime_spec.logging_setup import quiet_known_noise

    quiet_known_noise()  # an engine server is no Ray worker: it installs the filters itself
    try:
        args = parse_server_args(sys.argv[1:] if argv is None else argv)
    except ServerArgsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s %(name)s] %(message)s")
    for note in args.spec_warnings:
        logger.warning("speculative settings: %s", note)
    if args.ignored_flags:
        logger.info("accepted and ignored (performance-only for the embedded engine): %s",
                    ", ".join(args.ignored_flags))

    import uvicorn

    from slime_spec.engine.http_server import create_app, freeze_gc
    from slime_spec.engine.scheduler import EngineLoop
    from slime_spec.engine.weight_updater import WeightUpdater

    loop = EngineLoop(make_core_factory(args))
    try:
        loop.start()
    except ValueError as e:  # the engine refused its configuration (e.g. SPEC_UNSUPPORTED_BY_BACKEND)
        print(f"error: {e}", file=sys.stderr)
        return 2
    weights = WeightUpdater(args.weight_version, args.model_path, args.device, args.has_draft_model)
    app = create_app(args, loop, weights)
    frozen = freeze_gc(args.gc_threshold)  # as SGLang does once its server is warm
    logger.info("garbage collector frozen after start-up (%d objects)%s", frozen,
                f", thresholds {args.gc_threshold}" if args.gc_threshold else "")
    logger.info("serving %s on http://%s:%d (device %s, dtype %s, speculative %s)", args.model_path, args.host,
                args.port, args.device, args.dtype, args.spec)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), access_log=False,
                timeout_graceful_shutdown=5)
    loop.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
