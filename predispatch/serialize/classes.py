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

A program with tensor subclass state, inputs or outputs (format version 2: Note [Tensor
subclasses in files] in subclasses.py) names more classes: each subclass, whose
`__tensor_unflatten__` load calls to build the state and `ep.module()` to build an output, and
whose `__torch_dispatch__` runs on every op applied to it; and the classes of the objects its
flatten context holds (torchao's `QuantizeTensorToInt8Kwargs`, `PerRow`), built by calling them.
Those are allowed like the classes of a pytree spec: a tensor subclass only when passed in
`types=`; a context's dataclass or namedtuple when passed, registered as a pytree node, or (a
namedtuple) plain as in 4.; an enum member when its class is passed, registered, or a plain
enum (`is_plain_enum`): looking a member up by name (`_member_map_`, a dict) runs nothing, and
a plain enum brings no Python code of its own that using the member could run.  Building any of
them waits until the whole file is verified (`Unbuilt`).

Anything else is refused with `SerializationError` naming the class, where the file names it,
and the `types=` that allows it: every class of the file not allowed, in one message.  A
program read for display only (`predispatch show`, `draw`: `load_for_display`) looks nothing
up: every class beyond pytree's containers is a `DisplayedClass` carrying the file's name,
which cannot be built, and the program it is in has no `module()`.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import sys
import types as pytypes
from collections import OrderedDict, defaultdict, deque, namedtuple
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
import torch.utils._pytree as pytree

from predispatch.errors import SerializationError
from predispatch.serialize.values import Refs, class_name, decode, expect, short

#: pytree's own containers, which every file may name: they build plain data.
STANDARD_NODES: dict[str, Any] = {class_name(t, ""): t for t in (tuple, list, dict, namedtuple, OrderedDict, defaultdict, deque)}
#: The factories a defaultdict's context may name: builtins whose call makes an empty value.
BUILTIN_FACTORIES: dict[str, type] = {class_name(t, ""): t for t in (list, dict, set, tuple, int, float, str)}

