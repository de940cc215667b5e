"""Silence the known-harmless warnings that every slime-spec process would otherwise print.

Called at process start: by the driver (`slime_spec.driver.loop`), `slime-spec demo`, doctor and the embedded
server (`python -m slime_spec.engine`), and, through Ray's `worker_process_setup_hook` (see cluster/ray_env.py),
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
- SGLang, when its quantization modules are imported on a machine without CUDA ("Only CUDA, HIP and XPU support
  AWQ currently", the same for GGUF): slime-spec loads no AWQ or GGUF weights.
- Ray, on starting a local instance ("Token authentication is enabled for this Ray cluster"): Ray turned on its
  default protection for the private instance slime-spec starts on the loopback address; nothing to act on.
  The opposite notice (authentication disabled) still shows.
"""

from __future__ import annotations

import logging
import warnings

APEX_FALLBACK = r"(Transformer Engine and )?Apex (is|are) not installed"
APEX_IMPORT_NOTE = r"The following imports from `dynamic_context\.py` will be removed"
CUDA_GRAPH_SCOPE = r"full scope is deprecated"
SGLANG_QUANT_NO_CUDA = r"Only CUDA, .* support (AWQ|GGUF)"
GENERIC_CONFIG_MESSAGE = "to instantiate a model of type ``."
RAY_TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
RAY_TOKEN_AUTH_ENABLED = "Token authentication is enabled for this Ray cluster"


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def _drop(logger_name: str, text: str) -> None:
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, _DropMessage) and f.text == text for f in logger.filters):
        logger.addFilter(_DropMessage(text))


def quiet_known_noise() -> None:
    """Install the filters; calling it again adds nothing."""
    warnings.filterwarnings("ignore", message=APEX_FALLBACK, category=UserWarning)
    warnings.filterwarnings("ignore", message=APEX_IMPORT_NOTE, category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=CUDA_GRAPH_SCOPE, category=UserWarning)
    warnings.filterwarnings("ignore", message=SGLANG_QUANT_NO_CUDA, category=UserWarning)
    _drop("transformers.configuration_utils", GENERIC_CONFIG_MESSAGE)
    _drop(RAY_TOKEN_AUTH_LOGGER, RAY_TOKEN_AUTH_ENABLED)
