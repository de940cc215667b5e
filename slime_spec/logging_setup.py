"""Silence the known-harmless warnings that every slime-spec process would otherwise print.

Called at process start: by the driver (`slime_spec.train`), `slime-spec demo`, doctor and the embedded
server (`python -m slime_spec.engine`), and, through Ray's `worker_process_setup_hook` (see ray_env.py),
by every Ray worker before its first task. Each
filter names one message and why it says nothing about this run:

- megatron-core, on import without NVIDIA Apex / Transformer Engine (7 lines per train process): the
  trainer builds megatron's *local* layer spec, torch norms and torch optimizers, so there is nothing
  Apex would have been used for.
- megatron-core's TransformerConfig on its default cuda_graph_scope ("full scope is deprecated"): the
  trainer captures no CUDA graphs.
- transformers, when a plain `PretrainedConfig` (whose model_type is "") reads a checkpoint's
  config.json ("You are using a model of type `mimo` to instantiate a model of type ``"): the generic
  config keeps every key; no model class is built from it.
"""

from __future__ import annotations

import logging
import warnings

APEX_FALLBACK = r"(Transformer Engine and )?Apex (is|are) not installed"
APEX_IMPORT_NOTE = r"The following imports from `dynamic_context\.py` will be removed"
CUDA_GRAPH_SCOPE = r"full scope is deprecated"
GENERIC_CONFIG_MESSAGE = "to instantiate a model of type ``."


class _DropGenericConfigWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return GENERIC_CONFIG_MESSAGE not in record.getMessage()


def quiet_known_noise() -> None:
    """Install the filters; calling it again adds nothing."""
    warnings.filterwarnings("ignore", message=APEX_FALLBACK, category=UserWarning)
    warnings.filterwarnings("ignore", message=APEX_IMPORT_NOTE, category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=CUDA_GRAPH_SCOPE, category=UserWarning)
    config_logger = logging.getLogger("transformers.configuration_utils")
    if not any(isinstance(f, _DropGenericConfigWarning) for f in config_logger.filters):
        config_logger.addFilter(_DropGenericConfigWarning())
