"""Sample calls for CIA ops, and how they are found.

Three sources, each named by its label prefix:

* ``op_db:<OpInfo>#k``: torch's OpInfo samples (CPU, float32 where supported).  Running an
  OpInfo tells us nothing about which CIA overloads it reaches, so each sample runs under
  ``ReachRecorder``, a mode on the PreDispatch key that sees every CIA op before its kernel
  decomposes it, records a copy of its arguments, and then decomposes it itself so that the
  CIA ops *inside* (``batch_norm`` -> ``_batch_norm_impl_index`` -> ``native_batch_norm``)
  are recorded too, with the chain in ``Sample.via``;
* ``hand:<name>``: small programs for ops op_db does not reach or not in the way that
  matters (``predispatch.audit.hand``), recorded the same way;
* ``schema:<variant>``: calls built from the schema alone, one per variant (every common
  dtype, and a transposed float32 tensor), for every op whose arguments are simple enough.
"""

from __future__ import annotations

import functools
import itertools
import random
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from predispatch._torch_internals import (
    OpOverload,
    PreDispatchMode,
    enable_python_dispatcher,
    load_op_db,
    pytree,
    storage_key,
)

OP_DB_SAMPLES_PER_INFO = 4  # samples taken from each OpInfo


def _cap(source: str, nested: bool) -> tuple[str, int]:
    """Which budget a recorded call draws from, and its size.

    op_db reaches common ops (``reshape``, ``to``) thousands of times: keep the first few
    distinct calls, direct ones and nested ones separately.  Hand-written programs exist
    for the one call they make: each gets its own small budget.
    """
    kind = source.split(":", 1)[0]
    if kind == "op_db":
        return (f"op_db-{'nested' if nested else 'direct'}", 4 if nested else 6)
    return (source, 2)


