"""`MODULE:ATTR` -> the model to export.

MODULE is a dotted module name importable from the current directory or `sys.path`
(`mypkg.models`), or a path to a Python file (`examples/quickstart.py`).  ATTR (dotted for
nested attributes) may be:

- an `nn.Module` instance: exported as it is;
- an `nn.Module` subclass: constructed with no arguments;
- a function every parameter of which has a default: a factory, called with no arguments; it
  must return an `nn.Module` (or a function to export);
- any other function: exported itself, as `predispatch.export(fn, ...)` does.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import types
from dataclasses import dataclass
from typing import Any

from torch import nn

from predispatch.cli.failures import ModelError, UsageError
from predispatch.errors import user_frame

_FORM = "MODULE:ATTR, e.g. mypkg.models:Net or path/to/model.py:Net"


@dataclass(frozen=True)
class Target:
    """A parsed `MODULE:ATTR`; `module` is a module name or a path to a .py file."""

    module: str
    attr: str

    @property
    def is_file(self) -> bool:
        return self.module.endswith(".py") or os.sep in self.module or "/" in self.module

    def __str__(self) -> str:
        return f"{self.module}:{self.attr}"


def parse_target(text: str) -> Target:
    module, sep, attr = text.rpartition(":")
    if not sep or not module or not attr:
        raise UsageError(f"{text!r} is not of the form {_FORM}")
    return Target(module, attr)


def load_model(target: Target) -> Any:
    """Import, look up and (for classes and factories) create the model; see the module docstring."""
    module = _import(target)
    obj: Any = module
    for i, part in enumerate(target.attr.split(".")):
        if not hasattr(obj, part):
            owner = target.module if i == 0 else ".".join(target.attr.split(".")[:i])
            raise UsageError(f"{owner!r} has no attribute {part!r}", fix=_candidates(obj))
        obj = getattr(obj, part)
    return _instantiate(obj, target)


def _import(target: Target) -> types.ModuleType:
    if target.is_file:
        return _import_file(target.module)
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: the current directory comes first
    try:
        return importlib.import_module(target.module)
    except ModuleNotFoundError as exc:
        if exc.name and (target.module == exc.name or target.module.startswith(exc.name + ".")):
            raise UsageError(
                f"no module named {target.module!r} (searched the current directory and sys.path)",
                fix="run from the directory that contains it, add its directory to PYTHONPATH, or "
                "give the file's path: path/to/model.py:ATTR",
            ) from exc
        raise _raised_while(f"importing {target.module!r}", exc) from exc
    except Exception as exc:  # noqa: BLE001 - the user's module failed to import; report where
        raise _raised_while(f"importing {target.module!r}", exc) from exc


def _import_file(path: str) -> types.ModuleType:
    if not os.path.isfile(path):
        raise UsageError(f"no such file: {path!r}", fix=f"give an existing Python file, {_FORM}")
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in sys.path:
        sys.path.insert(0, directory)  # as `python path/to/model.py` does: its siblings import
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001
        del sys.modules[name]
        raise _raised_while(f"importing {path!r}", exc) from exc
    return module


def _instantiate(obj: Any, target: Target) -> Any:
    if isinstance(obj, nn.Module):
        return obj
    if isinstance(obj, type):
        if not issubclass(obj, nn.Module):
            raise UsageError(f"{target} is a class but not an nn.Module subclass", fix="point at an nn.Module")
        return _call(obj, target, "constructing")
    if callable(obj):
        if _required_parameters(obj):
            return obj  # a function to export, taking the example inputs
        made = _call(obj, target, "calling the factory")
        if isinstance(made, nn.Module) or callable(made):
            return made
        raise UsageError(
            f"the factory {target}() returned {type(made).__name__}, not an nn.Module",
            fix="return the model from the factory",
        )
    raise UsageError(
        f"{target} is a {type(obj).__name__}, not an nn.Module, a class or a function",
        fix="point at a model instance, an nn.Module class, or a factory function",
    )


def _call(obj: Any, target: Target, doing: str) -> Any:
    try:
        return obj()
    except Exception as exc:  # noqa: BLE001
        fix = None
        if isinstance(exc, TypeError) and "argument" in str(exc):
            fix = ("MODULE:ATTR must take no arguments: give every constructor argument a default, or "
                   "point at a zero-argument factory function that builds the model")
        raise _raised_while(f"{doing} {target}()", exc, fix) from exc


def _required_parameters(fn: Any) -> list[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds and p.default is inspect.Parameter.empty]


def _raised_while(doing: str, exc: BaseException, fix: str | None = None) -> ModelError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return ModelError(
        f"{doing} raised {type(exc).__name__}: {first}".rstrip(": "),
        where=user_frame(exc.__traceback__),
        fix=fix or "fix the model's code; rerun with --traceback to see the whole traceback",
    )


def _candidates(namespace: Any) -> str:
    """What ATTR could have been: the models and functions `namespace` defines."""
    own = getattr(namespace, "__name__", None)

    def is_candidate(value: Any) -> bool:
        if isinstance(value, nn.Module):
            return True
        defined = (isinstance(value, type) and issubclass(value, nn.Module)) or isinstance(value, types.FunctionType)
        return defined and getattr(value, "__module__", None) == own

    names = [n for n, v in sorted(getattr(namespace, "__dict__", {}).items()) if not n.startswith("_") and is_candidate(v)]
    if not names:
        return "check the name; it defines no nn.Module classes, instances or functions"
    return "check the name; models and functions it defines: " + ", ".join(names)
