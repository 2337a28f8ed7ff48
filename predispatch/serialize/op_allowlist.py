"""Which ops a program may call: every op packet of `aten`, `prims` and `predispatch`, decided.

The decision is data.  `FAMILIES` names each family of ops, allowed or refused, with the
reason; `op_families_<major>.<minor>.json` lists, for each torch release, which packet (`aten.add`, `prims.mul`) falls
in which family.  That file is generated from torch's registry by the rules below and checked
in, so reviewing a torch upgrade is reading its diff:

    python -m predispatch.serialize.op_allowlist --write

`tests/test_verify.py::test_op_table_decides_every_op` regenerates it in memory and fails when
torch has a packet the file does not decide (or no longer has one it lists): an op torch adds
is refused at load until someone looks at it.

An allowed packet is not enough: each overload must also be registered with the dispatcher
(TorchScript's `aten.add.str` is not a tensor op) and have a schema that mutates nothing
(`add_`, `add.out` are refused by their schema, whatever their packet).  See
`decide(op)`, which `verify.py` calls for every node.
"""

from __future__ import annotations

import argparse
import json
import functools
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from predispatch import _torch_internals as ti

#: The namespaces the table decides; ops of other namespaces are allowed only when the caller
#: names their namespace (`load(..., op_namespaces=...)`) and their schema is functional.
NAMESPACES = ("aten", "prims", "predispatch")


@dataclass(frozen=True)
class PacketInfo:
    """What the rules read of one packet (`aten.add`): its overloads' schemas and registration."""

    name: str
    #: (overload name, is_mutable, registered with the dispatcher) per overload.
    overloads: tuple[tuple[str, bool, bool], ...]

    @property
    def short(self) -> str:
        return self.name.split(".", 1)[1]


@dataclass(frozen=True)
class OpFamily:
    """One row of the allow list: which packets, allowed or not, and why.

    `matches` is the rule that generates the family's membership from torch's registry; the
    rules are tried in table order and the first that matches decides.  `files_only`: refused
    in a file, but export may emit it when the user's own code calls it (a sparse op); such a
    program cannot be saved.
    """

    name: str
    allowed: bool
    reason: str
    matches: Callable[[PacketInfo], bool]
    files_only: bool = False


def _named(*names: str, prefixes: tuple[str, ...] = ()) -> Callable[[PacketInfo], bool]:
    return lambda p: p.name.startswith("aten.") and (p.short in names or p.short.startswith(prefixes))


_IO = ("from_file", "save", "_print", "warn", "_test_warn_in_autograd")
_GLOBAL_STATE = (
    "manual_seed", "seed", "initial_seed", "set_grad_enabled", "is_grad_enabled", "get_autocast_dtype",
    "backward", "_backward", "_propagate_xla_data", "record_stream", "_cudnn_init_dropout_state",
    "_cufft_clear_plan_cache", "_cufft_set_plan_cache_max_size", "_cufft_get_plan_cache_max_size",
    "_cufft_get_plan_cache_size", "set_data",
)
#: Packets that make (or read the innards of) non-strided tensors, or view memory through
#: sizes, strides, offsets or indices they do not check against the storage.
_UNSAFE_LAYOUT = re.compile(
    r"(^|_)(sparse|nested|jagged|mkldnn|cslt|quantized|quantize_per|per_tensor_quantized|per_channel_quantized)"
    r"|^(_?indices|_?values|_indices_copy|_values_copy|crow_indices|col_indices|ccol_indices|row_indices)(_copy)?$"
    r"|^(set|_reshape_alias|_reshape_alias_copy|_?coalesce|_coalesced_?|is_coalesced|to_padded_tensor|int_repr"
    r"|_mkldnn_reshape|_mkldnn_transpose_?|to_dense|_to_dense|to_dense_backward|dense_dim|sparse_dim|_nnz"
    r"|fbgemm_\w+|_cudnn_rnn_flatten_weight|q_\w+|_make_per_\w+|_validate_\w+|resize_as_sparse_?|dequantize)$"
)


