"""Config classes transformers lacks for checkpoints the embedded engine serves, registered with AutoConfig.

SGLang's front end reads every checkpoint's config through `AutoConfig`. MiMo has no config class in
transformers: its checkpoints ship one as remote code (served with `--trust-remote-code`). A MiMo checkpoint
without that code (the tiny ones tests build) is read as Qwen2's config plus MiMo's MTP field; where MiMo's own
code is present and trusted, transformers still prefers it.
"""

from __future__ import annotations

from transformers import AutoConfig, Qwen2Config
from transformers.models.auto.configuration_auto import CONFIG_MAPPING


class MiMoConfig(Qwen2Config):
    model_type = "mimo"

    def __init__(self, num_nextn_predict_layers: int = 0, **kwargs):
        self.num_nextn_predict_layers = num_nextn_predict_layers
        super().__init__(**kwargs)


def register() -> None:
    if "mimo" not in CONFIG_MAPPING:
        AutoConfig.register("mimo", MiMoConfig)
