"""The stand-ins for modules SGLang imports that cannot import on a CPU machine live in the product module
`slime_spec.engine.sglang_stand_ins` (the embedded engine's server installs them too); tests install them
through this name."""

from slime_spec.engine.sglang_stand_ins import ABSENT_ROOTS, AbsentModuleFinder, install  # noqa: F401