_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", re.ASCII)
#: What building a class may run, for the refusal, by what the file uses it for.
_RUNS = "its __new__, __init__ and __post_init__, or its pytree unflatten function"
_RUNS_SUBCLASS = "its __tensor_unflatten__, and its __torch_dispatch__ on every op applied to it"
_RUNS_ENUM = "its methods, which using a member calls: __eq__, __hash__, __repr__, ..."
#: The classes load allows unasked, for the refusal, by what the file uses the class for.
_REGISTERED = "those your code or a library you imported registered as pytree nodes"
_WITHOUT_TYPES = {
    "subclass": "no other tensor subclass",
    "enum": f"{_REGISTERED}, and plain enums (no metaclass or methods of their own)",
    "dataclass": _REGISTERED,
    "namedtuple": f"{_REGISTERED}, and namedtuple classes whose constructor is the one collections.namedtuple generates",
}


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
        self._refused: dict[str, _Refused] = {}  # by name, in the order the file names them

    def check(self) -> None:
        """Raise one `SerializationError` naming every class of the file that is not allowed
        (each was stood in for by a `DisplayedClass` while the rest of the file was read)."""
        if len(self._refused) == 1:
            (refused,) = self._refused.values()
            raise _refusal(refused.name, refused.where, refused.otherwise, refused.runs)
        if self._refused:
            raise _refusals(list(self._refused.values()))

    def _refuse(self, name: str, where: str, otherwise: str, runs: str = _RUNS) -> type:
        """Record that `name` may not be built (`check` raises for all of them); its stand-in."""
        self._refused.setdefault(name, _Refused(name, where, otherwise, runs))
        return self._placeholder(name)

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
        return self._refuse(name, where, _REGISTERED)

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
        return self._refuse(name, where, why)

    def tensor_subclass(self, name: str, where: str) -> type:
        """The class a tensor subclass layout names: only one passed in `types=` (whether it is
        a tensor subclass load can build is the verifier's: `subclass_problems` in verify.py)."""
        if not _NAME.fullmatch(name):
            raise SerializationError(f"{where}: {short(name)} is not a class name (module:qualname).")
        if self.display:
            return self._placeholder(name)
        cls = self.allowed.get(name)
        return cls if cls is not None else self._refuse(name, where, _WITHOUT_TYPES["subclass"], _RUNS_SUBCLASS)

    def context_value(self, tag: str, payload: Any, where: str, decode: Callable[[Any, str], Any]) -> Unbuilt:
        """An enum member, dataclass or namedtuple instance of a flatten context (values.py's
        `Refs.objects`), as an `Unbuilt`: its class allowed, its member or fields checked."""
        payload = _payload(tag, payload, where)
        cls = self._context_class(tag, payload["class"], where)
        if tag == "enum":
            args: Any = payload["name"]
            if displayed_name(cls) is None:
                _check_member(cls, args, where)
        elif tag == "dataclass":
            args = {name: decode(value, f"{where}.{name}") for name, value in payload["fields"]}
            if displayed_name(cls) is None:
                _check_fields(cls, list(args), where)
        else:
            args = tuple(decode(value, f"{where}[{i}]") for i, value in enumerate(payload["values"]))
            fields = None if displayed_name(cls) is not None else getattr(cls, "_fields")
            if fields is not None and len(args) != len(fields):
                raise SerializationError(f"{where}: {len(args)} values for the namedtuple {payload['class']}, which has {len(fields)} fields.")
        return Unbuilt(tag, cls, args)

    def _context_class(self, tag: str, name: str, where: str) -> type:
        """The class of a context object: passed, registered, or plain (`_WITHOUT_TYPES`)."""
        if self.display:
            return self._placeholder(name)
        kind = {"enum": _is_enum_class, "dataclass": _is_dataclass_class, "namedtuple": pytree.is_namedtuple_class}[tag]
        cls = self.allowed.get(name)
        if cls is None:
            found = _imported(name, where)
            plain = {"enum": is_plain_enum, "namedtuple": is_plain_namedtuple}.get(tag, lambda c: False)
            if found is not None and (found in pytree.SUPPORTED_NODES or plain(found)):
                cls = found
        if cls is None:
            return self._refuse(name, where, _WITHOUT_TYPES[tag], _RUNS_ENUM if tag == "enum" else _RUNS)
        if not kind(cls):
            raise SerializationError(f"{where}: the file names {name} as the class of {'an' if tag == 'enum' else 'a'} {tag}, which it is not.")
        return cls

    def _factory(self, name: str, where: str) -> type:
        if name not in BUILTIN_FACTORIES:
            raise SerializationError(f"{where}: {short(name)} is not a defaultdict factory a file may name "
                                     f"(one of {', '.join(BUILTIN_FACTORIES)}).")
        return BUILTIN_FACTORIES[name]

    def _placeholder(self, name: str) -> type:
        """One `DisplayedClass` per name (a spec compares its types by identity), printed under
        the file's name for it (a subclass layout prints its class)."""
        if name not in self._displayed:
            module, _, qualname = name.partition(":")
            self._displayed[name] = type(
                "DisplayedClass", (DisplayedClass,), {"file_name": name, "__module__": module, "__qualname__": qualname})
        return self._displayed[name]


@dataclasses.dataclass(frozen=True)
class _Refused:
    """A class the file names that load may not build: where, what load allows unasked, and
    what building it runs."""

    name: str
    where: str
    otherwise: str
    runs: str


@dataclasses.dataclass(frozen=True, eq=False)
class Unbuilt:
    """An object of a tensor subclass's flatten context as the file gives it, built only once
    the whole file is verified (Note [Tensor subclasses in files] in subclasses.py).

    kind: "enum", "dataclass" or "namedtuple".
    cls: its class, allowed (a `DisplayedClass` in a program read for display only).
    args: the enum member's name; the dataclass's fields by name; the namedtuple's values
        (values themselves, `Unbuilt` ones among them).
    """

    kind: str
    cls: type
    args: Any

    def build(self) -> Any:
        """The object: the member looked up by name, or the class called with the built args."""
        if self.kind == "enum":
            return vars(self.cls)["_member_map_"][self.args]
        if self.kind == "dataclass":
            return self.cls(**{name: built(value) for name, value in self.args.items()})
        return self.cls(*map(built, self.args))

    def __repr__(self) -> str:
        name = displayed_name(self.cls) or class_name(self.cls, "")
        if self.kind == "enum":
            return f"{name}.{self.args}"
        items = self.args.items() if self.kind == "dataclass" else enumerate(self.args)
        return f"{name}({', '.join(f'{k}={v!r}' for k, v in items)})"