def _is_torchscript_builtin(p: PacketInfo) -> bool:
    return not any(registered for _, _, registered in p.overloads)


def _is_mutable_only(p: PacketInfo) -> bool:
    return all(mutable for _, mutable, registered in p.overloads if registered)


def _trusting_packets() -> frozenset[str]:
    from predispatch.serialize.kernel_inputs import TRUSTING_PACKETS

    return TRUSTING_PACKETS


#: The allow list, in the order its rules are tried.
FAMILIES: tuple[OpFamily, ...] = (
    OpFamily("io", False, "reads or writes files, streams or the console; a program computes values only",
             _named(*_IO, prefixes=("_debug_",))),
    OpFamily("global_state", False,
             "reads or changes process-global state (RNG seed, grad mode, autocast, autograd, backend caches); "
             "in a program only the region HOPs change state, for their own scope",
             _named(*_GLOBAL_STATE)),
    OpFamily("unsafe_layout", False,
             "builds or reads sparse, nested, quantized or MKL-DNN tensors, or views memory through sizes, "
             "strides or indices it does not check against the storage (`_sparse_coo_tensor_with_dims_and_tensors`, "
             "`_reshape_alias`, `set` onto a raw Storage); the file format holds strided tensors only",
             lambda p: p.name.startswith("aten.") and bool(_UNSAFE_LAYOUT.search(p.short))
             and not p.short.lstrip("_").startswith("fake_quantize"),  # dense in, dense out
             files_only=True),
    OpFamily("test_only", False, "torch's own test ops; no model calls them", _named(prefixes=("_test_",))),
    OpFamily("torchscript_builtin", False,
             "TorchScript interpreter ops on Python values (str, list, dict), not dispatcher ops; export never emits them",
             _is_torchscript_builtin),
    OpFamily("mutable_only", False, "every overload mutates an argument (in place or out=); programs are functional",
             _is_mutable_only),
    OpFamily("trusts_inputs", False,
             "a kernel that trusts an index, offset or saved statistic its forward produces (Note [Kernels that trust "
             "their inputs] in kernel_inputs.py): refused in a file unless the verifier proves its forward feeds it",
             lambda p: p.name in _trusting_packets(), files_only=True),
    OpFamily("aten_functional", True,
             "functional tensor ops, what export emits; an overload whose schema mutates (out=, in place) is still "
             "refused by its schema",
             lambda p: p.name.startswith("aten.")),
    OpFamily("prims", True, "torch's primitive ops; mutable overloads (`copy_to`, `resize`) are refused by their schema",
             lambda p: p.name.startswith("prims.")),
    OpFamily("predispatch", True, "our own ops (predispatch/ops.py): functional, with fake kernels and autograd formulas",
             lambda p: p.name.startswith("predispatch.")),
)
FAMILY_BY_NAME: Mapping[str, OpFamily] = {f.name: f for f in FAMILIES}


@dataclass(frozen=True)
class Decision:
    """Whether one overload may appear in a program, and why (a family's reason, or the schema's)."""

    allowed: bool
    family: str
    reason: str


# --------------------------------------------------------------------------- generation


def registry_packets(namespaces: Iterable[str] = NAMESPACES) -> dict[str, PacketInfo]:
    """Every packet `torch.ops` can resolve in `namespaces`, from torch's registry."""
    from predispatch import ops  # noqa: F401 - registers predispatch::keep_history

    ti.import_op_registrations()  # the same registry whatever this process imported before
    registered = ti.dispatcher_op_names()
    overloads: dict[str, list[tuple[str, bool, bool]]] = {}
    for schema in ti.jit_op_schemas():
        namespace, _, name = schema.name.partition("::")
        if namespace not in namespaces:
            continue
        key = f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name
        overloads.setdefault(f"{namespace}.{name}", []).append(
            (schema.overload_name or "default", schema.is_mutable, key in registered)
        )
    return {name: PacketInfo(name, tuple(sorted(o))) for name, o in sorted(overloads.items())}


