"""Constructs inside forward that export refuses by name, with the fix that fits each.

Each was a raw torch error (or a program that differs from eager) before: the user got
"Attempting to use FunctionalTensor on its own" for a torch.func transform, an AttributeError
from our own code for a TorchScript submodule, and for `nn.TransformerEncoder` in eval with a
padding mask a program whose padded positions differ from eager's `torch.no_grad()` output.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from predispatch import _torch_internals as ti
from predispatch.errors import DataDependentError, PredispatchError, TraceError, UnsupportedConstructError, user_frame

#: The torch.func files a transform's call passes through (torch/_functorch/...).
_FUNCTORCH_FILES = ("apis.py", "eager_transforms.py", "vmap.py")
_FUNCTIONAL_ON_ITS_OWN = "Attempting to use FunctionalTensor on its own"


def torch_func_refusal(exc: BaseException) -> UnsupportedConstructError | None:
    """Our error for a torch.func transform called inside forward, when `exc` is torch's.

    functorch's transforms wrap their inputs in their own tensor levels, under which the
    export's FunctionalTensorMode is not active: torch raises "Attempting to use
    FunctionalTensor on its own".  The transforms trace/transforms.py traces below autograd
    never get here; one that reaches functorch another way does."""
    if _FUNCTIONAL_ON_ITS_OWN not in str(exc):
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    if not any("_functorch" in f.filename and os.path.basename(f.filename) in _FUNCTORCH_FILES for f in frames):
        return None
    return UnsupportedConstructError(
        "forward calls a torch.func transform that export does not trace (vmap, grad, grad_and_value, vjp and "
        "jvp, and the transforms made of them, are traced below autograd: Note [torch.func in forward]).",
        where=user_frame(exc.__traceback__),
        fix="export the function the transform is applied to and apply torch.func to the program "
        "(torch.func.vmap(ep.module())(x) works); or write the batched computation with batched ops "
        "(a leading batch dimension, torch.bmm) instead of vmap.",
    )


def refuse_script_modules(root: nn.Module) -> None:
    """Refuse a TorchScript module in the tree: its forward is TorchScript's interpreter, not
    Python, so the trace cannot see its ops (nor its state as the module's own)."""
    for path, module in root.named_modules():
        if isinstance(module, torch.jit.ScriptModule):
            name = f"submodule {path!r}" if path else "the module"
            raise UnsupportedConstructError(
                f"{name} is a TorchScript module (torch.jit.script / torch.jit.trace); export traces "
                "Python code, and a scripted module runs in TorchScript's interpreter.",
                where=f"{user_frame()} (the export call)",
                fix="export the original nn.Module (before torch.jit.script), e.g. keep a reference to it "
                "and assign that as the submodule for export.",
            )


_ENCODER_FAST_PATH = "nn.TransformerEncoder fast-path check (TransformerEncoder.forward)"


@contextlib.contextmanager
def refusing_encoder_fast_path() -> Iterator[None]:
    """Refuse `nn.TransformerEncoder` where eager's `torch.no_grad()` call takes the nested-tensor
    fast path, while the trace (grad on, parameters requiring grad) takes the slow path: in eval
    mode with a `src_key_padding_mask`, eager's fast path returns 0 at padded positions and the
    program returns what the layers compute there."""

    def make(original: Any) -> Any:
        def forward(self: nn.TransformerEncoder, src: Any, mask: Any = None, src_key_padding_mask: Any = None, *a: Any, **kw: Any):
            if not self.training and getattr(self, "use_nested_tensor", False) and src_key_padding_mask is not None:
                raise UnsupportedConstructError(
                    "nn.TransformerEncoder in eval mode with a src_key_padding_mask: eager under torch.no_grad() "
                    "takes its nested-tensor fast path and returns 0 at padded positions, the exported program "
                    "computes the layers there (eager's path with grad on); their outputs differ.",
                    where=user_frame(),
                    fix="build the encoder with enable_nested_tensor=False (or set encoder.use_nested_tensor = False "
                    "before export): eager then returns the layers' values at padded positions too, and so does the "
                    "program; mask the padded positions of the output yourself if you need zeros there.",
                )
            return original(self, src, mask, src_key_padding_mask, *a, **kw)

        return forward

    with ti.patched(nn.TransformerEncoder, "forward", make, mechanism=_ENCODER_FAST_PATH):
        yield


_PROPERTY_ERRORS = "property errors under nn.Module.__getattr__ (make_fx's _orig_module_getattr)"


class _Probe(nn.Module):
    """A module the probe asks for a missing attribute."""


@contextlib.contextmanager
def naming_property_errors() -> Iterator[None]:
    """An AttributeError raised inside a module's property is raised as ours, naming the property.

    Python answers an AttributeError from a property by calling the class's `__getattr__`, and
    `nn.Module.__getattr__` raises its own "'Linear' object has no attribute 'weight'" with the
    property's error dropped (not even chained): a parametrization or a SimpleFSDP-style
    gathered parameter failing under the trace (a DTensor attribute a FunctionalTensor lacks)
    read as a missing parameter.  When torch's `__getattr__` fails for a name that is a property
    of the class, the property is run again to catch its own error, which is raised as a
    TraceError naming the property and the line inside it that failed.

    While the trace runs, `nn.Module.__getattr__` is make_fx's wrapper, which calls torch's
    original through the module global `_orig_module_getattr` of torch/fx/_symbolic_trace.py,
    read at each call: that global is what is replaced (`ti.FX_MODULE_GETATTR`).  Not
    `nn.Module.__getattr__` itself: Dynamo, which traces `torch.cond`'s branches, would trace
    into the replacement and fail to capture the branch.  The probe reaches the global as the
    wrapper does; tests/test_errors.py shows the property named on every tested release.
    """

    def make(original: Any) -> Any:
        def __getattr__(self: nn.Module, name: str) -> Any:
            try:
                return original(self, name)
            except AttributeError:
                getter = _property_getter(type(self), name)
                if getter is None:
                    raise
                try:
                    getter(self)
                except AttributeError as inner:
                    raise _property_error(type(self), name, inner) from None
                raise

        return __getattr__

    fx_owner, fx_name = ti.FX_MODULE_GETATTR
    with ti.patched(fx_owner, fx_name, make, mechanism=_PROPERTY_ERRORS, probe=_probe_fx_getattr):
        yield


def _probe_fx_getattr() -> None:
    """As FX's `module_getattr_wrapper` calls it: the module global, looked up at call time."""
    owner, name = ti.FX_MODULE_GETATTR
    getattr(owner, name)(_Probe(), "_predispatch_probe_missing")


def _property_getter(cls: type, name: str) -> Any:
    """The getter of property `name` of `cls` (searched along its MRO as Python does), or None."""
    for klass in cls.__mro__:
        if name in vars(klass):
            found = vars(klass)[name]
            return found.fget if isinstance(found, property) else None
    return None


def _property_error(cls: type, name: str, inner: AttributeError) -> TraceError:
    error = TraceError(
        f"property {cls.__name__}.{name} raised AttributeError: {inner}; nn.Module.__getattr__ would "
        f"have reported it as a missing attribute {name!r}.",
        where=user_frame(inner.__traceback__),
        fix="the named line inside the property failed under tracing; torch's error is kept as "
        "err.torch_error. A property that gathers a DTensor parameter (SimpleFSDP, parametrizations of "
        "DTensors) is not supported yet: see docs/distributed.md.",
    )
    error.torch_error = inner
    return error


# --- constructs recognised in a failed trace's traceback ------------------------------------

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep

#: Files of torch's tracing machinery (relative to torch's package): the frames between the
#: user's (or torch's library) code and the failure, never where the construct is.
_MACHINERY = (
    "fx" + os.sep, "_subclasses" + os.sep, "_dynamo" + os.sep, "_library" + os.sep, "_prims" + os.sep,
    "_refs" + os.sep, "_decomp" + os.sep, "_higher_order_ops" + os.sep, "_functorch" + os.sep,
    "utils" + os.sep + "_stats.py", "utils" + os.sep + "_python_dispatch.py", "nn" + os.sep + "modules" + os.sep + "module.py",
    "__init__.py", "_ops.py", "_compile.py", "_tensor.py", "_guards.py", "overrides.py", "_meta_registrations.py",
)


def _torch_relative(filename: str) -> str | None:
    """`filename` relative to torch's package, or None outside it."""
    path = os.path.abspath(filename)
    return path[len(_TORCH_DIR):] if path.startswith(_TORCH_DIR) else None


def _frames(tb: TracebackType | None) -> list[tuple[FrameType, int]]:
    """The traceback's frames with their line numbers, outermost first."""
    return list(traceback.walk_tb(tb))


def _innermost_torch_library_frame(tb: TracebackType | None) -> tuple[str, FrameType, int] | None:
    """The innermost frame of torch's library code (not its tracing machinery) deeper than the
    user's innermost frame: where torch's own code, not the user's, did what failed."""
    found = None
    for frame, line in _frames(tb):
        relative = _torch_relative(frame.f_code.co_filename)
        if relative is None:
            found = None  # the user's code (or predispatch's) is deeper than any torch frame so far
        elif not relative.startswith(_MACHINERY):
            found = (relative, frame, line)
    return found


@dataclass(frozen=True)
class TorchCheck:
    """A data-dependent check inside torch's own code that users meet, with the fix that fits it.

    file: the file inside torch's package (`ao/quantization/fake_quantize.py`).
    construct: what the user wrote that runs the check, as they know it.
    fix: what the user can do (torch.cond cannot reach inside torch's code).
    when: for an entry that fits only some failures in `file`, whether it fits this one (read
        off the traceback's frames, outermost first); the first entry that fits is used.
    """

    file: str
    construct: str
    fix: str
    when: Callable[[list[tuple[FrameType, int]]], bool] | None = None


#: torch.distributions' files of distributions that build a base distribution inside them.
_WRAPPING_DISTRIBUTIONS = tuple(
    os.path.join("distributions", name)
    for name in ("relaxed_bernoulli.py", "relaxed_categorical.py", "transformed_distribution.py")
)


def _builds_inner_distribution(frames: list[tuple[FrameType, int]]) -> bool:
    """Whether the failing check runs in a distribution another one built: a relaxed or
    transformed distribution's frame is on the stack, or a distributions frame above the check
    was passed validate_args=False (which therefore did not reach the check)."""
    for frame, _ in frames:
        relative = _torch_relative(frame.f_code.co_filename)
        if relative is None or not relative.startswith("distributions"):
            continue
        if relative in _WRAPPING_DISTRIBUTIONS or frame.f_locals.get("validate_args") is False:
            return True
    return False


#: Checks inside torch that read tensor values, which users meet in forward (issue 23, 10).
TORCH_CHECKS = (
    TorchCheck(
        os.path.join("ao", "quantization", "fake_quantize.py"),
        "torch.ao.quantization.FakeQuantize, whose forward branches on the values of its "
        "observer_enabled and fake_quant_enabled buffers",
        "use FusedMovingAvgObsFakeQuantize (the fake quantizer of torch.ao.quantization.get_default_qat_qconfig), "
        "which reads those flags inside one op; or export the float model and quantize the program with "
        "PT2E (torch.ao.quantization.quantize_pt2e.prepare_qat_pt2e).",
    ),
    TorchCheck(
        # RelaxedBernoulli(..., validate_args=False) builds its LogitRelaxedBernoulli without the
        # flag, so the inner one validates by torch's default: the user's flag cannot reach it.
        os.path.join("distributions", "distribution.py"),
        "a torch.distributions distribution built inside another one (a relaxed or transformed "
        "distribution such as RelaxedBernoulli or RelaxedOneHotCategorical builds its base without the "
        "validate_args you passed), and the inner one checks its parameters' values by torch's default",
        "call torch.distributions.Distribution.set_default_validate_args(False) before export (and restore "
        "it after if you rely on it), and check the values outside forward if you need to; validate_args=False "
        "on the outer distribution does not reach the inner one.",
        when=_builds_inner_distribution,
    ),
    TorchCheck(
        os.path.join("distributions", "distribution.py"),
        "a torch.distributions distribution with validate_args=True, which checks its parameters' "
        "(and log_prob's sample's) values",
        "build the distribution with validate_args=False (or call "
        "torch.distributions.Distribution.set_default_validate_args(False) before export), and check "
        "the values outside forward if you need to.",
    ),
)


def torch_check_error(exc: BaseException, where: str | None) -> DataDependentError | None:
    """Our error for a data-dependent check inside torch's own code: the fix of `TORCH_CHECKS`
    for a known one, else where in torch the check is and what the user can still do."""
    found = _innermost_torch_library_frame(exc.__traceback__)
    if found is None:
        return None
    relative, frame, _ = found
    inside = f"{relative.replace(os.sep, '/')} ({frame.f_code.co_name})"
    for check in TORCH_CHECKS:
        if relative == check.file and (check.when is None or check.when(_frames(exc.__traceback__))):
            return DataDependentError(
                f"forward uses {check.construct}; export traces shapes, not values, so the check has no "
                f"answer (it is inside torch's {inside}, where torch.cond cannot be applied).",
                where=where,
                fix=check.fix,
            )
    return DataDependentError(
        f"a check inside torch's own code ({inside}) reads a value inside a tensor, which export cannot "
        "know (it traces shapes, not values); torch.cond cannot be applied inside torch's code.",
        where=where,
        fix="call that torch function with arguments that skip the check (see the named file), or outside "
        "forward on the program's inputs or outputs.",
    )


def _autograd_refusal(exc: BaseException) -> UnsupportedConstructError | None:
    """forward called `torch.autograd.grad` or `.backward()`: the trace runs forward above
    autograd, where forward's tensors have no autograd graph to differentiate."""
    for frame, _ in reversed(_frames(exc.__traceback__)):
        relative = _torch_relative(frame.f_code.co_filename)
        if relative == os.path.join("autograd", "__init__.py") and frame.f_code.co_name in ("grad", "backward"):
            return UnsupportedConstructError(
                f"forward calls torch.autograd.{frame.f_code.co_name} (or Tensor.backward); export traces "
                "forward above autograd, where forward's tensors have no autograd graph to differentiate.",
                where=user_frame(exc.__traceback__),
                fix="export the function without the gradient and differentiate the program's output outside "
                "it (torch.autograd.grad(ep.module()(x).sum(), x) in your training step), or write the "
                "derivative out in forward.",
            )
    return None


def _packed_sequence_refusal(exc: BaseException) -> UnsupportedConstructError | None:
    """forward packs a batch (`pack_padded_sequence`) or runs an RNN on a PackedSequence: the
    packed sizes are computed from the lengths' values, which the trace does not have."""
    rnn_utils = os.path.join("nn", "utils", "rnn.py")
    for frame, _ in _frames(exc.__traceback__):
        packing = _torch_relative(frame.f_code.co_filename) == rnn_utils
        if packing or any(isinstance(v, PackedSequence) for v in frame.f_locals.values()):
            return UnsupportedConstructError(
                "forward packs a padded batch (torch.nn.utils.rnn.pack_padded_sequence / PackedSequence): the "
                "packed batch sizes come from the lengths' values, which export cannot know (it traces "
                "shapes, not values).",
                where=user_frame(exc.__traceback__),
                fix="run the RNN on the padded batch without packing and mask the steps past each length "
                "(torch.arange(T) < lengths[:, None]); a unidirectional RNN's outputs at the valid steps are "
                "the packed run's, and its final state is the output at lengths - 1 (gather it).",
            )
    return None


@dataclass(frozen=True)
class JaggedConstruct:
    """A jagged nested tensor operation torch cannot trace, known by the function of torch's
    nested tensor code (`file`, `function`) the failed trace passed through.

    construct: what the user wrote, as they know it.
    why: why no trace can follow it.
    fix: what works instead (each fix is exported in tests/test_nested.py).
    """

    file: str
    function: str
    construct: str
    why: str
    fix: str


_NESTED = os.path.join("nested", "_internal")

#: Jagged nested tensor operations torch cannot trace (Note [Jagged nested tensors] in
#: frontend/subclasses.py), outermost first: the first one the traceback passes through names it.
JAGGED_CONSTRUCTS = (
    JaggedConstruct(
        os.path.join(_NESTED, "sdpa.py"),
        "jagged_scaled_dot_product_attention",
        "scaled_dot_product_attention over jagged nested tensors",
        "on CPU torch computes it with its math kernel, converting each jagged tensor to a nested tensor of the "
        "strided layout split by the offsets' values; fake tensors have no kernels for that layout, and the "
        "split sizes are data (torch.compile breaks its graph there too)",
        "compute the attention on the padded batch: p = x.to_padded_tensor(0.0) (build x with max_seqlen=, or pass "
        "one from torch.nested.nested_tensor, so the padded length is known), keep = torch.arange(p.shape[1]) < "
        "x.offsets().diff()[:, None], F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :]), "
        "and return the padded result (times keep[..., None]).",
    ),
    JaggedConstruct(
        os.path.join("nested", "__init__.py"),
        "narrow",
        "torch.nested.narrow(..., layout=torch.jagged)",
        "it checks the starts' and lengths' values to choose between a contiguous jagged tensor and one with holes",
        "pass the values and offsets as inputs and build the jagged tensor with "
        "torch.nested.nested_tensor_from_jagged(values, offsets) (lengths=... for one with holes).",
    ),
    JaggedConstruct(
        os.path.join(_NESTED, "nested_tensor.py"),
        "_get_sdpa_extreme_seqlen",
        "an operation on a jagged nested tensor that needs its minimum or maximum sequence length (softmax or "
        "padding over the jagged dimension, attention)",
        "the jagged tensor has none cached, and computing one reads the offsets' values",
        "give the lengths where the jagged tensor is built: torch.nested.nested_tensor_from_jagged(values, offsets, "
        "min_seqlen=..., max_seqlen=...) (a Python int is a constant of the program), or pass a jagged tensor made "
        "by torch.nested.nested_tensor(..., layout=torch.jagged), which caches both (they are then inputs).",
    ),
)


def _jagged_refusal(exc: BaseException) -> UnsupportedConstructError | None:
    """A jagged nested tensor operation torch cannot trace (`JAGGED_CONSTRUCTS`), or a nested
    tensor of the strided layout made in forward: our error naming it, when torch's failure is
    the trace's (a value read from data, an op without fake kernel), not one eager has too."""
    if not isinstance(exc, (*ti.DATA_DEPENDENT_ERRORS, ti.NO_FAKE_KERNEL)):
        return None
    where = user_frame(exc.__traceback__)
    passed = [(_torch_relative(frame.f_code.co_filename), frame.f_code.co_name) for frame, _ in _frames(exc.__traceback__)]
    for construct in JAGGED_CONSTRUCTS:
        if (construct.file, construct.function) in passed:
            return UnsupportedConstructError(
                f"forward uses {construct.construct}, which export cannot trace: {construct.why}.",
                where=where,
                fix=construct.fix,
            )
    if isinstance(exc, ti.NO_FAKE_KERNEL) and "_nested" in str(exc):
        return UnsupportedConstructError(
            f"forward makes a nested tensor of the strided layout (torch.nested's default), which export cannot "
            f"trace: fake tensors have no kernels for that layout ({exc}).",
            where=where,
            fix="build it with layout=torch.jagged (torch.nested.nested_tensor(tensors, layout=torch.jagged) or "
            "torch.nested.nested_tensor_from_jagged(values, offsets)); jagged nested tensors are traced "
            "(docs/subclasses.md).",
        )
    return None


#: Constructs recognised in a failed trace, each giving our error (None: not this one).
_REFUSALS: tuple[Callable[[BaseException], PredispatchError | None], ...] = (
    torch_func_refusal,
    _autograd_refusal,
    _packed_sequence_refusal,
    _jagged_refusal,
)


def construct_refusal(exc: BaseException) -> PredispatchError | None:
    """Our error naming the construct a failed trace met, when `exc` shows a known one."""
    for refusal in _REFUSALS:
        error = refusal(exc)
        if error is not None:
            return error
    return None
