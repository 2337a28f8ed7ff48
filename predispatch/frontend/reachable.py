"""What an export reaches: the modules a plain function names, the objects beyond a module's tree.

This module only finds and names; putting back what forward changed on what it finds is
predispatch/_isolation.py's job (Note [What export puts back, and in what order] there).

Which modules does a plain function reach?  Those in its globals, closure, or arguments.

`export(fn, args)` lifts the parameters and buffers of every module `fn` can reach as graph
inputs (never baking them in as constants).  They are found without running `fn`, by looking
at the names its code uses: a global or closure variable bound to an `nn.Module`, the module
of a bound method, and modules passed as arguments.  Each is named by the path a reader knows:
the variable's name, or the argument's name.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def modules_reached(fn: Callable[..., Any]) -> dict[str, nn.Module]:
    """`{name: module}` for modules `fn` refers to by a global, closure or `self` name."""
    found: dict[str, nn.Module] = {}
    seen: set[int] = set()
    for name, value in _named_references(fn):
        if isinstance(value, nn.Module) and id(value) not in seen:
            seen.add(id(value))
            found[name] = value
    return found


def _named_references(fn: Callable[..., Any]) -> Iterator[tuple[str, Any]]:
    if inspect.ismethod(fn):
        yield "self", fn.__self__
        fn = fn.__func__
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    closure = getattr(fn, "__closure__", None) or ()
    for name, cell in zip(code.co_freevars, closure):
        if is_filled(cell):
            yield name, cell.cell_contents
    namespace = getattr(fn, "__globals__", {})
    for name in global_names(code):
        if name in namespace:
            yield name, namespace[name]


def is_filled(cell: types.CellType) -> bool:
    """Whether a closure cell holds a value (reading an empty one, a variable not bound yet, raises)."""
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def global_names(code: types.CodeType) -> Iterator[str]:
    """Names the code (and code nested in it: lambdas, inner functions) may load as globals
    (also read by `_isolation`'s walk of the user's code, which follows them to functions)."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from global_names(const)


# --- Beyond the registered tree ------------------------------------------------------------
#
# Note [Modules outside the registered tree]
# A module kept in a plain list, dict or tuple attribute (`self.helpers = [nn.Linear(3, 3)]`),
# or on a plain helper object (`self.ctx = Ctx(proj=nn.Linear(3, 3))`), is called by forward
# but is not a submodule: `named_parameters()` does not see it.  Its state is lifted like a
# submodule's, named by the path forward reaches it by (`helpers.0.weight`, `ctx.proj.weight`),
# and `ep.module()` holds its copies at that path, outside its own registered tree too (the
# signature's `outside_tree` records where the path left it), so `state_dict()` matches.  The same walk finds the plain containers
# and helper objects forward may fill (`self.attention_bias_cache[key] = bias`), which
# `_isolation` puts back as they were after export.

#: Attributes every module has (its registries and hook tables): not plain attributes.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
#: How deep the walk goes below a module's plain attribute, and how many objects it visits.
_MAX_DEPTH, _MAX_VISITS = 4, 10_000
_CONTAINERS = (list, tuple, dict, set)
_PATH_PART = re.compile(r"^[A-Za-z_0-9]+$")
#: Objects of these packages are not the user's helpers (a program, a config, a tokenizer);
#: nor is their code the user's (`_isolation`'s walk of the user's code).
LIBRARIES = ("torch", "builtins", "predispatch", "transformers", "numpy")
#: Library modules whose objects are walked all the same, each with why: they hold tensors that
#: forward writes and that are also the module's registered state, which the trace must bind
#: to the same traced value (an unwalked holder keeps the real tensor, and the first write
#: through it fails inside torch: "mutating a non-functional tensor with a functional tensor").
_WALKED_LIBRARY_MODULES = {
    "transformers.cache_utils": "a KV cache (StaticCache and its layers) whose key and value tensors "
    "transformers' ExecuTorch wrappers also register as buffers (TorchExportableModuleWithStaticCache)",
}


@dataclass(frozen=True)
class Beyond:
    """What forward can reach from a module tree through plain attributes.

    modules: modules outside the tree, by the path from the root (`helpers.0`), each with its
        own submodules (those are named by `named_modules()` under the path).
    tensors: tensors kept in plain containers or helper objects (`attention_bias_cache.cpu`),
        by path; forward reads them as constants.
    containers: lists, dicts and sets reachable through plain attributes (tuples are immutable).
    objects: plain helper objects (not modules) reachable through plain attributes.
    A module or tensor without a path (a set member, under a dict key with a dot) is in none of
    `modules`/`tensors`, but the containers and objects around it are still listed.
    """

    modules: dict[str, nn.Module]
    tensors: dict[str, torch.Tensor]
    containers: tuple[Any, ...]
    objects: tuple[Any, ...]


def beyond_tree(root: nn.Module) -> Beyond:
    """Walk every module's plain attributes (see Note [Modules outside the registered tree])."""
    memo = getattr(_SHARED, "memo", None)
    if memo is not None and id(root) in memo and memo[id(root)][0] is root:
        return memo[id(root)][1]
    walk = _Walk()
    walk.tree(root, "")
    beyond = Beyond(walk.modules, walk.tensors, tuple(walk.containers), tuple(walk.objects))
    if memo is not None:
        memo[id(root)] = (root, beyond)
    return beyond


