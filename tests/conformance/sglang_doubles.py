"""Test doubles that let SGLang 0.5.23's own modules import on this CPU machine.

SGLang is installed with `--no-deps`: a handful of packages its import chain touches are absent
here (GPU kernels, vision, OpenAI client types, parsers). Each is replaced by a double whose every
attribute is an inert placeholder class; no code we test calls into them. `dill` gets a double
backed by `pickle` (SGLang serializes one default logit processor with it at import time).
transformers is asked about torchvision first, so it keeps reporting "no torchvision" (the truth).

`install()` is idempotent and must run before the first `import sglang.srt.managers...`.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import importlib.machinery
import pickle
import sys
import types

# Module roots absent from this venv, and why SGLang's import chain reaches them.
ABSENT_ROOTS = {
    "torchvision": "vision preprocessing (sglang.srt.multimodal)",
    "tvm_ffi": "JIT CUDA kernels (sglang.kernels)",
    "sentencepiece": "tokenizers of vision-language configs",
    "compressed_tensors": "quantization configs",
    "gguf": "GGUF quantization",
    "openai": "OpenAI-compatible protocol types",
    "partial_json_parser": "function-call parsing",
    "einops": "tensor reshapes in expert balancing",
    "setproctitle": "process titles (sglang.srt.managers.scheduler)",
}


class AbsentMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = AbsentMeta(name, (Absent,), {"__module__": cls.__module__})
        setattr(cls, name, sub)
        return sub

    def __iter__(cls):
        return iter(())

    def __or__(cls, other):
        return cls

    __ror__ = __or__

    def __getitem__(cls, key):
        return cls


class Absent(metaclass=AbsentMeta):
    """Placeholder for any object of an absent module: subclassable, callable, a no-op decorator."""

    def __init__(self, *args, **kwargs):
        pass

    def __init_subclass__(cls, **kwargs):
        pass

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        from pydantic_core import core_schema

        return core_schema.any_schema()

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else Absent()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Absent()

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False


class AbsentModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        cls = AbsentMeta(name, (Absent,), {"__module__": self.__name__})
        setattr(self, name, cls)
        return cls


class AbsentModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stands in for the roots in `roots` only: where a package is really installed (the GPU machine has
    torchvision, sentencepiece and einops), the real one is imported."""

    def __init__(self, roots: set[str]):
        self.roots = roots

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = AbsentModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def dill_double() -> types.ModuleType:
    module = types.ModuleType("dill")
    module.__dict__.update({k: v for k, v in vars(pickle).items() if not k.startswith("__")})
    module.__spec__ = importlib.machinery.ModuleSpec("dill", None)
    module.extend = lambda use_dill=True: None
    return module


def install() -> None:
    if any(isinstance(f, AbsentModuleFinder) for f in sys.meta_path):
        return
    from transformers.utils import import_utils

    absent = {root for root in ABSENT_ROOTS if importlib.util.find_spec(root) is None}
    if "torchvision" in absent:
        assert not import_utils.is_torchvision_available()  # cached: transformers never sees the double
    sys.meta_path.insert(0, AbsentModuleFinder(absent))
    try:
        import dill  # noqa: F401
    except ImportError:
        sys.modules["dill"] = dill_double()