@dataclass(frozen=True, eq=False)
class Sample:
    """One recorded call of one op, kept as a private copy of its arguments."""

    op: str  # the op called, "aten.reshape.default"
    source: str  # where the call came from: "op_db:reshape#3", "hand:to-same-dtype"
    via: tuple[str, ...]  # the CIA ops it was called inside, outermost first
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]

    @property
    def label(self) -> str:
        chain = f" via {' > '.join(self.via)}" if self.via else ""
        return f"{self.source}{chain}"

    @classmethod
    def call(cls, op: OpOverload, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None,
             source: str = "given") -> Sample:
        """A sample from explicit arguments (copied), for tests and custom ops."""
        args, kwargs = exact_copy((tuple(args), dict(kwargs or {})))
        return cls(str(op), source, (), tuple(args), kwargs)

    def materialize(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A fresh copy of the arguments, so a mutating kernel cannot spoil the next run."""
        args, kwargs = exact_copy((self.args, dict(self.kwargs)))
        return tuple(args), kwargs


@dataclass(frozen=True)
class Program:
    """A small piece of user code whose CIA calls become samples."""

    source: str
    run: Callable[[], object]


@dataclass
class SampleBank:
    """Distinct recorded calls per op, within the budgets of ``_cap``."""

    wanted: frozenset[str]
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    _signatures: dict[str, set[tuple[Any, ...]]] = field(default_factory=dict)
    _spent: dict[tuple[str, str], int] = field(default_factory=dict)

    def offer(self, op: str, source: str, via: tuple[str, ...], args: Any, kwargs: Any) -> None:
        if op not in self.wanted:
            return
        budget, size = _cap(source, bool(via))
        if self._spent.get((op, budget), 0) >= size:
            return
        signature = (source.split(":", 1)[0], _signature(args, kwargs))
        seen = self._signatures.setdefault(op, set())
        if signature in seen:
            return
        seen.add(signature)
        self._spent[(op, budget)] = self._spent.get((op, budget), 0) + 1
        args, kwargs = exact_copy((tuple(args), dict(kwargs)))
        self.samples.setdefault(op, []).append(Sample(op, source, via, tuple(args), kwargs))

    def for_op(self, op: str) -> list[Sample]:
        """Direct calls first: evidence should cite the plainest sample that shows a finding."""
        return sorted(self.samples.get(op, []), key=lambda s: bool(s.via))


class ReachRecorder(PreDispatchMode):
    """Records every CIA call a program makes, nested ones included (see module docstring)."""

    def __init__(self, cia: frozenset[OpOverload], bank: SampleBank, source: str) -> None:
        super().__init__()
        self.cia, self.bank, self.source = cia, bank, source
        self.via: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func not in self.cia:
            return func(*args, **kwargs)
        self.bank.offer(str(func), self.source, tuple(self.via), args, kwargs)
        self.via.append(str(func))
        try:
            with self:
                out = func.decompose(*args, **kwargs)
        finally:
            self.via.pop()
        return func(*args, **kwargs) if out is NotImplemented else out


def seed_everything(seed: int = 0) -> None:
    """Seed torch, ``random`` and numpy: some OpInfo generators draw choices from ``random``."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed)


def record(programs: Iterable[Program], cia: frozenset[OpOverload], bank: SampleBank,
           progress: Callable[[str], None] | None = None) -> None:
    """Run each program under a ReachRecorder; a program that raises just stops early."""
    for n, program in enumerate(programs):
        if progress and n % 500 == 0:
            progress(f"recording samples: {n} programs run")
        seed_everything()
        try:
            with warnings.catch_warnings(), enable_python_dispatcher(), \
                    ReachRecorder(cia, bank, program.source):
                warnings.simplefilter("ignore")
                program.run()
        except Exception:  # noqa: BLE001, S112  (a broken sample loses only its own calls)
            continue


def op_db_programs(per_info: int = OP_DB_SAMPLES_PER_INFO) -> Iterator[Program]:
    """One program per OpInfo sample (and per alias of the OpInfo's op)."""
    for info in load_op_db():
        dtype = _pick_dtype(info)
        if dtype is None:
            continue
        name = info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")
        callers = [(name, info.op)] + [(f"{name}[{a.name}]", a.op) for a in info.aliases]
        for k, sample in enumerate(_first_samples(info, dtype, per_info)):
            for label, op in callers:
                yield Program(f"op_db:{label}#{k}", functools.partial(_call, op, sample))


def _pick_dtype(info: Any) -> torch.dtype | None:
    """float32 where the OpInfo supports it on CPU, else the first supported dtype by name."""
    try:
        dtypes = info.supported_dtypes("cpu")
    except Exception:  # noqa: BLE001
        return None
    if torch.float32 in dtypes:
        return torch.float32
    return min(dtypes, key=str) if dtypes else None


def _first_samples(info: Any, dtype: torch.dtype, n: int) -> list[Any]:
    """The OpInfo's first ``n`` samples, from its raw generator.

    ``OpInfo.sample_inputs`` wraps the generator in test-tracking machinery that walks the
    Python stack (``inspect.stack()``) for every OpInfo: four fifths of the audit's time.
    """
    seed_everything()
    try:
        samples = info.sample_inputs_func(info, "cpu", dtype, False)
        return list(itertools.islice(samples, n))
    except Exception:  # noqa: BLE001
        return []


def _call(op: Callable[..., Any], sample: Any) -> object:
    return op(sample.input, *sample.args, **sample.kwargs)


# --- samples built from the schema alone -------------------------------------------------

@dataclass(frozen=True)
class _Variant:
    """How a schema-built call fills tensors and shape lists."""

    make: Callable[[], torch.Tensor]
    sizes: list[int]  # for int[] arguments that are not dims: the tensor's own shape by default


def _typed(dtype: torch.dtype) -> _Variant:
    return _Variant(lambda: torch.randn(3, 4).mul(3).to(dtype), [3, 4])


# Most lies sit on the no-op branch (a cast to the dtype the input already has, a resize to
# the size it already has), so every common dtype gets a variant and shape lists default to
# the input's own shape; the transposed variant asks for a flat shape, which forces a copy.
_VARIANTS: dict[str, _Variant] = {
    "f32": _Variant(lambda: torch.randn(3, 4), [3, 4]),
    "f32-transposed": _Variant(lambda: torch.randn(4, 3).t(), [12]),
    "f64": _typed(torch.float64),
    "f16": _typed(torch.float16),
    "bf16": _typed(torch.bfloat16),
    "c64": _typed(torch.complex64),
    "c32": _typed(torch.complex32),
    "i64": _typed(torch.int64),
    "i32": _typed(torch.int32),
    "i16": _typed(torch.int16),
    "i8": _typed(torch.int8),
    "u8": _Variant(lambda: torch.randint(0, 5, (3, 4), dtype=torch.uint8), [3, 4]),
    "bool": _Variant(lambda: torch.randn(3, 4) > 0, [3, 4]),
}


def schema_samples(op: OpOverload) -> list[Sample]:
    """One call per variant, or none when an argument has no obvious value."""
    found = []
    for name, variant in _VARIANTS.items():
        seed_everything()
        call = _schema_call(op, variant)
        if call is not None:
            found.append(Sample(str(op), f"schema:{name}", (), *call))
    return found


def _schema_call(op: OpOverload, variant: _Variant) -> tuple[tuple, dict] | None:
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    pending: list[Any] = []  # defaulted positionals, passed only if a required one follows
    for a in op._schema.arguments:
        if a.has_default_value():
            pending.append(a.default_value)
            continue
        value = _value_for(a.name, str(a.type), variant)
        if value is _NO_VALUE:
            return None
        if a.kwarg_only:
            kwargs[a.name] = value
        else:
            args += pending + [value]
            pending = []
    return tuple(args), kwargs


_NO_VALUE = object()


def _value_for(name: str, type_: str, variant: _Variant) -> Any:
    if type_ == "Tensor":
        return variant.make()
    if type_ == "List[Tensor]":
        return [variant.make(), variant.make()]
    if type_.startswith("Optional["):
        return None
    if type_ == "int":
        return _INT_BY_NAME.get(name, 1)
    if type_ in ("List[int]", "List[SymInt]"):
        return [1] if "dim" in name else list(variant.sizes)
    return _SIMPLE_VALUES.get(type_, _NO_VALUE)


_INT_BY_NAME = {"dtype": torch.float32, "layout": torch.strided,
                "memory_format": torch.contiguous_format, "dim": 1}
_SIMPLE_VALUES: dict[str, Any] = {
    "SymInt": 1, "number": 2, "float": 0.5, "bool": False, "Device": torch.device("cpu"),
    "List[float]": [0.5], "List[bool]": [False], "List[number]": [2],
}


# --- copying and comparing calls ----------------------------------------------------------


def exact_copy(tree: Any) -> Any:
    """Copy every tensor in ``tree`` with its exact layout and its sharing with the others.

    ``clone()`` would make a transposed view contiguous and two views of one buffer
    independent, and ``reshape`` and ``to`` decide to alias or copy on exactly that.
    """
    storages: dict[int, torch.UntypedStorage] = {}

    def copy(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        x = x.detach()
        key = storage_key(x)
        plain = type(x) is torch.Tensor and x.layout == torch.strided and not x.is_quantized
        if key is None or not plain:
            return x.clone()
        if key not in storages:
            storages[key] = x.untyped_storage().clone()
        fresh = torch.empty(0, dtype=x.dtype, device=x.device)
        return fresh.set_(storages[key], x.storage_offset(), x.shape, x.stride())

    return pytree.tree_map(copy, tree)


def _signature(args: Any, kwargs: Any) -> tuple[Any, ...]:
    """What makes two calls different for the audit: layouts, dtypes, sharing, other values."""
    leaves = pytree.tree_leaves((args, kwargs))
    first_use: dict[int | None, int] = {}
    return tuple(_leaf_signature(i, x, first_use) for i, x in enumerate(leaves))


def _leaf_signature(i: int, x: Any, first_use: dict[int | None, int]) -> tuple[Any, ...]:
    if not isinstance(x, torch.Tensor):
        return (type(x).__name__, repr(x)[:60])
    key = storage_key(x)
    shared = first_use.setdefault(key, i) if key is not None else i
    strides = x.stride() if x.layout == torch.strided else ()
    return ("T", x.dtype, x.layout, tuple(x.shape), strides, shared)