def classify(packets: Mapping[str, PacketInfo]) -> dict[str, list[str]]:
    """Family name -> packets, by the first rule of `FAMILIES` that matches each packet."""
    families: dict[str, list[str]] = {f.name: [] for f in FAMILIES}
    for packet in packets.values():
        family = next((f for f in FAMILIES if f.matches(packet)), None)
        if family is None:
            raise ValueError(f"no family decides {packet.name}; add a rule to FAMILIES")
        families[family.name].append(packet.name)
    return families


def render(families: Mapping[str, list[str]]) -> str:
    """The text of the running torch's `op_families_<major>.<minor>.json`: one packet a line, so
    a torch upgrade's review is the diff of two tables."""
    data = {
        "generated_by": "python -m predispatch.serialize.op_allowlist --write",
        "torch_version": torch.__version__.split("+")[0],
        "packets": {name: list(packets) for name, packets in families.items()},
    }
    return json.dumps(data, indent=1) + "\n"


#: The generated table of the running torch's release.
TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"op_families_{ti.TORCH[0]}.{ti.TORCH[1]}.json")


# --------------------------------------------------------------------------- decisions


#: Tags torch puts on in-place and out= overloads (checked besides the schema).
_MUTATING_TAGS = frozenset(getattr(torch.Tag, name) for name in ("inplace", "inplace_view", "out", "out_variant") if hasattr(torch.Tag, name))


@functools.cache
def _family_of_packet() -> dict[str, str]:
    from predispatch.serialize.op_families import PACKETS

    return {packet: family for family, packets in PACKETS.items() for packet in packets}


@functools.cache
def _registered() -> frozenset[str]:
    return ti.dispatcher_op_names()


def is_known_packet(name: str) -> bool:
    """Whether the table decides packet `name` (`aten.__and__`), allowed or refused."""
    return name in _family_of_packet()


def decide(op: torch._ops.OpOverload, extra_namespaces: tuple[str, ...] = (), *, stored: bool = True) -> Decision:
    """May `op` appear in a program?  Its packet's family first, then its own schema.

    `stored`: in a program read from (or written to) a file; False for what export may emit,
    which also allows the `files_only` families (the user's own sparse code, say).
    """
    namespace, packet = op.namespace, op._schema.name.split("::")[1]
    overload = op._overloadname
    key = f"{op._schema.name}.{overload}" if overload != "default" else op._schema.name
    if namespace in NAMESPACES:
        family_name = _family_of_packet().get(f"{namespace}.{packet}")
        if family_name is None:
            return Decision(False, "undecided", f"this torch's {namespace}.{packet} is not in the allow list "
                            "(a newer torch's op: regenerate the table: python -m predispatch.serialize.op_allowlist --write)")
        family = FAMILY_BY_NAME[family_name]
        if not family.allowed and (stored or not family.files_only):
            return Decision(False, family.name, family.reason)
    elif namespace in extra_namespaces:
        family = OpFamily("caller_namespace", True, "a namespace the caller trusts (load(..., op_namespaces=...))", bool)
    else:
        return Decision(False, "namespace", f"namespace {namespace!r} is not one a program may call")
    if namespace in ("aten", "prims") and key not in _registered():  # custom ops are always dispatcher ops
        return Decision(False, "torchscript_builtin", FAMILY_BY_NAME["torchscript_builtin"].reason)
    if op._schema.is_mutable or any(tag in _MUTATING_TAGS for tag in op.tags):
        return Decision(False, "mutable_schema", f"its schema {op._schema} mutates an argument (in place or out=)")
    return Decision(True, family.name, family.reason)


def allow_list_summary() -> dict[str, int]:
    """Packets per family, for reports and docs."""
    from predispatch.serialize.op_families import PACKETS

    return {name: len(packets) for name, packets in PACKETS.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {TABLE_PATH}")
    options = parser.parse_args(argv)
    text = render(classify(registry_packets()))
    if options.write:
        with open(TABLE_PATH, "w") as f:
            f.write(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