_SHARED = threading.local()


@contextlib.contextmanager
def walks_shared() -> Iterator[dict[int, tuple[nn.Module, Beyond]]]:
    """While active (in this thread), `beyond_tree` walks each root once: an export asks twice
    before forward runs (isolation's snapshot, then lifting the state), when nothing between has
    changed the module.  Yields the memo: clear it before anything runs that may change it."""
    outer = getattr(_SHARED, "memo", None)
    _SHARED.memo = {}
    try:
        yield _SHARED.memo
    finally:
        _SHARED.memo = outer


class _Walk:
    """One walk: ids of everything seen, so shared objects and cycles are visited once."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.modules: dict[str, nn.Module] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.containers: list[Any] = []
        self.objects: list[Any] = []

    def tree(self, root: nn.Module, prefix: str | None) -> None:
        named = list(root.named_modules(prefix=prefix or "", remove_duplicate=False))
        self.seen.update(id(m) for _, m in named)
        for path, module in named:
            base = path if prefix is not None else None  # an unnamed module's attributes have no path
            for attr, value in vars(module).items():
                if attr not in _MODULE_INTERNALS:
                    self.value(value, attr if base == "" else _join(base, attr), 0)

    def value(self, value: Any, path: str | None, depth: int, tuples: int = 0) -> None:
        if depth > 0 and isinstance(value, torch.Tensor):  # depth 0: a plain tensor attribute, lifted already
            # `tuples`: how many tuples directly enclose it; the trace swaps a tensor in a tuple by
            # rebuilding the tuple on its (mutable) holder, so one level only
            if path is not None and tuples <= 1 and id(value) not in self.seen:
                self.seen.add(id(value))
                self.tensors[path] = value
            return
        if id(value) in self.seen or depth > _MAX_DEPTH or len(self.seen) > _MAX_VISITS or not _is_walked(value):
            return
        self.seen.add(id(value))
        if isinstance(value, nn.Module):
            if path is not None:
                self.modules[path] = value
            self.tree(value, path)
            return
        if isinstance(value, (list, dict, set)):
            self.containers.append(value)
        elif not isinstance(value, tuple):
            self.objects.append(value)
        for key, child in _children(value):
            self.value(child, _join(path, key), depth + 1, tuples + 1 if isinstance(value, tuple) else 0)


def _join(path: str | None, part: str | None) -> str | None:
    return None if path is None or part is None else f"{path}.{part}"


def _is_walked(value: Any) -> bool:
    """Modules, containers and plain helper objects of the user's own classes; not tensors,
    classes, functions, Python modules, or library objects (configs, tokenizers)."""
    if isinstance(value, (nn.Module, *_CONTAINERS)):
        return True
    if isinstance(value, (torch.Tensor, type, types.ModuleType, types.FunctionType, types.MethodType)):
        return False
    module_name = getattr(type(value), "__module__", "") or ""
    if module_name.split(".")[0] in sys.stdlib_module_names:  # loggers, locks, partials
        return False
    if module_name in _WALKED_LIBRARY_MODULES:
        return True
    return hasattr(value, "__dict__") and not module_name.startswith(LIBRARIES)


def _children(value: Any) -> Iterator[tuple[str | None, Any]]:
    """(path part, child): list/tuple indices, dict keys that can be path parts, attributes.
    A child without a usable name (a set member, a key with a dot) is walked unnamed (None):
    its containers are still put back; a module there is not lifted (it has no path)."""
    if isinstance(value, (list, tuple)):
        yield from ((str(i), v) for i, v in enumerate(value))
    elif isinstance(value, dict):
        for key, child in list(value.items()):
            part = str(key) if isinstance(key, (str, int)) and _PATH_PART.match(str(key)) else None
            yield part, child
    elif isinstance(value, set):
        yield from ((None, v) for v in list(value))
    else:
        yield from vars(value).items()


def resolve(root: Any, path: str) -> Any:
    """The object at `path` from `root`: submodules, then list/tuple indices, dict keys, attributes."""
    obj = root
    for part in path.split(".") if path else ():
        if isinstance(obj, nn.Module) and part in obj._modules:
            obj = obj._modules[part]
        elif isinstance(obj, (list, tuple)) and part.isdigit():
            obj = obj[int(part)]
        elif isinstance(obj, dict) and (part in obj or (part.isdigit() and int(part) in obj)):
            obj = obj[part] if part in obj else obj[int(part)]
        else:
            obj = getattr(obj, part)
    return obj


def in_tree(root: nn.Module, fqn: str) -> bool:
    """Whether `fqn` names state of `root`'s registered tree (its owner path runs through
    submodules only), as torch's own utilities (`reparametrize`, `state_dict`) need."""
    return tree_exit(root, fqn) is None


def tree_exit(root: nn.Module, fqn: str) -> str | None:
    """Where `fqn`'s owner path leaves `root`'s registered tree: the path of its first part that
    is not a submodule (`helpers` for `helpers.0.weight`), or None for state of the tree."""
    module = root
    parts = fqn.split(".")[:-1]
    for i, part in enumerate(parts):
        module = module._modules.get(part)
        if module is None:
            return ".".join(parts[: i + 1])
    return None
