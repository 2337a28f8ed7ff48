"""Which family of `op_allowlist.FAMILIES` each op packet of the running torch falls in.

The table generated on the running torch's release (`_op_families_by_torch/torch_<major>_<minor>.py`);
on a release with none, the newest older one: a packet it does not list is refused at load as
"undecided", never allowed by guess.
"""

from __future__ import annotations

import importlib

from predispatch._torch_internals import TESTED, TORCH

__all__ = ["PACKETS", "TABLE_TORCH", "TORCH_VERSION", "module_name"]


def module_name(version: tuple[int, int]) -> str:
    """The generated table of torch `version` (major, minor)."""
    return f"predispatch.program._op_families_by_torch.torch_{version[0]}_{version[1]}"


#: The release whose table decides here: the running one, or the newest tested one before it.
TABLE_TORCH = max((v for v in TESTED if v <= TORCH), default=TESTED[0])

_table = importlib.import_module(module_name(TABLE_TORCH))
PACKETS: dict[str, tuple[str, ...]] = _table.PACKETS
TORCH_VERSION: str = _table.TORCH_VERSION
