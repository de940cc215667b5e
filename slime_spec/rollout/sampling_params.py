"""SGLang `sampling_params` built from the rollout flags, exactly as slime sends them."""

from __future__ import annotations

from slime_spec.config.run_config import RolloutConfig


def sampling_params(cfg: RolloutConfig) -> dict:
    """The per-request sampling params; each request gets its own copy.

    `no_stop_trim=True` keeps the stop string in the text so the response tokens and text agree
    (slime does the same); `top_k=-1` means no top-k cut in SGLang.
    """
    if cfg.rollout_max_response_len < 1:
        raise ValueError(f"--rollout-max-response-len={cfg.rollout_max_response_len}: must be >= 1")
    if cfg.rollout_temperature < 0:
        raise ValueError(f"--rollout-temperature={cfg.rollout_temperature}: must be >= 0 (0 means greedy)")
    if not 0 < cfg.rollout_top_p <= 1:
        raise ValueError(f"--rollout-top-p={cfg.rollout_top_p}: must be in (0, 1]")
    return dict(
        temperature=cfg.rollout_temperature,
        top_p=cfg.rollout_top_p,
        top_k=cfg.rollout_top_k,
        max_new_tokens=cfg.rollout_max_response_len,
        stop=list(cfg.rollout_stop) or None,
        stop_token_ids=list(cfg.rollout_stop_token_ids) or None,
        skip_special_tokens=cfg.rollout_skip_special_tokens,
        no_stop_trim=True,
        spaces_between_special_tokens=False,
    )
