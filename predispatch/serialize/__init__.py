"""Serialize: the `.pd` file format (docs/format.md), and the checks a loaded file passes.

`archive.py` writes and reads the zip (manifest, program JSON, safetensors members) through
`graph.py`, `values.py` and `shapes.py`, the classes a file may name through `classes.py`;
`verify.py` checks every loaded program against the IR
contract, the op allow list (`op_allowlist.py`, its per-release `op_families_<release>.json`) and
the kernels that trust their inputs (`kernel_inputs.py`) before anything of it runs.
`predispatch.save` / `predispatch.load` (predispatch/_files.py) are the public entry points.
"""

from predispatch.serialize.archive import load, save
from predispatch.serialize.verify import verify_program

__all__ = ["load", "save", "verify_program"]
