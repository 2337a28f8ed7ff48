"""Which family of `op_allowlist.FAMILIES` each op packet of the running torch falls in.

The table generated on the running torch's release (`op_families_<major>.<minor>.json` beside
this file, by `python -m predispatch.serialize.op_allowlist --write`); on a release with none, the
newest older one: a packet it does not list is refused at load as "undecided", never allowed by
guess.  torch adds, drops and re-tags ops between releases, so one table cannot decide them all.
"""

from __future__ import annotations

import json
from pathlib import Path

from predispatch._torch_internals import TESTED, TORCH

__all__ = ["PACKETS", "TABLE_TORCH", "TORCH_VERSION", "table_path"]


def table_path(version: tuple[int, int]) -> Path:
    """The generated table of torch `version` (major, minor)."""
    return Path(__file__).with_name(f"op_families_{version[0]}.{version[1]}.json")


#: The release whose table decides here: the running one, or the newest tested one before it.
TABLE_TORCH = max((v for v in TESTED if v <= TORCH), default=TESTED[0])

_table = json.loads(table_path(TABLE_TORCH).read_text())
PACKETS: dict[str, tuple[str, ...]] = {family: tuple(packets) for family, packets in _table["packets"].items()}
TORCH_VERSION: str = _table["torch_version"]
