"""`python -m slime_spec.engine --model-path DIR [SGLang server flags]`: SGLang's own server, our engine behind it.

SGLang 0.5.23's `http_server.launch_server` runs unchanged (HTTP routes, TokenizerManager, DetokenizerManager,
OpenAI-compatible serving, auth, pause/continue, weight version); its scheduler process is ours
(`scheduler_process.run_scheduler_process`), plugged in through SGLang's `run_scheduler_process_func`.
"""

from __future__ import annotations

from slime_spec.engine import sglang_stand_ins

# First, before anything imports SGLang here (the processes SGLang spawns install them through scheduler_process).
from slime_spec.engine.model_executor import hf_configs

sglang_stand_ins.install()
hf_configs.register()

import os  # noqa: E402

# SGLang's TokenizerManager treats every SIGTERM (how the fleet stops and restarts an engine) as a crash: with its
# py-spy / CUDA-coredump diagnostics on, it sleeps 5 s first, then dumps the scheduler. Behind the embedded engine
# there are no SGLang CUDA kernels to dump, so those 5 s are pure stop latency; a user who wants the dump sets them.
os.environ.setdefault("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "0")
os.environ.setdefault("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "0")

import functools  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402

from slime_spec.engine.server_args import ServerArgsError, parse_server_args, sglang_argv  # noqa: E402

logger = logging.getLogger("slime_spec.engine")


def main(argv: list[str] | None = None) -> int:
    from slime_spec.common.logging_setup import quiet_known_noise
    quiet_known_noise()  # an engine server is no Ray worker: it installs the filters itself
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_server_args(argv)
    except ServerArgsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s %(name)s] %(message)s")
    for note in args.spec_warnings:
        logger.warning("speculative settings: %s", note)
    if args.ignored_flags:
        logger.info("accepted and ignored (performance-only for the embedded engine): %s",
                    ", ".join(args.ignored_flags))

    from sglang.srt.entrypoints import http_server
    from sglang.srt.server_args import prepare_server_args

    from slime_spec.engine.entrypoints.http_server import install_extensions
    from slime_spec.engine.managers.scheduler_process import run_detokenizer_process, run_scheduler_process
    server_args = prepare_server_args(sglang_argv(argv, args))
    install_extensions(http_server.app)
    fork_children_on_cpu(args.device)
    freeze_gc_once_listening(args.host, args.port)
    logger.info("serving %s on http://%s:%d through SGLang's front end (device %s, dtype %s, speculative %s)",
                args.model_path, args.host, args.port, args.device, args.dtype, args.spec)
    try:
        http_server.launch_server(server_args,
                                  run_scheduler_process_func=functools.partial(run_scheduler_process, args),
                                  run_detokenizer_process_func=run_detokenizer_process)
    finally:
        # A failed start raises here with the detokenizer process still running, and interpreter exit would wait
        # for it forever: the server's processes end with it, whichever way it ends.
        from sglang.srt.utils import kill_process_tree

        kill_process_tree(os.getpid(), include_parent=False)
    return 0


def freeze_gc_once_listening(host: str, port: int, timeout_s: float = 120.0) -> None:
    """SGLang freezes the collector of its HTTP server, scheduler and detokenizer after warmup by posting its own
    /freeze_gc (`_freeze_gc_after_server_warmup`). With `--skip-server-warmup` (slime always passes it) that post
    runs as uvicorn starts, is refused ("post-warmup freeze_gc failed" in the log), and the front end's heap is
    never frozen: its full collections then took ~0.55 s each under a rollout's requests (CPU engine, 1,920
    requests: two of them, 1.1 s). The post now waits until the server accepts connections, then runs SGLang's."""
    import socket
    import time

    from sglang.srt.entrypoints import http_server

    freeze = http_server._freeze_gc_after_server_warmup

    def when_listening(server_args) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection((host, port), timeout=1.0).close()
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    logger.warning("freeze_gc: %s:%d accepted no connection within %.0f s (%s); the collectors stay "
                                   "unfrozen", host, port, timeout_s, e)
                    return
                time.sleep(0.05)
        freeze(server_args)

    http_server._freeze_gc_after_server_warmup = when_listening


def fork_children_on_cpu(device: str) -> None:
    """SGLang starts its scheduler and detokenizer processes with `spawn` (a forked child could not use a CUDA
    context its parent made), so each imports torch and SGLang again: about two thirds of a CPU engine's start. A CPU
    engine has no CUDA context: its children are forked from the launcher, which has imported all of it and started
    no thread yet (SGLang starts them before its TokenizerManager). On CUDA nothing changes."""
    if device != "cpu":
        return
    import multiprocessing

    from sglang.srt.entrypoints import engine

    set_envs_and_config = engine._set_envs_and_config  # where SGLang sets the start method, before any child starts

    def then_fork(server_args) -> None:
        set_envs_and_config(server_args)
        multiprocessing.set_start_method("fork", force=True)

    engine._set_envs_and_config = then_fork


if __name__ == "__main__":
    sys.exit(main())
