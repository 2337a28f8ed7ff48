"""Import timm on a machine without torchvision and Pillow.

timm 1.0.31 imports `torchvision.ops.misc.FrozenBatchNorm2d` and Pillow at import time (for its
data pipeline and freezing utilities), but its model definitions run on torch alone.  The
torchvision wheel the registry has does not load against torch 2.13.0+cpu (see
../shared/ECOSYSTEM.md), so `import_timm()` lets timm import against stand-ins for those two
packages, then takes the stand-ins out of `sys.modules` and the import system again, so nothing
else in the test session (transformers' availability checks) sees a torchvision that is not there.
"""

from __future__ import annotations

import enum
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

_STUBBED = ("torchvision", "PIL")


class _StubMeta(type):
    """A stub class whose every attribute is another stub class (PIL's `Image.BICUBIC`)."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _StubMeta(name, (), {})
        setattr(cls, name, value)
        return value


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "InterpolationMode":
            value = enum.Enum("InterpolationMode", "NEAREST BILINEAR BICUBIC BOX HAMMING LANCZOS NEAREST_EXACT")
        else:
            value = _StubMeta(name, (), {})
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in _STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        m = _Stub(spec.name)
        m.__path__ = []
        m.__version__ = "0.0"
        return m

    def exec_module(self, module):
        pass



def import_timm() -> Any:
    """timm, imported for real if torchvision and Pillow are installed, else against stand-ins."""
    try:
        import PIL  # noqa: F401
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or present and broken (a CUDA wheel on CPU torch)
        pass
    else:
        return importlib.import_module("timm")
    for name in [n for n in sys.modules if n.split(".")[0] in _STUBBED]:
        del sys.modules[name]
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    try:
        return importlib.import_module("timm")
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.split(".")[0] in _STUBBED]:
            del sys.modules[name]