def built(value: Any) -> Any:
    """`value` with every `Unbuilt` in it (in plain dicts, lists and tuples) built."""
    if isinstance(value, Unbuilt):
        return value.build()
    if isinstance(value, dict):
        return {k: built(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map(built, value))
    return value


def _payload(tag: str, payload: Any, where: str) -> dict:
    """The payload of a context object, its fields of the right types."""
    items = {"enum": "name", "dataclass": "fields", "namedtuple": "values"}[tag]
    if not isinstance(payload, dict) or set(payload) != {"class", items} or not isinstance(payload["class"], str):
        raise SerializationError(f"{where}: a {tag} is {{'class': name, {items!r}: ...}}, not {short(payload)}.")
    if tag == "enum" and not isinstance(payload["name"], str):
        raise SerializationError(f"{where}: an enum member's name is a string, not {short(payload['name'])}.")
    if tag == "dataclass" and not (isinstance(payload["fields"], list) and all(
            isinstance(f, list) and len(f) == 2 and isinstance(f[0], str) for f in payload["fields"])
            and len({f[0] for f in payload["fields"]}) == len(payload["fields"])):
        raise SerializationError(f"{where}: a dataclass's fields are [[name, value], ...], each name once, not {short(payload['fields'])}.")
    if tag == "namedtuple" and not isinstance(payload["values"], list):
        raise SerializationError(f"{where}: a namedtuple's values are a list, not {short(payload['values'])}.")
    return payload


def _check_member(cls: type, name: str, where: str) -> None:
    """`name` is a member of the enum `cls` whose value is plain data."""
    member = vars(cls).get("_member_map_", {}).get(name)
    if member is None:
        raise SerializationError(f"{where}: {class_name(cls, where)} has no member {short(name)}.")
    if type(member._value_) not in (int, str, float, bool, type(None)):
        raise SerializationError(f"{where}: {class_name(cls, where)}.{name}'s value is a {type(member._value_).__name__}; "
                                 "a file may name enum members whose values are plain data.")


def _check_fields(cls: type, names: list[str], where: str) -> None:
    """`names` are the fields `cls.__init__` takes, in order (what `save` writes)."""
    expected = [f.name for f in dataclasses.fields(cls) if f.init]
    if names != expected:
        raise SerializationError(f"{where}: the fields {names} are not those {class_name(cls, where)} takes ({expected}).")


def _is_enum_class(cls: Any) -> bool:
    return isinstance(cls, type) and issubclass(cls, enum.Enum)


def _is_dataclass_class(cls: Any) -> bool:
    return isinstance(cls, type) and dataclasses.is_dataclass(cls)


def is_tensor_subclass(cls: Any) -> bool:
    """Whether `cls` is a traceable wrapper tensor subclass load can take apart and build
    (`__tensor_flatten__` and `__tensor_unflatten__`, looked up without running any hook)."""
    return (
        isinstance(cls, type) and issubclass(cls, torch.Tensor) and cls not in (torch.Tensor, torch.nn.Parameter)
        and all(any(name in vars(c) for c in cls.__mro__) for name in ("__tensor_flatten__", "__tensor_unflatten__"))
    )


#: What a plain enum's own class dictionary may hold besides its members: what `enum.EnumType`
#: puts there, C-level descriptors and plain data, and functions of the `enum` module.
_C_LEVEL = (pytypes.BuiltinFunctionType, pytypes.WrapperDescriptorType, pytypes.MethodDescriptorType,
            pytypes.GetSetDescriptorType, pytypes.MemberDescriptorType, pytypes.MethodWrapperType)
_PLAIN_DATA = (str, int, float, bool, type(None), list, dict, type, tuple)


def is_plain_enum(cls: Any) -> bool:
    """Whether naming a member of `cls` can run none of its code: made by `enum.EnumType`
    itself (no metaclass of its own, whose `__getitem__` or `__call__` could run), and no
    Python function in its class dictionaries but the `enum` module's (no `__eq__`, `__hash__`,
    `_missing_`, property or method of its own that using a member would call).  Mixins of the
    builtins (`str`, `int`) are C code.  Load looks a member up in `_member_map_`, a dict."""
    if not isinstance(cls, type) or type(cls) is not enum.EnumType or not issubclass(cls, enum.Enum):
        return False
    for c in cls.__mro__:
        if c.__module__ in ("enum", "builtins"):
            continue
        for value in vars(c).values():
            if isinstance(value, cls) or isinstance(value, (_C_LEVEL, _PLAIN_DATA)):
                continue
            function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if isinstance(function, pytypes.FunctionType) and function.__module__ == "enum":
                continue
            return False
    return True


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
    if issubclass(cls, torch.Tensor) and not is_tensor_subclass(cls):
        raise SerializationError(
            f"types=: {name} is a tensor subclass without __tensor_flatten__ and __tensor_unflatten__, so load "
            "cannot build it from its parts (and export could not take it apart).",
            fix="make it a traceable wrapper subclass, as torch.testing._internal.two_tensor.TwoTensor is.",
        )
    buildable = (cls in pytree.SUPPORTED_NODES or _registration(cls) is not None or pytree.is_namedtuple_class(cls)
                 or is_tensor_subclass(cls) or _is_enum_class(cls))
    if not buildable:
        raise SerializationError(
            f"types=: {name} is neither a dataclass, a namedtuple class, an enum, a tensor subclass nor a registered "
            "pytree node type, so load cannot build it from a file.",
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


def _refusal(name: str, where: str, otherwise: str, runs: str = _RUNS) -> SerializationError:
    """The class is not one load may build: say which, where, why, and how the user allows it;
    `otherwise`: the classes load builds without being told."""
    module, _, qualname = name.partition(":")
    dotted = f"{module}.{qualname}"
    imported = "" if module in sys.modules else (
        f" after `import {module}` (load never imports a module a file names; importing it runs its code)")
    return SerializationError(
        f"{where}: the file names the class {name}; load builds a class only when you allow it, since building it "
        f"runs the class's code ({runs}) on values from the file. It allows the classes you pass in types= and "
        f"{otherwise}.",
        fix=f"if you trust {dotted}, allow it: predispatch.load(path, types=[{dotted}]){imported}.",
    )


def _refusals(refused: list[_Refused]) -> SerializationError:
    """Several classes load may not build, in one message: each with where the file names it,
    and the one `types=` that allows them all."""
    listed = "; ".join(f"{r.name} ({r.where})" for r in refused)
    dotted = [r.name.replace(":", ".") for r in refused]
    missing = sorted({r.name.partition(":")[0] for r in refused} - set(sys.modules))
    imported = f" after `import {', '.join(missing)}` (load never imports a module a file names)" if missing else ""
    return SerializationError(
        f"the file names {len(refused)} classes load builds only when you allow them: {listed}. Building one runs "
        f"its code ({_RUNS}; for a tensor subclass {_RUNS_SUBCLASS}) on values from the file.",
        fix=f"if you trust them, allow them: predispatch.load(path, types=[{', '.join(dotted)}]){imported}.",
    )


def decode_spec(data: Any, where: str, classes: FileClasses) -> pytree.TreeSpec:
    """A pytree spec, its classes made by `classes` (Note [Classes a file may name] in classes.py):
    allowed ones to register wait in `classes.to_register` until the whole file is verified."""
    if data is None:
        return pytree.treespec_leaf()
    data = expect(data, dict, where)
    node_type = classes.node_type(expect(data.get("type"), str, where), where)
    context = decode(data.get("context"), f"{where} context", Refs(classes=classes.context_classes(node_type)))
    children = [decode_spec(c, f"{where}[{i}]", classes) for i, c in enumerate(expect(data.get("children"), list, where))]
    return pytree.TreeSpec(node_type, context, children)
