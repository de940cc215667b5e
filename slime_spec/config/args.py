"""Every flag, parsed once into a typed `Config`.

Three sources, in increasing precedence: `--config file.yaml`, the slime-compatible flags of
`flags.py`, and `--sglang-<flag>` for every SGLang server flag. The `--sglang-*` set is built
at start-up from the installed SGLang's own `ServerArgs.add_cli_args`, so it always matches
the SGLang in use; values are parsed by SGLang's own parser and forwarded verbatim.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib.util
from dataclasses import dataclass, field, fields, replace

from slime_spec.config import flags as F
from slime_spec.config.run_config import (
    Backend,
    ClusterConfig,
    Config,
    EngineConfig,
    RolloutConfig,
    TrainConfig,
    WandbConfig,
    WeightSyncConfig,
    colocated_engine_flags,
    in_flight_per_engine,
    resolve_global_batch_size,
    resolve_loss_type,
    resolve_rollout_gpus,
    resolve_transport,
)

SGLANG_PREFIX = "--sglang-"
# SGLang flags renamed between releases: old -> new. Applied only when the installed SGLang
# lacks the old name and has the new one, so each SGLang gets the spelling it understands.
SGLANG_RENAMED = {
    "--cuda-graph-bs": "--cuda-graph-bs-decode",
    "--cuda-graph-max-bs": "--cuda-graph-max-bs-decode",
}


class ArgsError(ValueError):
    """A flag problem the user must fix; the message names the flag and the fix."""


@dataclass
class ParsedArgs:
    """What the command line said, before it becomes a `Config`."""

    namespace: argparse.Namespace
    sglang_tokens: list[str]  # forwarded tokens, `--sglang-` stripped to `--`, in the user's order
    sglang_set: dict  # SGLang dest -> parsed value, for the flags the user set
    set_flags: set[str]  # dests the user set explicitly (CLI or YAML)
    unknown_flags: list[str] = field(default_factory=list)  # non-SGLang flags we do not know
    renamed: list[tuple[str, str]] = field(default_factory=list)  # (user's --sglang- flag, forwarded flag)


@functools.cache
def sglang_parser(prog: str = "sglang.launch_server", description: str | None = None,
                  standalone: bool = False) -> argparse.ArgumentParser:
    """SGLang's own server parser (`ServerArgs.add_cli_args`), built once per use.

    Embedded in our CLI (default): no --help of its own and errors raised, not exited. `standalone=True`
    is the embedded engine's own command line: --help, and argparse's usual exit on a bad flag.
    """
    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError as e:  # pragma: no cover - the venv always has it
        raise ArgsError(f"cannot import SGLang's ServerArgs ({e}); run `make venv` or install sglang") from e
    parser = argparse.ArgumentParser(prog=prog, description=description, add_help=standalone,
                                     exit_on_error=standalone)
    ServerArgs.add_cli_args(parser)
    return parser


def sglang_version() -> str:
    import sglang

    return getattr(sglang, "__version__", "unknown")


def _sglang_options() -> dict[str, argparse.Action]:
    return {opt: a for a in sglang_parser()._actions for opt in a.option_strings if opt.startswith("--")}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slime-spec",
        description="slime-compatible flags. Every SGLang server flag is also accepted as --sglang-<flag>\n"
        "(generated from the installed SGLang). These are set by slime-spec and refused in --sglang- form:\n"
        + "\n".join(f"  --{d.replace('_', '-')} ({why})" for d, why in F.FRAMEWORK_OWNED_SGLANG.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    for group_name, entries in F.GROUPS.items():
        group = parser.add_argument_group(group_name)
        for flag, kwargs in entries:
            group.add_argument(flag, **kwargs)
    return parser


def _yaml_to_argv(path: str) -> list[str]:
    from omegaconf import OmegaConf

    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as e:  # OmegaConf raises many types; all mean "this file is not usable"
        raise ArgsError(f"--config {path}: cannot read YAML ({e})") from e
    if not isinstance(data, dict):
        raise ArgsError(f"--config {path}: expected a mapping of flag names to values")
    argv: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def _split_flag_groups(argv: list[str]) -> list[list[str]]:
    """[['--lr', '1e-6'], ['--colocate'], ...]: each flag with the tokens up to the next flag."""
    groups: list[list[str]] = []
    for tok in argv:
        if tok.startswith("--"):
            groups.append([tok])
        elif groups:
            groups[-1].append(tok)
        else:
            raise ArgsError(f"unexpected argument {tok!r}: flags start with --")
    return groups


NEAR_MISS_EDITS = 2  # typos; a valid Megatron flag we do not parse is not a near miss of one of ours


def _edits(a: str, b: str) -> int:
    """Levenshtein distance."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def _closest(name: str, options) -> str:
    """'; did you mean X?' when `name` is a typo of option X (at most NEAR_MISS_EDITS edits), else ''."""
    near = [o for o in difflib.get_close_matches(name, list(options), n=3, cutoff=0.8)
            if _edits(name, o) <= NEAR_MISS_EDITS]
    return f"; did you mean {near[0]}?" if near else ""


