"""Say how a call's structure differs from the exported call's, in the user's words.

A program takes the inputs it was exported with: the same positional arguments, the same
keyword arguments, each with the same nesting.  When a call differs, comparing the two pytree
specs tells where; this module turns that place into a sentence ("keyword argument 'mask'
was passed at export and is missing now") instead of showing both TreeSpecs.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

import torch.utils._pytree as pytree


def describe_mismatch(exported: pytree.TreeSpec, called: pytree.TreeSpec, arg_names: Sequence[str]) -> str:
    """What differs between the exported `(args, kwargs)` spec and the called one, first difference first."""
    (exported_args, exported_kwargs), (called_args, called_kwargs) = exported.children(), called.children()
    keywords = _keyword_difference(list(exported_kwargs.context or ()), list(called_kwargs.context or ()))
    if keywords:
        return keywords
    if exported_args.num_children != called_args.num_children:
        names = ", ".join(arg_names[: exported_args.num_children])
        return (
            f"the program takes {exported_args.num_children} positional argument(s)"
            f"{f' ({names})' if names else ''}, as at export; this call passes {called_args.num_children}."
        )
    for i, (want, got) in enumerate(zip(exported_args.children(), called_args.children())):
        label = arg_names[i] if i < len(arg_names) else f"args[{i}]"
        found = _first_difference(want, got, label)
        if found:
            return found
    for name, want, got in zip(exported_kwargs.context, exported_kwargs.children(), called_kwargs.children()):
        found = _first_difference(want, got, name)
        if found:
            return found
    return f"the call's structure differs from the exported one ({called} against {exported})."


def _keyword_difference(exported: list[str], called: list[str]) -> str:
    """A sentence naming the keyword arguments missing from, or added to, the exported ones."""
    missing = [name for name in exported if name not in called]
    extra = [name for name in called if name not in exported]
    parts = []
    for name in missing:
        parts.append(f"keyword argument {name!r} was passed at export and is missing now")
    for name in extra:
        close = difflib.get_close_matches(name, missing, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        parts.append(f"keyword argument {name!r} was not passed at export, so the program has no input for it{hint}")
    if not parts:
        return ""
    taken = ", ".join(exported) if exported else "none"
    return "; ".join(parts) + f". The program takes the keyword arguments it was exported with: {taken}."


def _first_difference(want: pytree.TreeSpec, got: pytree.TreeSpec, path: str) -> str:
    """The first place, in pytree order, where `got` is shaped unlike `want`; "" when alike."""
    if want == got:
        return ""
    if want.type is not got.type or want.num_children != got.num_children or want.context != got.context:
        return f"input {path!r} was {_describe(want)} at export and is {_describe(got)} now."
    for key, w, g in zip(_keys(want), want.children(), got.children()):
        found = _first_difference(w, g, f"{path}[{key!r}]")
        if found:
            return found
    return ""


def _keys(spec: pytree.TreeSpec) -> list:
    """The child keys of a node: dict keys, otherwise positions."""
    return list(spec.context) if spec.type is dict else list(range(spec.num_children))


def _describe(spec: pytree.TreeSpec) -> str:
    """A short phrase for one level of a spec: "a leaf (a tensor or constant)", "a tuple of 2"."""
    if spec.is_leaf():
        return "a single value (a tensor or constant)"
    if spec.type is dict:
        return f"a dict with keys {list(spec.context)}"
    return f"a {spec.type.__name__} of {spec.num_children}"
