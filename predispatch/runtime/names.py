"""The names a program gives Python: which ones FX may compile and modules may hold.

Note [Names that reach code]
----------------------------
`ep.module()` is Python that FX generates from the program, and a file supplies many of the
names in it: keyword-argument names (the in_spec's dict keys) become parameters of the
generated `forward` and keys of a dict literal in its first line (`{'mask':mask}`); state
names become attribute reads (`self.lin.weight`, or `getattr(self, "<part>")` for a part that
is not an identifier); node names become variables; subgraph and tensor names become
attributes.  FX pastes these in unquoted and unescaped, so a name is a piece of source: two
keyword names can close the string literal and run code when `module()` is built.  A name
therefore reaches code only when it is an identifier and not a keyword.

Attributes are the other sink: `module()` installs state by `setattr` and `add_module` along
its path, so a state named `forward`, `training` or `_compiled_call_impl` would replace the
module's own method or flag.  A name a program installs on a module is never an attribute
that module already has (`module_attributes()` for the containers, `program_attributes()` for
the root, which is a GraphModule).  Eager torch refuses `nn.Module`'s names too
(`register_buffer`, `add_module`), so no module export traces carries one.  A state's first
name may be one of the GraphModule's own that `nn.Module` lacks (`code`, `graph`, `meta`, a
model's submodule named `code`): that state goes into the module's dicts, never onto the
attribute, and is read through `RootState` (Note [State named like a GraphModule attribute]
in unlift.py).

`argument_names` is the one place that turns a signature into the generated parameters;
`unlift.py` builds from it and `verify.py` checks it, so the two cannot drift.
"""

from __future__ import annotations

import functools
import keyword
import re
from collections.abc import Iterator
from typing import Any

from torch import fx, nn

from predispatch.runtime.runner import ProgramModule

__all__ = [
    "RESERVED", "argument_names", "attribute_problem", "call_spec_problems", "identifier_problem", "module_attributes",
    "program_attributes", "state_name_problems",
]

#: Names the generated code uses as globals; a parameter must not shadow them.
RESERVED = frozenset({"self", "torch", "fx_pytree", "pytree", "inf", "nan", "NoneType", "device", "math"})


def identifier_problem(name: Any) -> str | None:
    """Why `name` cannot be pasted into Python source as a name, or None."""
    if not isinstance(name, str) or not name.isidentifier():
        return f"{_shown(name)} is not a Python identifier"
    if keyword.iskeyword(name):
        return f"{name!r} is a Python keyword"
    return None


@functools.cache
def module_attributes() -> frozenset[str]:
    """Every attribute an `nn.Module` has before anything is registered on it."""
    return frozenset(dir(nn.Module)) | frozenset(vars(nn.Module()))


@functools.cache
def program_attributes() -> frozenset[str]:
    """Every attribute `ep.module()` has of its own (a GraphModule's and our ProgramModule's)."""
    module = ProgramModule(nn.Module(), fx.Graph())
    return frozenset(dir(ProgramModule)) | frozenset(vars(module)) | module_attributes()


#: A part of a state's path that is not an identifier (a `Sequential`'s `0`, a `ModuleDict`'s
#: `block-1`): FX reads it as `getattr(self, "<part>")`, pasted in quotes, so no quote,
#: backslash or space may be in it.
_PATH_PART = re.compile(r"[A-Za-z0-9_-]+\Z")


def attribute_problem(name: Any, *, root: bool, state: bool = False) -> str | None:
    """Why `name` cannot be installed as an attribute (of `ep.module()` itself if `root`).

    `state`: the first name of a state's path, which may be one of `ep.module()`'s own
    attributes that `nn.Module` lacks (`code`, `graph`, `meta`): it is kept in the module's
    dicts and read through `RootState` (Note [State named like a GraphModule attribute] in
    unlift.py), replacing nothing; a name `nn.Module` has is refused still, as eager refuses it."""
    why = identifier_problem(name)
    if why is not None and isinstance(name, str) and _PATH_PART.match(name):
        why = None  # read as getattr(self, "0"): see _PATH_PART
    if why is None and name.startswith("__"):
        why = f"{name!r} starts with '__' (Python's own attributes)"
    if why is None and name in (program_attributes() if root and not state else module_attributes()):
        owner = "ep.module()" if root else "a module"
        why = f"{name!r} is an attribute {owner} has of its own (installing it would replace it)"
    return why


def state_name_problems(fqn: Any) -> Iterator[str]:
    """Why a state's fully qualified name (`lin.weight`) cannot be installed on `ep.module()`."""
    if not isinstance(fqn, str) or not fqn:
        yield f"{_shown(fqn)} is not a dotted name"
        return
    for depth, part in enumerate(fqn.split(".")):
        why = attribute_problem(part, root=depth == 0, state=True)
        if why:
            yield f"state {fqn!r}: {why}"
            return


def argument_names(in_spec: Any, arg_names: tuple[str, ...]) -> list[str]:
    """The parameters of the generated `forward`: positional names, then keyword names.

    Keyword names are the call's keys, used as they are (they are checked at load: see
    `call_spec_problems`); a positional name that is not usable (or would shadow a global of the
    generated code, or a keyword name) becomes `arg_<i>`.
    """
    names = list(arg_names)
    count = in_spec.child(0).num_children
    if len(names) != count:
        names = [f"arg_{i}" for i in range(count)]
    keywords = list(in_spec.child(1).context)
    usable = [n if _usable(n) and n not in keywords else f"arg_{i}" for i, n in enumerate(names)]
    return usable + keywords


def call_spec_problems(in_spec: Any, arg_names: tuple[str, ...]) -> Iterator[str]:
    """Why the generated `forward` cannot take this call: the in_spec is `(args, kwargs)`, a
    tuple and a dict whose keys are usable parameter names (see the Note)."""
    import torch.utils._pytree as pytree

    if not (isinstance(in_spec, pytree.TreeSpec) and in_spec.type is tuple and in_spec.num_children == 2
            and in_spec.child(0).type is tuple and in_spec.child(1).type is dict):
        yield "the input spec is not (positional arguments, keyword arguments), a tuple and a dict"
        return
    for name in in_spec.child(1).context:
        why = identifier_problem(name)
        if why is None and name in RESERVED:
            why = f"{name!r} is a name the generated code uses itself"
        if why:
            yield f"keyword argument: {why}"
    parameters = argument_names(in_spec, arg_names)
    if len(set(parameters)) != len(parameters):
        yield f"the generated forward would take a parameter twice: {parameters}"


def _usable(name: str) -> bool:
    return isinstance(name, str) and identifier_problem(name) is None and name not in RESERVED


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