def closest_flag(flag: str) -> str:
    """'; did you mean ...?' with the slime-spec flag nearest to an unknown one, or ''."""
    return _closest(flag, [opt for entries in F.GROUPS.values() for opt, _ in entries])


def refuse_unknown_flags(p: ParsedArgs) -> None:
    """Unknown flags stop the run, as Megatron's parser would, unless --allow-unknown-flags."""
    if p.unknown_flags and not p.namespace.allow_unknown_flags:
        raise ArgsError("unknown flag(s): " + ", ".join(f + closest_flag(f) for f in p.unknown_flags)
                        + ". Fix the spelling, or pass --allow-unknown-flags if these are your own flags")


def parse(argv: list[str]) -> ParsedArgs:
    """Parse the command line (and `--config` YAML). Raises ArgsError with a fix on bad input."""
    argv = list(argv)
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise ArgsError("--config needs a YAML file path")
        argv = _yaml_to_argv(argv[i + 1]) + argv[:i] + argv[i + 2:]

    own_parser = build_parser()
    own_options = {opt for a in own_parser._actions for opt in a.option_strings}
    sg_options = _sglang_options()
    own_tokens, sg_tokens, unknown, renamed = [], [], [], []
    for group in _split_flag_groups(argv):
        flag = group[0].split("=", 1)[0]
        if flag in own_options:
            own_tokens += group
        elif flag.startswith(SGLANG_PREFIX):
            sg_flag = "--" + flag[len(SGLANG_PREFIX):]
            if sg_flag not in sg_options and SGLANG_RENAMED.get(sg_flag) in sg_options:
                renamed.append((flag, SGLANG_PREFIX + SGLANG_RENAMED[sg_flag][2:]))
                sg_flag = SGLANG_RENAMED[sg_flag]
            action = sg_options.get(sg_flag)
            if action is None:
                raise ArgsError(f"unknown SGLang flag {flag} (SGLang {sglang_version()} has no {sg_flag})"
                                + _closest(flag, [SGLANG_PREFIX + o[2:] for o in sg_options]))
            if action.dest in F.FRAMEWORK_OWNED_SGLANG:
                raise ArgsError(f"{flag} is not forwarded: it is {F.FRAMEWORK_OWNED_SGLANG[action.dest]}; remove it")
            sg_tokens += [sg_flag + group[0][len(flag):], *group[1:]]
        else:
            unknown.append(flag)

    try:
        ns = own_parser.parse_args(own_tokens)
    except SystemExit as e:  # argparse already printed the flag and the problem
        raise ArgsError("invalid slime-spec flags (see the message above)") from e
    set_flags = {a.dest for a in own_parser._actions
                 if any(t.split("=", 1)[0] in a.option_strings for t in own_tokens)}
    sg_set = _parse_sglang(sg_tokens, sg_options)
    return ParsedArgs(ns, sg_tokens, sg_set, set_flags, unknown, renamed)


