"""The known-harmless warnings are dropped; anything else still shows."""

import logging
import warnings

from slime_spec.common.logging_setup import quiet_known_noise


def test_known_noise_is_dropped_and_other_warnings_are_not(caplog):
    quiet_known_noise()
    quiet_known_noise()  # idempotent
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        quiet_known_noise()  # catch_warnings reset the filters: install them again inside
        warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning)
        warnings.warn("full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.", UserWarning)
        warnings.warn("Only CUDA, HIP and XPU support AWQ currently.", UserWarning)
        warnings.warn("Only CUDA, MUSA and NPU support GGUF quantization currently.", UserWarning)
        warnings.warn("something else", UserWarning)
    assert [str(w.message) for w in caught] == ["something else"]

    log = logging.getLogger("transformers.configuration_utils")
    with caplog.at_level(logging.WARNING, logger="transformers.configuration_utils"):
        log.warning("You are using a model of type `mimo` to instantiate a model of type ``. This may be expected")
        log.warning("You are using a model of type `mimo` to instantiate a model of type `llama`. Careful")
    assert [r.getMessage()[-7:] for r in caplog.records] == ["Careful"]
    assert len(log.filters) == 1


def test_rays_token_auth_enabled_notice_is_dropped_and_the_disabled_warning_is_not(caplog):
    from slime_spec.common.logging_setup import RAY_TOKEN_AUTH_LOGGER
    quiet_known_noise()
    log = logging.getLogger(RAY_TOKEN_AUTH_LOGGER)
    with caplog.at_level(logging.WARNING, logger=RAY_TOKEN_AUTH_LOGGER):
        log.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
        log.warning("Token authentication is disabled for this Ray cluster. Anyone with network access ...")
    assert [r.getMessage()[:40] for r in caplog.records] == ["Token authentication is disabled for thi"]
