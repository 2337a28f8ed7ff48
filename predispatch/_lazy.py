"""Names a module imports on first use (PEP 562), so importing it stays cheap."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_getattr(namespace: dict[str, Any], where: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` that imports `name` from the module `where[name]` when first asked
    for, and keeps it in `namespace` (the module's globals), so later reads cost nothing."""
    module_name = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        namespace[name] = value
        return value

    return __getattr__