def _parse_sglang(tokens: list[str], options: dict[str, argparse.Action]) -> dict:
    if not tokens:
        return {}
    try:
        ns = sglang_parser().parse_args(["--model-path", "__unset__", *tokens])
    except (argparse.ArgumentError, SystemExit) as e:
        raise ArgsError(f"invalid --sglang-* value: {e}") from e
    dests = {options[t.split("=", 1)[0]].dest for t in tokens if t.startswith("--") and t.split("=", 1)[0] in options}
    return {d: getattr(ns, d) for d in dests}


def full_sglang_available() -> bool:
    """True where the real SGLang server can run: its CUDA kernels package and a CUDA GPU."""
    if importlib.util.find_spec("sgl_kernel") is None:
        return False
    import torch

    return torch.cuda.is_available()


def resolve_backend(rollout_backend: str | None) -> Backend:
    """--rollout-backend, else sglang where it can run and the embedded engine elsewhere."""
    return rollout_backend or ("sglang" if full_sglang_available() else "embedded")


def from_flags(cls, namespace: argparse.Namespace, **derived):
    """`cls` with each field set from the flag of the same dest; `derived` gives the fields computed from several."""
    values = {f.name: F.config_value(f.name, getattr(namespace, f.name))
              for f in fields(cls) if f.name not in derived}
    return cls(**values, **derived)


def to_config(p: ParsedArgs, refuse_unknown: bool = True) -> Config:
    """The typed config; `refuse_unknown=False` for doctor, which reports unknown flags itself."""
    if refuse_unknown:
        refuse_unknown_flags(p)
    a = p.namespace
    if not a.hf_checkpoint:
        raise ArgsError("--hf-checkpoint is required: the HF model directory the engines and trainer load")
    if a.optimizer != "adam":
        raise ArgsError(f"--optimizer {a.optimizer}: the trainer implements adam (AdamW) only; use --optimizer adam")
    backend = resolve_backend(a.rollout_backend)
    tokens, server_args = list(p.sglang_tokens), dict(p.sglang_set)
    if backend == "sglang" and a.colocate and not a.debug_rollout_only:
        extra = colocated_engine_flags(server_args, a.offload_rollout)
        tokens += extra
        server_args.update(_parse_sglang(extra, _sglang_options()))
    engine = EngineConfig(
        backend=backend, model_path=a.hf_checkpoint,
        num_gpus_per_engine=a.rollout_num_gpus_per_engine, forwarded_argv=tuple(tokens),
        server_args=server_args, seed=a.seed, spec_draft_sampling=a.spec_draft_sampling,
        spec_auto=a.spec_auto,
    )
    train = from_flags(
        TrainConfig, a, loss_type=resolve_loss_type(a.loss_type),
        global_batch_size=resolve_global_batch_size(a.global_batch_size, a.rollout_batch_size, a.n_samples_per_prompt,
                                                    a.num_steps_per_rollout))
    transport = a.weight_sync_transport or ("disk" if a.update_weight_transport == "disk" else None)
    weight_sync = from_flags(WeightSyncConfig, a, weight_sync_transport=resolve_transport(transport, a.colocate),
                             check_weight_sync=a.check_weight_sync or a.check_weight_update_equal)
    cluster = from_flags(ClusterConfig, a, rollout_num_gpus=resolve_rollout_gpus(
        a.rollout_num_gpus, a.colocate, a.actor_num_nodes * a.actor_num_gpus_per_node, backend))
    config = from_flags(
        Config, a, cluster=cluster, engine=engine, rollout=from_flags(RolloutConfig, a),
        train=train, weight_sync=weight_sync,
        wandb=from_flags(WandbConfig, a, wandb_dir=a.wandb_dir or a.output_dir),  # offline runs land in the run's dir
    )
    # as many engines as the flags say; on GPUs the placement may start another count (start_rollout_manager)
    return replace(config, engine=replace(engine, in_flight_per_engine=in_flight_per_engine(config.rollout,
                                                                                            config.num_engines)))


def parse_config(argv: list[str]) -> tuple[Config, ParsedArgs]:
    parsed = parse(argv)
    return to_config(parsed), parsed
