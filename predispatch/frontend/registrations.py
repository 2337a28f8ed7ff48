"""The pytree registrations an export makes, undone when the export fails.

`export` registers the dataclasses of the call and the result as pytree nodes (as torch.export
asks users to), and transformers' `DynamicCache`: global, permanent changes that let
`ep.module()` take and return those types.  A failed export gives no `ep.module()`, so it has
no reason to leave them: every later pytree user in the process would flatten those classes
(an `_IntWrapper` left registered makes every later `torch.export.export` of a plain `int`
fail).  `journal()` records each registration this module's `note` is told of while an export
runs, and deregisters them, newest first, if the export raises; a registration made by
importing a module (torch's own, a library's) is not one of them and stays.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from predispatch import _torch_internals as ti

__all__ = ["journal", "note"]

_OPEN = threading.local()


def note(cls: type) -> None:
    """Record that the running export registered `cls` as a pytree node."""
    journals = getattr(_OPEN, "journals", None)
    if journals:
        journals[-1].append(cls)


@contextlib.contextmanager
def journal() -> Iterator[list[type]]:
    """Record the registrations made inside; undo them if the block raises (any exception,
    a KeyboardInterrupt too).  Nested journals (an export inside an export) hand theirs to the
    outer one on success, so the outermost export decides."""
    journals = _OPEN.__dict__.setdefault("journals", [])
    made: list[type] = []
    journals.append(made)
    try:
        yield made
    except BaseException:
        for cls in reversed(made):
            ti.deregister_pytree_node(cls)
        raise
    finally:
        journals.pop()
    if journals:
        journals[-1].extend(made)
