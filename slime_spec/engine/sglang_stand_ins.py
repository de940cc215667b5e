"""Test doubles for the few modules SGLang 0.5.23 imports that cannot import on a CPU machine.

The embedded engine runs SGLang's own HTTP server, TokenizerManager and DetokenizerManager, whose import chain
reaches modules built for CUDA hosts. Every such module that is not importable here (`ABSENT_ROOTS`, each with
its reason) is replaced by a stand-in whose every attribute is an inert placeholder class: the code paths that
would use it (vision preprocessing) never run for the text models the embedded engine serves. Where the real
package imports (a GPU machine with torchvision), the real one is used. transformers is asked about torchvision
first, so it keeps reporting "no torchvision" (the truth).

`install()` is idempotent and must run before the first `import sglang.srt.managers...` in every process: SGLang
starts its children with `spawn` on CUDA, and `python -m slime_spec.engine` installs it when its module is imported,
which every spawned child does first (on CPU the children are forked and inherit it).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

# Modules that cannot import on a CPU machine, and why SGLang's import chain reaches them. Only a module whose
# absence breaks an import is listed: one SGLang probes with try/except (sgl_kernel, flashinfer) must stay absent,
# or SGLang would take the stand-in for the real kernels.
ABSENT_ROOTS = {
    # PyPI's torchvision fails at import beside the CPU torch ("operator torchvision::nms does not exist");
    # SGLang reaches it through configs -> nano_nemotron_vl -> multimodal/internvl_utils (vision preprocessing).
    "torchvision": "vision preprocessing (sglang.srt.multimodal)",
}


def _absent_attribute(owner, name: str, module: str) -> type:
    """An absent class for any attribute of an absent module or class, made once and kept on `owner`."""
    if name.startswith("__"):
        raise AttributeError(name)
    cls = AbsentMeta(name, (Absent,), {"__module__": module})
    setattr(owner, name, cls)
    return cls


class AbsentMeta(type):
    def __getattr__(cls, name):
        return _absent_attribute(cls, name, cls.__module__)

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
        return _absent_attribute(self, name, self.__name__)


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


def install() -> None:
    if any(isinstance(f, AbsentModuleFinder) for f in sys.meta_path):
        return
    from transformers.utils import import_utils

    absent = {root for root in ABSENT_ROOTS if importlib.util.find_spec(root) is None}
    if "torchvision" in absent:
        assert not import_utils.is_torchvision_available()  # cached: transformers never sees the double
    sys.meta_path.insert(0, AbsentModuleFinder(absent))
    _no_sglang_kernels_without_sgl_kernel()


def _no_sglang_kernels_without_sgl_kernel() -> None:
    """On a CUDA host without sgl_kernel (SGLang's CUDA kernels, absent where only SGLang's Python sources are
    installed), SGLang's modules import sgl_kernel unguarded wherever its `is_cuda()` holds. No SGLang kernel runs in
    the embedded engine's processes (the front end serves HTTP and tokenizes; the scheduler runs our own model), so
    SGLang is told it has no CUDA device there. A host with sgl_kernel, and every CPU host, is left as it is."""
    import torch

    if importlib.util.find_spec("sgl_kernel") is not None or not torch.cuda.is_available():
        return
    from sglang.srt import utils
    from sglang.srt.utils import common

    common.is_cuda = utils.is_cuda = lambda: False
