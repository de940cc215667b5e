"""The known-harmless warnings are dropped; anything else still shows."""

import logging
import warnings

from slime_spec.logging_setup import quiet_known_noise


def test_known_noise_is_dropped_and_other_warnings_are_not(caplog):
    quiet_known_noise()
    quiet_known_noise()  # idempotent
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        quiet_known_noise()  # catch_warnings reset the filters: install them again inside
        warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning)
        warnings.warn("full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.", UserWarning)
        warnings.warn("something else", UserWarning)
    assert [str(w.message) for w in caught] == ["something else"]

    log = logging.getLogger("transformers.configuration_utils")
    with caplog.at_level(logging.WARNING, logger="transformers.configuration_utils"):
        log.warning("You are using a model of type `mimo` to instantiate a model of type ``. This may be expected")
        log.warning("You are using a model of type `mimo` to instantiate a model of type `llama`. Careful")
    assert [r.getMessage()[-7:] for r in caplog.records] == ["Careful"]
    assert len(log.filters) == 1
