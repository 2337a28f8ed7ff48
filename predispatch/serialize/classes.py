"""Which classes a file's pytree specs may make, and how a name in the file becomes one.

Note [Classes a file may name]
------------------------------
A pytree spec names classes by `module:qualname`: the type of each container of the call and
the result (a dataclass, a `ModelOutput`), and in a namedtuple's context its class.  Running
the program builds them: `tree_unflatten` calls a dataclass's `__init__` and `__post_init__`,
a namedtuple's `__new__`, a registered type's unflatten function, with values the file holds.
So a class is code, and a file must not choose it: torch's own
`torch.distributed.elastic.multiprocessing.errors.ProcessFailure` is a dataclass whose
`__post_init__` reads the JSON file at the path it is given, so a file naming it (once the
module is imported) would make `ep.module()` return the contents of a file of its choosing.

`load` builds only classes the user chose, each looked up without importing anything (the
module must be imported, and names are walked through `__dict__`s: no `__getattr__` runs):

1. pytree's own containers: tuple, list, dict, OrderedDict, deque, namedtuple, and defaultdict
   with a builtin factory (list, dict, set, tuple, int, float, str); they build plain data;
2. the classes the caller passes, `load(path, types=[Out])`: dataclasses (registered, as
   `export` registers them, once the whole file is verified), namedtuple classes, transformers'
   `DynamicCache` (registered with transformers' own flattening, as `export` does), and
   classes already registered as pytree nodes;
3. pytree node types already registered in the process, by the user's code or a library the
   user imported (transformers registers every `ModelOutput`), with their own (un)flatten;
4. namedtuple classes whose constructor is the one `collections.namedtuple` (and so
   `typing.NamedTuple`) generates: a class made by it, no subclass, no metaclass, no `__init__`,
   its `__new__` the generated `_tuple_new(_cls, (fields...))`, which builds the tuple and
   runs nothing else.

Anything else is refused with `SerializationError` naming the class, where the file names it,
and the `types=` that allows it.  A program read for display only (`predispatch show`,
`draw`: `load_for_display`) looks nothing up: every class beyond pytree's containers is a
`DisplayedClass` carrying the file's name, which cannot be built, and the program it is in
has no `module()`.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections import OrderedDict, defaultdict, deque, namedtuple
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch.utils._pytree as pytree

from predispatch.errors import SerializationError
from predispatch.serialize.values import class_name, short

#: pytree's own containers, which every file may name: they build plain data.
STANDARD_NODES: dict[str, Any] = {class_name(t, ""): t for t in (tuple, list, dict, namedtuple, OrderedDict, defaultdict, deque)}
#: The factories a defaultdict's context may name: builtins whose call makes an empty value.
BUILTIN_FACTORIES: dict[str, type] = {class_name(t, ""): t for t in (list, dict, set, tuple, int, float, str)}

_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", re.ASCII)
#: What building a class may run, for the refusal.
_RUNS = "its __new__, __init__ and __post_init__, or its pytree unflatten function"


class DisplayedClass:
    """A class a file names, in a program read for display only: the file's name for it, never
    looked up, built or registered (pytree refuses to unflatten a spec holding one, and a
    call raises), so a displayed program cannot be run by accident."""

    file_name: ClassVar[str] = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> DisplayedClass:
        raise SerializationError(
            f"{short(cls.file_name)} was read for display only (predispatch show/draw): it is the file's name "
            "for a class, not the class, and cannot be built.",
            fix="load the program with predispatch.load(path, types=[...]) to run it.",
        )


class FileClasses:
    """How the class names in one file's pytree specs become classes (Note [Classes a file may name]).

    types: the classes the caller allows (`load(path, types=[...])`).
    display: read for display only: names become `DisplayedClass`es; nothing is looked up.
    """

    def __init__(self, types: Iterable[type] = (), *, display: bool = False) -> None:
        self.allowed = {_allowable(cls): cls for cls in types}
        self.display = display
        self.to_register: set[type] = set()  # allowed classes to register once the file is verified
        self._displayed: dict[str, type] = {}

    def node_type(self, name: str, where: str) -> Any:
        """The pytree node type `name` names in a spec."""
        if name in STANDARD_NODES:
            return STANDARD_NODES[name]
        if self.display:
            return self._placeholder(name)
        cls = self.allowed.get(name)
        if cls is not None and (cls in pytree.SUPPORTED_NODES or _registration(cls) is not None):
            if cls not in pytree.SUPPORTED_NODES:
                self.to_register.add(cls)
            return cls
        found = _imported(name, where)
        if found is not None and found in pytree.SUPPORTED_NODES:
            return found
        raise _refusal(name, where, "those your code or a library you imported registered as pytree nodes")

    def context_classes(self, node_type: Any) -> Callable[[str, str], type] | None:
        """How a `{"class": name}` in the context of a `node_type` node becomes a class; None:
        that context holds no classes."""
        if node_type is namedtuple:
            return self._namedtuple_class
        if node_type is defaultdict:
            return self._factory
        return None

    def register(self) -> None:
        """Register the allowed classes the verified file uses, as `export` registers them."""
        for cls in sorted(self.to_register, key=lambda c: class_name(c, "")):
            register = _registration(cls)
            if cls not in pytree.SUPPORTED_NODES and register is not None:
                register()

    def _namedtuple_class(self, name: str, where: str) -> type:
        if self.display:
            return self._placeholder(name)
        cls = self.allowed.get(name)
        if cls is not None and pytree.is_namedtuple_class(cls):
            return cls
        found = _imported(name, where)
        if found is not None and is_plain_namedtuple(found):
            return found
        why = "namedtuple classes whose constructor is the one collections.namedtuple generates"
        if found is not None and pytree.is_namedtuple_class(found):
            why += " (this one's is not: a subclass, a metaclass, or its own __new__ or __init__)"
        raise _refusal(name, where, why)

    def _factory(self, name: str, where: str) -> type:
        if name not in BUILTIN_FACTORIES:
            raise SerializationError(f"{where}: {short(name)} is not a defaultdict factory a file may name "
                                     f"(one of {', '.join(BUILTIN_FACTORIES)}).")
        return BUILTIN_FACTORIES[name]

    def _placeholder(self, name: str) -> type:
        """One `DisplayedClass` per name (a spec compares its types by identity)."""
        if name not in self._displayed:
            self._displayed[name] = type("DisplayedClass", (DisplayedClass,), {"file_name": name, "__module__": __name__})
        return self._displayed[name]


def displayed_name(cls: Any) -> str | None:
    """The file's name for a class of a program read for display only; None for a real class."""
    return cls.file_name if isinstance(cls, type) and issubclass(cls, DisplayedClass) else None


