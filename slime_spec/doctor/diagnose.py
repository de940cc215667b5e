"""`slime-spec doctor <training flags> [--json]`: check a configuration before launch.

Reads local files only (config.json of target and draft, the prompt data), never contacts a
model hub and never needs a GPU. Exit code 0 without errors, 2 with.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from slime_spec.cluster.gpu_check import gpu_findings
from slime_spec.common.logging_setup import quiet_known_noise
from slime_spec.config import flags as F
from slime_spec.config.args import ArgsError, ParsedArgs, closest_flag, parse, sglang_parser, sglang_version, to_config
from slime_spec.config.run_config import Config
from slime_spec.doctor import flag_checks
from slime_spec.doctor import preflight as run_preflight
from slime_spec.doctor.codes import Finding, Rule
from slime_spec.doctor.spec_checks import CheckInput, run_checks

DISPLAY_PYTHON = "python3"


def read_hf_config(path: str | None, what: str) -> tuple[dict | None, list[Finding]]:
    if not path:
        return None, []
    cfg_path = Path(path) / "config.json"
    try:
        return json.loads(cfg_path.read_text()), []
    except FileNotFoundError:
        return None, [Rule.CONFIG_MISSING.finding(what=what, path=cfg_path)]
    except (OSError, json.JSONDecodeError) as e:
        return None, [Rule.CONFIG_BROKEN.finding(what=what, path=cfg_path, error=e)]


def longest_prompt_tokens(config: Config) -> tuple[int | None, list[Finding]]:
    """Tokens in the longest prompt of --prompt-data that --rollout-max-prompt-len keeps, if both data and
    tokenizer are local; every line of the data is checked, and the prompts left out are counted."""
    from slime_spec.doctor.preflight import dropped_prompt_findings, prompt_token_counts
    r = config.rollout
    if not r.prompt_data:
        return None, []
    if not Path(r.prompt_data).is_file():
        return None, [Rule.PROMPT_DATA_MISSING.finding(path=r.prompt_data)]
    tok, unchecked = None, []
    checkpoint = Path(r.hf_checkpoint)
    if (checkpoint / "tokenizer_config.json").exists() or (checkpoint / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(r.hf_checkpoint)
    else:
        unchecked = [Rule.PROMPT_LENGTH_UNCHECKED.finding()]
    counts, findings = prompt_token_counts(config, tok, r.prompt_data)
    if not counts:
        return None, findings + unchecked
    kept = [n for n in counts if not r.rollout_max_prompt_len or n <= r.rollout_max_prompt_len]
    return (max(kept) if kept else None), dropped_prompt_findings(config, counts)


def flag_findings(parsed: ParsedArgs) -> list[Finding]:
    """Unknown flags, and each parsed flag slime-spec does not act on: refused (an error per flag) or accepted
    (info, one line per reason listing its flags, so a slime script's many Megatron knobs read in a few lines)."""
    ns = parsed.namespace
    out: list[Finding] = []
    harmless: dict[str, list[str]] = {}
    for dest in sorted(parsed.set_flags - F.ACTED_ON):
        ignored, value, flag = F.NOT_ACTED_ON[dest], getattr(ns, dest), "--" + dest.replace("_", "-")
        shown = flag if value is True else f"{flag} {_shown_value(value)}"
        if ignored.accepted is None:
            harmless.setdefault(ignored.why, []).append(flag)
        elif not ignored.refuses(value):
            harmless.setdefault("these values ask for what slime-spec does anyway", []).append(shown)
        elif ignored.covered_by and ignored.covered_by(ns):
            harmless.setdefault(ignored.covered_why, []).append(flag)
        elif ignored.trainer_only and ns.debug_rollout_only:
            harmless.setdefault("no trainer runs with --debug-rollout-only", []).append(flag)
        else:
            out.append(Rule.FLAG_NOT_SUPPORTED.finding(flag=flag, value=shown[len(flag):], why=ignored.why,
                                                       fix=ignored.fix))
    out += [Rule.FLAG_NOT_HONOURED.finding(flags=", ".join(flags), why=why) for why, flags in harmless.items()]
    for old, new in parsed.renamed:
        out.append(Rule.SGLANG_FLAG_RENAMED.finding(old=old, new=new, version=sglang_version()))
    unknown = Rule.UNKNOWN_FLAG_ALLOWED if ns.allow_unknown_flags else Rule.UNKNOWN_FLAG
    out += [unknown.finding(flag=flag, hint=closest_flag(flag)) for flag in parsed.unknown_flags]
    return out


def _shown_value(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def range_findings(parsed: ParsedArgs, config: Config) -> list[Finding]:
    """Ranges and relations of the flags (slime_spec.doctor.flag_checks), on the values as parsed."""
    values = {**vars(parsed.namespace), **{f"sglang_{k}": v for k, v in config.engine.server_args.items()},
              "backend": config.engine.backend}
    return flag_checks.check(flag_checks.derived_values(values))


def rm_type_findings(config: Config) -> list[Finding]:
    """--rm-type names a built-in reward function (unless --custom-rm-path replaces it)."""
    from slime_spec.rollout.rewards import RM_TYPES
    r = config.rollout
    if r.rm_type is None or r.custom_rm_path or r.rm_type in RM_TYPES:
        return []
    return [Rule.RM_TYPE_UNKNOWN.finding(name=r.rm_type, known=", ".join(RM_TYPES))]


MEGATRON_LATEST = "latest_checkpointed_iteration.txt"  # Megatron's checkpoints and slime-spec's name it alike


def ref_load_findings(config: Config) -> list[Finding]:
    """--ref-load, read when the KL loss is on: it must exist and not be a Megatron (torch_dist) checkpoint,
    which slime's scripts pass and the trainer here cannot read."""
    t = config.train
    if config.debug_rollout_only or not t.use_kl_loss or not t.ref_load:
        return []
    path = Path(t.ref_load)
    if not path.exists():
        return [Rule.REF_LOAD_UNREADABLE.finding(path=path, problem="does not exist")]
    if (path / MEGATRON_LATEST).is_file() and not any(path.glob("iter_*/tp_rank_*.pt")):
        return [Rule.REF_LOAD_UNREADABLE.finding(path=path, problem="is a Megatron (torch_dist) checkpoint")]
    return []


def embedded_flag_findings(config: Config) -> list[Finding]:
    """Backend embedded: the forwarded SGLang flags its server would refuse at start, found before launch."""
    if config.engine.backend != "embedded":
        return []
    from slime_spec.engine.server_args import classify_flags, defaults_of, option_names
    parser = sglang_parser()
    names = {dest: "--sglang-" + opt[2:] for dest, opt in option_names(parser).items()}
    refused = list(classify_flags(config.engine.server_args, defaults_of(parser), names).refused)
    if config.engine.server_args.get("enable_memory_saver"):
        from slime_spec.engine.model_executor.memory_saver import unavailable_reason
        device = config.engine.server_args.get("device") or "cuda"  # the engine resolves "auto" where it runs
        reason = unavailable_reason(device if device == "cpu" else "cuda", flag="--sglang-enable-memory-saver")
        if reason:
            refused.append(reason)
    return [Rule.EMBEDDED_FLAG_REFUSED.finding(flags="; ".join(refused))] if refused else []


def engine_argvs(config: Config) -> list[dict]:
    return [{"index": i, "backend": config.engine.backend,
             "argv": config.engine.server_argv("127.0.0.1", 30000 + i,
                                                base_gpu_id=i * config.engine.num_gpus_per_engine,
                                                python=DISPLAY_PYTHON, engine_index=i)}
            for i in range(config.num_engines)]


def diagnose(parsed: ParsedArgs, launching: bool = False) -> tuple[Config | None, list[Finding]]:
    """Every finding for a configuration. `launching`: the run starts from here (training's preflight), so
    GPUs are checked against this machine or a local Ray head; otherwise only against a RAY_ADDRESS cluster."""
    try:
        config = to_config(parsed, refuse_unknown=False)
    except ArgsError as e:
        return None, [Rule.ARGS_ERROR.finding(error=e)]
    findings: list[Finding] = []
    target, f1 = read_hf_config(config.engine.model_path, "--hf-checkpoint")
    draft_path = config.engine.server_args.get("speculative_draft_model_path")
    draft, f2 = read_hf_config(draft_path, "--sglang-speculative-draft-model-path")
    findings += f1 + f2
    longest, f3 = longest_prompt_tokens(config) if target is not None else (None, [])
    findings += f3
    model_flags = {d: getattr(parsed.namespace, d) for d in (*F.MODEL_SHAPE_FLAGS, "multi_latent_attention")
                   if d in parsed.set_flags}
    findings += run_checks(CheckInput(
        sglang=config.engine.server_args, backend=config.engine.backend, sglang_version=sglang_version(),
        target_config=target, draft_config=draft, enable_mtp_training=config.train.enable_mtp_training,
        enable_draft_training=config.train.enable_draft_training,
        mtp_num_layers=config.train.mtp_num_layers, mtp_unroll_steps=config.train.mtp_unroll_steps,
        longest_prompt_tokens=longest,
        max_response_len=config.rollout.rollout_max_response_len, model_flags=model_flags,
        debug_rollout_only=config.debug_rollout_only, colocate=config.cluster.colocate,
        history_drafting=config.rollout.rollout_history_drafting, history_epochs=config.rollout.rollout_history_epochs,
        history_max_tokens=config.rollout.rollout_history_max_tokens,
        prompts_per_rollout=config.rollout.rollout_batch_size,
        spec_draft_sampling=config.engine.spec_draft_sampling, spec_auto=config.engine.spec_auto,
        weight_sync_transport=config.weight_sync.weight_sync_transport,
        tensor_model_parallel_size=config.train.tensor_model_parallel_size,
        expert_model_parallel_size=config.train.expert_model_parallel_size,
        expert_tensor_parallel_size=config.train.expert_tensor_parallel_size,
        pipeline_model_parallel_size=config.train.pipeline_model_parallel_size,
        decoder_first_pipeline_num_layers=config.train.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=config.train.decoder_last_pipeline_num_layers,
        in_flight_per_engine=config.engine.in_flight_per_engine,
    ), F.MODEL_SHAPE_FLAGS)
    findings += (flag_findings(parsed) + embedded_flag_findings(config) + rm_type_findings(config)
                 + ref_load_findings(config))
    ranges = range_findings(parsed, config)
    findings += ranges + (gpu_findings(config, launching) if not ranges else [])
    findings += run_preflight.output_findings(config) + run_preflight.resume_findings(config)
    if config.engine.backend == "embedded" and parsed.namespace.rollout_backend is None:
        findings.append(Rule.BACKEND_EMBEDDED.finding())
    return config, findings


def render_text(config: Config | None, findings: list[Finding], engines: list[dict]) -> str:
    lines = [f"slime-spec doctor (SGLang {sglang_version()})"]
    order = {"error": 0, "warning": 1, "info": 2}
    for f in sorted(findings, key=lambda f: order[f.level]):
        lines.append(f"  [{f.level.upper():7}] {f.code}: {f.message}")
        if f.fix:
            lines.append(f"            fix: {f.fix}")
    if not findings:
        lines.append("  no findings")
    for e in engines:
        lines.append(f"  engine {e['index']} ({e['backend']}; the port is chosen at launch): {' '.join(e['argv'])}")
    n_err = sum(f.level == "error" for f in findings)
    lines.append(f"{n_err} error(s), {sum(f.level == 'warning' for f in findings)} warning(s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    quiet_known_noise()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        from slime_spec.config.args import build_parser
        print("usage: slime-spec doctor <the same flags as training> [--json]\n")
        build_parser().print_help()
        return 0
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        parsed = parse(argv)
        config, findings = diagnose(parsed)
    except ArgsError as e:
        config, findings = None, [Rule.ARGS_ERROR.finding(error=e)]
    engines = engine_argvs(config) if config is not None else []
    if as_json:
        print(json.dumps({"sglang_version": sglang_version(), "findings": [f.to_dict() for f in findings],
                          "engines": engines}))
    else:
        print(render_text(config, findings, engines))
    return 2 if any(f.level == "error" for f in findings) else 0


if __name__ == "__main__":
    sys.exit(main())