def is_plain_namedtuple(cls: Any) -> bool:
    """Whether building `cls` runs only the constructor `collections.namedtuple` generates:
    made by it (`typing.NamedTuple` calls it and refuses a `__new__` or `__init__` in the class
    body), not a subclass, no metaclass, and its `__new__` the generated one, compiled from
    `lambda _cls, a, b: _tuple_new(_cls, (a, b))` in a namespace holding `_tuple_new` only."""
    if type(cls) is not type or cls.__bases__ != (tuple,) or not pytree.is_namedtuple_class(cls) or "__init__" in vars(cls):
        return False
    new = getattr(vars(cls).get("__new__"), "__func__", None)  # the class dict holds a staticmethod
    code, scope = getattr(new, "__code__", None), getattr(new, "__globals__", {})
    return (
        code is not None and code.co_filename == "<string>" and code.co_names == ("_tuple_new",)
        and set(scope) == {"_tuple_new", "__builtins__", "__name__"} and scope["_tuple_new"] is tuple.__new__
    )


def _allowable(cls: Any) -> str:
    """`cls`'s `module:qualname`, if `load` can build it; else a SerializationError on `types=`."""
    if not isinstance(cls, type):
        raise SerializationError(f"types=: {short(cls)} is not a class.", fix="pass the classes themselves: types=[mymodule.Output].")
    name = class_name(cls, "types=")
    if cls not in pytree.SUPPORTED_NODES and _registration(cls) is None and not pytree.is_namedtuple_class(cls):
        raise SerializationError(
            f"types=: {name} is neither a dataclass, a namedtuple class nor a registered pytree node type, so "
            "load cannot build it from a file.",
            fix="register it first (torch.utils._pytree.register_pytree_node), as export needed it to be.",
        )
    return name


def _registration(cls: type) -> Callable[[], None] | None:
    """How load registers an allowed class as `export` registered it; None: it cannot."""
    if cls.__module__ == "transformers.cache_utils" and cls.__name__ == "DynamicCache":
        from predispatch.frontend.inputs import register_hf_caches

        return register_hf_caches  # transformers' own flattening
    if dataclasses.is_dataclass(cls):
        return lambda: pytree.register_dataclass(cls)
    return None


def _imported(name: str, where: str) -> Any:
    """The object `module:qualname` names in an already imported module, or None; never imports.

    Walks `__dict__`s only, so no module or class `__getattr__` hook runs.
    """
    if not _NAME.fullmatch(name):
        raise SerializationError(f"{where}: {short(name)} is not a class name (module:qualname).")
    module_name, _, qualname = name.partition(":")
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        if obj is None:
            return None
        obj = getattr(obj, "__dict__", {}).get(part)
    return obj


def _refusal(name: str, where: str, otherwise: str) -> SerializationError:
    """The class is not one load may build: say which, where, why, and how the user allows it;
    `otherwise`: the classes load builds without being told."""
    module, _, qualname = name.partition(":")
    dotted = f"{module}.{qualname}"
    imported = "" if module in sys.modules else (
        f" after `import {module}` (load never imports a module a file names; importing it runs its code)")
    return SerializationError(
        f"{where}: the file names the class {name}; load builds a class only when you allow it, since building it "
        f"runs the class's code ({_RUNS}) on values from the file. It allows the classes you pass in types= and "
        f"{otherwise}.",
        fix=f"if you trust {dotted}, allow it: predispatch.load(path, types=[{dotted}]){imported}.",
    )
