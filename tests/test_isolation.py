"""Nothing changes but the result: the module and torch's globals after export, on success and failure."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import queue
import subprocess
import sys
import threading

import pytest
import torch
import torch.utils._pytree as pytree
from helpers import export_and_check, state_bits, subprocess_env
from torch import nn

import predispatch
from predispatch import _torch_internals as ti
from predispatch._isolation import GlobalState


class Model(nn.Module):
    """Touches global state the way real forwards do, then optionally fails."""

    def __init__(self, fail: bool):
        super().__init__()
        self.fail = fail
        self.lin = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps.add_(1)
        y = self.bn(self.lin(x))
        torch.set_grad_enabled(False)  # left open, as a plain call
        self.bn.eval()  # flips a training flag
        torch.set_default_dtype(torch.float64)
        torch.autocast("cpu", dtype=torch.bfloat16).__enter__()  # never exited
        if self.fail:
            raise RuntimeError("boom")
        return y


class PassThrough(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _snapshot(model: nn.Module):
    def hooks(m):
        return (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks), dict(m._state_dict_hooks))

    return {
        "global": GlobalState.capture(),
        "rng": torch.get_rng_state(),
        "inference": torch.is_inference_mode_enabled(),
        "state": state_bits(model),
        "params": {n: id(p) for n, p in model.named_parameters()},
        "training": [(n, m.training) for n, m in model.named_modules()],
        "hooks": [hooks(m) for m in model.modules()],
    }


def _assert_unchanged(before, model):
    after = _snapshot(model)
    g0, g1 = before["global"], after["global"]
    for field in ("grad_enabled", "default_dtype", "autocast", "autocast_cache", "mode_depths", "compiler_flags"):
        assert getattr(g0, field) == getattr(g1, field), field
    assert torch.equal(before["rng"], after["rng"])
    assert before["inference"] == after["inference"]
    assert before["params"] == after["params"]
    assert before["training"] == after["training"]
    assert before["hooks"] == after["hooks"]
    assert before["state"].keys() == after["state"].keys()
    for key, value in before["state"].items():
        assert torch.equal(value, after["state"][key]), key


@pytest.mark.parametrize("fail", [False, True], ids=["success", "failure"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_module_and_globals_restored(fail, mode):
    model = Model(fail).train(mode == "train")
    model.lin.register_forward_hook(lambda m, i, o: o)
    x = torch.randn(4, 3)
    before = _snapshot(model)
    with pytest.raises(predispatch.errors.TraceError) if fail else contextlib.nullcontext():
        predispatch.export(model, (x,))
    _assert_unchanged(before, model)


def test_restored_under_outer_modes():
    """Exporting from inside no_grad and a dispatch mode leaves both in place."""
    model, x = Model(fail=True), torch.randn(4, 3)
    with torch.no_grad(), PassThrough():
        depths = ti.mode_stack_depths()
        with pytest.raises(predispatch.errors.TraceError):
            predispatch.export(model, (x,))
        assert ti.mode_stack_depths() == depths
        assert not torch.is_grad_enabled()


def test_bad_input_changes_nothing():
    model, x = Model(fail=False), torch.randn(4, 3)
    before = _snapshot(model)
    with pytest.raises(predispatch.errors.UnsupportedInputError):
        predispatch.export(model, x)
    _assert_unchanged(before, model)


def test_no_garbage_collection_during_the_trace():
    """The cyclic collector runs finalizers (Python code: a half-read generator under no_grad
    closes by toggling grad mode) at any allocation; inside a trace they would run under the
    tracer's modes, so collection waits until the trace is done, and is on again after."""
    from predispatch.trace.functional import is_tracing

    during = []

    def watch(phase, info):
        if phase == "start":
            during.append(is_tracing())

    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)  # collect at nearly every allocation
    gc.callbacks.append(watch)
    try:
        predispatch.export(nn.Sequential(nn.Linear(3, 3), nn.ReLU()), (torch.randn(2, 3),))
    finally:
        gc.callbacks.remove(watch)
        gc.set_threshold(*threshold)
    assert during and not any(during), "a collection ran while tracing"
    assert gc.isenabled()


# --- torch's global switches (issue 12, item 6) -----------------------------------------------


def _flip_switch(switch: ti.GlobalSwitch):
    """Another value for `switch`, set the way users set it where torch has a public call."""
    value = switch.get()
    if value is ti.UNREADABLE:  # not readable here (mkldnn.allow_tf32 without oneDNN's TF32)
        return None
    public = {
        "torch.use_deterministic_algorithms": lambda: torch.use_deterministic_algorithms(not value[0], warn_only=True),
        "torch.set_num_threads": lambda: torch.set_num_threads(value + 1),
        "torch.set_float32_matmul_precision": lambda: torch.set_float32_matmul_precision(
            "medium" if value != "medium" else "highest"
        ),
        "torch.set_flush_denormal": lambda: torch.set_flush_denormal(not value),
        "torch.set_warn_always": lambda: torch.set_warn_always(not value),
        "torch.set_default_device": lambda: torch.set_default_device("meta" if value is None else None),
        "torch.set_printoptions": lambda: torch.set_printoptions(precision=value["precision"] + 3),
        "torch.autograd.set_detect_anomaly": lambda: torch.autograd.set_detect_anomaly(not value[0], check_nan=False),
        "torch.backends.opt_einsum.enabled/strategy": lambda: switch.set((not value[0], None)),
        "torch.backends.mha.set_fastpath_enabled": lambda: torch.backends.mha.set_fastpath_enabled(not value),
        "torch.backends.quantized.engine": lambda: setattr(
            torch.backends.quantized, "engine", next(e for e in torch.backends.quantized.supported_engines if e != torch.backends.quantized.engine)
        ),
        "torch.nn.attention (sdpa priority order)": lambda: switch.set(list(reversed(value))),
    }
    if switch.name in public:
        return public[switch.name]()
    if switch.name == "torch.autograd.graph.saved_tensors_hooks (the stack)":
        return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack).__enter__()
    if switch.name == "torch.autograd.graph.disable_saved_tensors_hooks":
        return switch.set("flipped" if value is None else None)
    if isinstance(value, bool):
        return switch.set(not value)
    if isinstance(value, dict):  # a config module: flip its first boolean key
        key = next(k for k, v in value.items() if isinstance(v, bool))
        return switch.set({**value, key: not value[key]})
    if isinstance(value, tuple):
        return switch.set((not value[0], *value[1:]))
    if isinstance(value, str) and "fp32_precision" in switch.name:
        return switch.set("tf32" if value != "tf32" else "ieee")
    if isinstance(value, str):  # autograd fallback mode, cudnn depthwise kernel
        return switch.set({"warn": "nothing", "auto": "native"}.get(value, value))
    return switch.set(type(value)(list(type(value).__members__.values())[-1]) if hasattr(type(value), "__members__") else value)


#: Switches torch has no getter for, read by a probe that cannot run inside a trace (a vmap):
#: flipped from the value read before export.
_PROBED = {"torch._C._functorch._set_vmap_fallback_warning_enabled"}
_PROBED_BEFORE: dict[str, bool] = {}


class FlipsEverything(nn.Module):
    """Changes every switch in `ti.GLOBAL_SWITCHES` from inside forward, then maybe fails."""

    def __init__(self, fail: bool, changed: list[str], refused: list[str]):
        super().__init__()
        self.fail = fail
        self.lin = nn.Linear(3, 3)
        # bound methods, not the lists: export puts back the module's lists as it found them
        self.changed, self.refused = changed.append, refused.append  # refused: this machine cannot flip it

    def forward(self, x):
        y = self.lin(x)
        for switch in ti.GLOBAL_SWITCHES:
            if switch.name in _PROBED:
                switch.set(not _PROBED_BEFORE[switch.name])
                self.changed(switch.name)
                continue
            before = switch.get()
            try:
                _flip_switch(switch)
            except RuntimeError:  # "Float16 arithmetic is not supported by the CPU!"
                self.refused(switch.name)
            if switch.get() != before:
                self.changed(switch.name)
        if self.fail:
            raise RuntimeError("boom")
        return y


@pytest.mark.parametrize("fail", [False, True], ids=["success", "failure"])
def test_global_switches_restored(fail):
    changed, refused = [], []
    _PROBED_BEFORE.update({s.name: s.get() for s in ti.GLOBAL_SWITCHES if s.name in _PROBED})
    model, x = FlipsEverything(fail, changed, refused), torch.randn(2, 3)
    before = [switch.get() for switch in ti.GLOBAL_SWITCHES]
    with pytest.raises(predispatch.errors.TraceError) if fail else contextlib.nullcontext():
        predispatch.export(model, (x,))
    after = [switch.get() for switch in ti.GLOBAL_SWITCHES]
    assert [s.name for s, a, b in zip(ti.GLOBAL_SWITCHES, after, before) if a != b] == []
    # the test can fail: forward really changed (almost) every switch
    unreadable = {s.name for s in ti.GLOBAL_SWITCHES if s.get() is ti.UNREADABLE}
    cannot_flip = {"torch.set_flush_denormal"} if not torch.set_flush_denormal(False) else set()
    assert {s.name for s in ti.GLOBAL_SWITCHES} - unreadable - cannot_flip - set(changed) <= set(refused)
    assert len(refused) <= 2, refused  # only hardware-dependent ones (fp16 reduction on a CPU without fp16)
    assert torch.get_default_device() == torch.device("cpu")
    assert torch.empty(1).device.type == "cpu"


def test_switch_table_names_the_public_ones():
    """The table holds the settings users set most (a guard against an entry going missing)."""
    names = {s.name for s in ti.GLOBAL_SWITCHES}
    for name in (
        "torch.use_deterministic_algorithms",
        "torch.set_num_threads",
        "torch.set_float32_matmul_precision",
        "torch.set_flush_denormal",
        "torch.autograd.set_detect_anomaly",
        "torch.backends.cudnn.benchmark",
        "torch.backends.mkldnn.enabled",
        "torch.backends.opt_einsum.enabled/strategy",
        "torch.backends.cuda.matmul.allow_tf32",
        "torch.backends.cuda.enable_flash_sdp",
        "torch.set_default_device",
        "torch.set_warn_always",
        "torch.jit enabled (torch.jit._state.disable/enable)",
        "torch._C._functorch._set_vmap_fallback_enabled",
        "torch._functorch.config",
        "torch._dynamo.config",
    ):
        assert name in names, name


# --- what forward writes on the user's objects (issue 12, item 5) ------------------------------


class WritesEverywhere(nn.Module):
    """A forward that writes on everything it can reach, then maybe fails."""

    def __init__(self, fail: bool):
        super().__init__()
        self.fail = fail
        self.lin = nn.Linear(3, 3)
        self.old = nn.Linear(3, 3)
        self.register_buffer("running", torch.zeros(3))
        self.cache: dict[str, torch.Tensor] = {}
        self.history: list[torch.Tensor] = []
        self.nested = {"inner": {}}

    def forward(self, x):
        y = self.lin(x)
        self.cache_t = x * 2  # a new plain attribute
        self.register_buffer("b", x.sum())  # a new buffer
        self.register_parameter("p", nn.Parameter(torch.ones(3)))  # a new parameter
        self.lin.register_forward_hook(lambda m, i, o: o * 2)  # a hook added inside forward
        nn.modules.module.register_module_forward_hook(lambda m, i, o: o)  # a global one
        self.cache["bias"] = y + 1  # a plain dict cache
        self.history.append(y)
        self.nested["inner"]["t"] = y
        self.added = nn.Linear(3, 3)  # a submodule added
        del self.old  # and one removed
        self.running = y.sum(0)  # a buffer replaced (same shape: a buffer mutation)
        self.lin.training = not self.lin.training
        if self.fail:
            raise RuntimeError("boom")
        return y + self.running


def _traced_tensors_reachable(model: nn.Module) -> list[str]:
    """Paths of tracer tensors reachable from the model's attributes and plain containers."""
    found = []

    def visit(value, path, depth):
        if ti.is_traced_tensor(value):
            found.append(path)
        elif depth < 6 and isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                visit(v, f"{path}[{i}]", depth + 1)
        elif depth < 6 and isinstance(value, dict):
            for k, v in value.items():
                visit(v, f"{path}[{k!r}]", depth + 1)

    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            visit(value, f"{name}.{attr}", 0)
    return found


@pytest.mark.parametrize("fail", [False, True], ids=["success", "failure"])
def test_forward_writes_are_put_back(fail):
    model, x = WritesEverywhere(fail), torch.randn(2, 3)
    namespaces = [(m, dict(vars(m))) for m in model.modules()]
    registries = [
        (m, {k: dict(v) for k, v in vars(m).items() if isinstance(v, dict)}) for m in model.modules()
    ]
    global_hooks = [dict(t) for t in ti.global_module_hook_tables()]
    before = _snapshot(model)
    with pytest.raises(predispatch.errors.TraceError) if fail else contextlib.nullcontext():
        predispatch.export(model, (x,))
    _assert_unchanged(before, model)
    for module, saved in namespaces:
        assert vars(module).keys() == saved.keys()
        assert all(vars(module)[k] is v for k, v in saved.items())
    for module, saved in registries:
        assert {k: dict(v) for k, v in vars(module).items() if isinstance(v, dict)} == saved
    assert model.cache == {} and model.history == [] and model.nested == {"inner": {}}
    assert [dict(t) for t in ti.global_module_hook_tables()] == global_hooks
    assert _traced_tensors_reachable(model) == []
    # usable after export, and exportable again
    model.fail = False
    predispatch.export(model, (x,))
    try:
        model(x)  # eager after export: no tracer tensor to trip on
    finally:  # eager's forward registers its global hook for real: take it away again
        for table, saved in zip(ti.global_module_hook_tables(), global_hooks):
            table.clear()
            table.update(saved)


def test_replaced_buffer_is_a_buffer_mutation():
    """`self.running = new` (same shape) changes the buffer in eager: the program records it."""

    class Replaces(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("running", torch.zeros(3))

        def forward(self, x):
            self.running = x.sum(0) * 2
            return x + self.running

    x = torch.randn(2, 3)
    ep = export_and_check(Replaces(), (x,))
    assert [(s.kind.name, s.target) for s in ep.signature.mutations] == [("BUFFER_MUTATION", "running")]
    eager, program = Replaces(), ep.module()
    eager(x), program(x)
    torch.testing.assert_close(program.running, eager.running, rtol=0, atol=0)


class _InplaceActivations(nn.Module):
    """The ops whose Meta kernels export swaps while it traces, then optionally a failure."""

    def __init__(self, fail: bool):
        super().__init__()
        self.fail = fail

    def forward(self, x):
        y = torch.nn.functional.relu6(x * 1, inplace=True)
        y = torch.nn.functional.silu(y, inplace=True)
        if self.fail:
            raise RuntimeError("boom")
        return y


def _torch_op_tables():
    """What export patches on torch's classes and op tables while it traces (and must put back)."""
    from torch.fx import _lazy_graph_module

    from predispatch.trace.decompose import FAST_INPLACE_META

    meta = torch._C.DispatchKey.Meta
    return (
        {op: op.py_kernels.get(meta) for op in FAST_INPLACE_META},
        dict(vars(torch._subclasses.functional_tensor.FunctionalTensorMode)),
        _lazy_graph_module._use_lazy_graph_module_flag,
    )


@pytest.mark.parametrize("fail", [False, True], ids=["success", "failure"])
def test_op_tables_and_classes_restored(fail):
    """The fast Meta kernels (Note [Meta kernels of in-place activations]), the patched
    FunctionalTensorMode methods and FX's lazy-GraphModule flag are torch's own again after
    export, and an in-place activation then behaves as in eager."""
    before = _torch_op_tables()
    x = torch.randn(4, 3)
    with pytest.raises(predispatch.errors.TraceError) if fail else contextlib.nullcontext():
        export_and_check(_InplaceActivations(fail), (x,))
    assert _torch_op_tables() == before
    assert torch.equal(torch.nn.functional.relu6(x.clone(), inplace=True), torch.nn.functional.relu6(x))
    kernel = torch.ops.aten.hardtanh_.default.py_kernels[torch._C.DispatchKey.Meta]
    assert kernel.__qualname__ == "register_inplace.<locals>.inplace_op"  # torch's decomposition, not ours


def test_exports_in_two_threads_both_succeed_and_other_threads_keep_torchs_functions():
    """Two threads export at once (a custom Function, a tensor hook, a grad region each) while a
    third keeps calling `Function.apply` and `register_hook` eagerly: every export succeeds with
    the right gradient, and the third thread never meets predispatch's hooks.  Before: both
    exports failed, and the third thread's calls raised now and then."""
    import threading

    from helpers import StraightThrough

    class Hooked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = StraightThrough.apply(self.lin(x))
            y.register_hook(lambda g: g * 3)
            with torch.no_grad():
                scale = y.abs().mean()
            return y * scale

    errors, grads, stop = [], [], threading.Event()
    torch.manual_seed(0)
    made = [(Hooked(), torch.randn(2, 4)) for _ in range(6)]  # (another thread's draws: test_rng.py)

    def exporter(jobs):
        try:
            for module, x in jobs:
                x = x.clone().requires_grad_()
                ep = predispatch.export(module, (x,))
                ep.module()(x).sum().backward()
                grads.append((module, x.grad.clone()))
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    def bystander():
        while not stop.is_set():
            t = torch.ones(3, requires_grad=True)
            out = StraightThrough.apply(t)
            out.register_hook(lambda g: g * 2)
            out.sum().backward()
            if not torch.equal(t.grad, torch.full((3,), 2.0)):
                errors.append(AssertionError(f"bystander's gradient {t.grad}"))

    threads = [threading.Thread(target=exporter, args=(made[i::2],)) for i in range(2)]
    watcher = threading.Thread(target=bystander)
    watcher.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    stop.set()
    watcher.join(timeout=60)
    assert not errors, errors
    assert len(grads) == 6
    for module, grad in grads:  # each program's gradient is its eager model's
        x = dict((id(m), x) for m, x in made)[id(module)].clone().requires_grad_()
        module(x).sum().backward()
        assert torch.equal(grad, x.grad)


@pytest.mark.parametrize("fail", [False, True], ids=["success", "failure"])
def test_autocast_state_of_every_device_type_restored(fail):
    """Forward leaves autocast on, with another dtype, for every device type torch keeps a state
    for (xpu, hpu, mps, ... not only cpu and cuda); export puts each back."""

    class LeavesAutocastOn(nn.Module):
        def forward(self, x):
            for device in ti.AUTOCAST_DEVICE_TYPES:
                torch.set_autocast_enabled(device, True)
                torch.set_autocast_dtype(device, torch.float16 if device == "cpu" else torch.bfloat16)
            if fail:
                raise RuntimeError("boom")
            return x * 2

    assert {"cpu", "cuda", "xpu", "hpu", "mps"} <= set(ti.AUTOCAST_DEVICE_TYPES)
    before = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ti.AUTOCAST_DEVICE_TYPES}
    with pytest.raises(predispatch.errors.TraceError) if fail else contextlib.nullcontext():
        predispatch.export(LeavesAutocastOn(), (torch.randn(3),))
    assert {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ti.AUTOCAST_DEVICE_TYPES} == before


# --- switches forward leaves changed, each set the way users set it (issue 21, item 7) --------


def _pack(t):
    return t


def _unpack(t):
    return t


def _saved_hooks_stack():
    """The thread's saved-tensors hooks, bottom first (read by popping and pushing back)."""
    autograd, stack = torch._C._autograd, []
    while (top := autograd._top_saved_tensors_default_hooks(True)) is not None:
        stack.append(top)
        autograd._pop_saved_tensors_default_hooks()
    for pack, unpack in reversed(stack):
        autograd._push_saved_tensors_default_hooks(pack, unpack)
    return list(reversed(stack))


def _vmap_fallback_warns() -> bool:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.vmap(torch._C._VariableFunctions._test_functorch_fallback)(torch.ones(2, 1), torch.ones(2, 1))
    return any("batching rule" in str(w.message) for w in caught)


def _implicit_replication():
    from torch.distributed.tensor.experimental import implicit_replication

    return implicit_replication()


#: what forward does -> what must read the same before and after export.
_LEFT_CHANGED = {
    "saved_tensors_hooks pushed": (
        lambda outer: torch.autograd.graph.saved_tensors_hooks(_pack, _unpack).__enter__(),
        _saved_hooks_stack,
    ),
    "saved_tensors_hooks popped": (lambda outer: outer.__exit__(None, None, None), _saved_hooks_stack),
    "disable_saved_tensors_hooks": (
        lambda outer: torch._C._autograd._saved_tensors_hooks_disable("no saved tensors here", False),
        lambda: (torch._C._autograd._saved_tensors_hooks_is_enabled(), torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()),
    ),
    "DTensor implicit_replication": (
        lambda outer: _implicit_replication().__enter__(),
        torch._C._get_dtensor_allow_implicit_replication,
    ),
    "functorch vmap fallback warnings": (
        lambda outer: torch._C._functorch._set_vmap_fallback_warning_enabled(False),  # torch's default: True
        _vmap_fallback_warns,
    ),
    "legacy vmap fallback warnings": (
        lambda outer: torch._C._debug_only_display_vmap_fallback_warnings(True),
        torch._C._debug_only_are_vmap_fallback_warnings_enabled,
    ),
}


@pytest.mark.parametrize("fail", [False, True], ids=["success", "failure"])
@pytest.mark.parametrize("case", list(_LEFT_CHANGED))
def test_switch_left_changed_by_forward_is_restored(case, fail):
    """Forward changes a switch and leaves it so (a context entered and never exited, one
    exited that export found entered); export puts it back.  Before: each stayed changed."""
    change, read = _LEFT_CHANGED[case]
    outer = torch.autograd.graph.saved_tensors_hooks(_unpack, _pack)

    class LeavesIt(nn.Module):
        def forward(self, x):
            y = x.sin()
            change(outer)
            if fail:
                raise RuntimeError("boom")
            return y * 2

    outer.__enter__()
    try:
        before = read()
        with pytest.raises(predispatch.errors.TraceError) if fail else contextlib.nullcontext():
            predispatch.export(LeavesIt(), (torch.randn(3),))
        assert read() == before
    finally:
        outer.__exit__(None, None, None)
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    assert _vmap_fallback_warns() and not torch._C._get_dtensor_allow_implicit_replication()


def test_every_setter_of_torchs_c_modules_is_restored_or_explained():
    """The switch table derived from torch: every function of `torch._C`, `torch._C._functorch`
    and `torch._C._autograd` named like a setter (`_set_*`, `_push_*`, `*_enable`, ...) is
    written back by a `ti.GLOBAL_SWITCHES` entry or listed in `ti.NOT_RESTORED` with why; a new
    torch's new setter fails here until it is decided."""
    assert ti.undecided_setters() == []
    assert all(reason.strip() for reason in ti.NOT_RESTORED.values())


# --- issue 40 item 6: nothing left behind when export fails, or when putting back raises ----


@dataclasses.dataclass
class _Pair:
    """An output type export registers as a pytree node (as torch.export asks users to)."""

    value: torch.Tensor
    tag: object


class _ReturnsAnObject(nn.Module):
    def forward(self, x):
        return _Pair(x * 2, object())  # an object is no output: refused after _Pair was registered


def test_a_failed_export_leaves_no_pytree_registration():
    """The output type, and a dataclass input (torch's `_IntWrapper`), registered during an
    export that then fails, are registered no more: pytree users after it see them as leaves."""
    from torch.export.dynamic_shapes import _IntWrapper

    before = set(pytree.SUPPORTED_NODES)
    with pytest.raises(predispatch.errors.UnsupportedOutputError):
        predispatch.export(_ReturnsAnObject(), (torch.randn(3),))
    assert _Pair not in pytree.SUPPORTED_NODES

    class Scale(nn.Module):
        def forward(self, x, n):
            if x.sum() > 0:  # data-dependent: refused after the inputs' dataclasses were registered
                return x * n.val
            return x

    with pytest.raises(predispatch.errors.DataDependentError):
        predispatch.export(Scale(), (torch.randn(3), _IntWrapper(3)))
    assert _IntWrapper not in pytree.SUPPORTED_NODES
    assert set(pytree.SUPPORTED_NODES) - before <= _IMPORTED_NODES()  # only what importing torch's modules registers


def _IMPORTED_NODES() -> set[type]:
    """Pytree nodes torch registers when export first imports one of its modules (an import
    is not undone): torch.distributed.tensor's `TupleStrategy`."""
    found = set()
    try:
        from torch.distributed.tensor._op_schema import TupleStrategy

        found.add(TupleStrategy)
    except ImportError:
        pass
    return found


def test_a_successful_export_keeps_its_registrations():
    """A program's module returns the dataclass: its registration stays, as before."""

    @dataclasses.dataclass
    class Out:
        y: torch.Tensor

    Out.__qualname__ = "test_a_successful_export_keeps_its_registrations.Out"

    class M(nn.Module):
        def forward(self, x):
            return Out(x + 1)

    ep = predispatch.export(M(), (torch.randn(2),))
    assert Out in pytree.SUPPORTED_NODES
    assert isinstance(ep.module()(torch.ones(2)), Out)


class _Key:
    """A dict key whose `__eq__` raises against any other key of the same hash."""

    def __init__(self, name: str):
        self.name = name

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other):
        if self is other:
            return True
        raise RuntimeError("keys cannot be compared")


class _SwapsAKey(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.first = _Key("first")
        self.table = {self.first: 1}
        self.log = []

    def forward(self, x):
        y = self.lin(x)
        del self.table[self.first]
        self.table[_Key("second")] = 2  # same hash as the key it replaces
        self.log.append(y)
        self.cache = y * 2  # a tracer tensor left on the module
        return y


def test_putting_back_never_calls_the_users_eq():
    """Putting back compares by identity: the user's raising `__eq__` is never called, and the
    module is as it was (issue 40 item 6: it stopped the restore half-way, leaving a tracer)."""
    m = _SwapsAKey()
    predispatch.export(m, (torch.randn(2, 3),))
    assert list(m.table) == [m.first] and m.table[m.first] == 1
    assert m.log == [] and "cache" not in vars(m)


class _Logs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.members = {"a"}
        self.log = []

    def forward(self, x):
        y = self.lin(x)
        self.members.add("b")
        self.log.append(y)
        self.cache = y * 2
        return y


def test_every_restore_step_runs_when_one_raises(monkeypatch):
    """Putting back compares by identity and runs no user code, so no restore step is expected
    to raise; if one does anyway (here: made to, for one set), every other step still runs (no
    tracer left on the module, the list put back), then export raises RestoreError naming it."""
    from predispatch import _isolation

    m = _Logs()
    put_back = _isolation._put_back

    def failing(container, saved):
        if container is m.members:
            raise RuntimeError("cannot put this set back")
        put_back(container, saved)

    monkeypatch.setattr(_isolation, "_put_back", failing)
    with pytest.raises(predispatch.errors.RestoreError, match=r"could not put back a container of set.*RuntimeError: cannot put this set back"):
        predispatch.export(m, (torch.randn(2, 3),))
    assert m.log == [] and "cache" not in vars(m)


_INTERRUPTED = r"""
import os, signal, sys, threading, time
import torch
import predispatch
from torch import nn

class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
    def forward(self, x):
        for _ in range(200):
            x = self.lin(x).relu()
            self.cache = x
        return x

m = Slow()
predispatch.export(m, (torch.randn(2, 8),))  # imports done: the interrupts land inside exports
fired = 0
def settle(timer):
    # wait until the timer's signal has been delivered (it may land here rather than in export)
    while True:
        try:
            timer.join()
            time.sleep(0.05)
            return
        except KeyboardInterrupt:
            continue

for trial in range(int(sys.argv[1])):
    delay = 0.002 + 0.04 * (trial % 25) / 25
    timer = threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGINT))
    try:
        timer.start()
        predispatch.export(m, (torch.randn(2, 8),))
    except KeyboardInterrupt:
        fired += 1
    settle(timer)
    left = [k for k, v in vars(m).items() if isinstance(v, torch.Tensor) and predispatch._torch_internals.is_traced_tensor(v)]
    assert not left and "cache" not in vars(m), (trial, left)
print(fired)
"""


_FIRST_DYNAMO_USE = """
import torch, predispatch
from torch.distributions import Distribution, Normal

class Cond(torch.nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.cos(), (x,))

assert Distribution._validate_args is True
predispatch.export(Cond(), (torch.randn(3),))
print("validate_args after export:", Distribution._validate_args)
try:
    Normal(torch.zeros(1), -torch.ones(1))
    print("a negative scale was accepted")
except ValueError:
    print("a negative scale was refused")
"""


def test_dynamos_first_use_leaves_distribution_validation_on():
    """torch.cond's trace is Dynamo's first use in the process, whose `TorchPatcher.patch`
    turns distributions' argument validation off for good: after the export a user's
    `Normal(0, -1)` was accepted silently.  The switch table puts it back.  In a fresh process:
    the patch runs once per process."""
    done = subprocess.run([sys.executable, "-c", _FIRST_DYNAMO_USE], capture_output=True, text=True, timeout=600,
                          env=subprocess_env(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "validate_args after export: True" in done.stdout and "a negative scale was refused" in done.stdout, done.stdout


def test_ctrl_c_during_export_leaves_no_tracer_on_the_module():
    """Ctrl-C at many points of an export (a timer sends SIGINT): each lands as a
    KeyboardInterrupt, the module keeps no tracer tensor, and the process does not abort
    (before: 1 trial in 75 left a tracer; a Ctrl-C landing where torch's C++ calls Python,
    `simple_registry.find`, terminated the process with SIGABRT, in 3 of 6 runs of 60 trials
    here).  In a subprocess: signals, and an abort must fail the test, not the test run."""
    done = subprocess.run([sys.executable, "-c", _INTERRUPTED, "150"], capture_output=True, text=True, timeout=900,
                          env=subprocess_env(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.strip().splitlines()[-1]) == 150  # every interrupt landed inside an export, as a KeyboardInterrupt


class AsksWhileAnotherThreadAsks(nn.Module):
    """Asks torch.compiler's flags in forward, and lets another thread ask them meanwhile (the
    answers go out through a queue: export puts back a dict forward writes into)."""

    def __init__(self, answers: queue.Queue, asked: threading.Event, answered: threading.Event):
        super().__init__()
        self.answers, self.asked, self.answered = answers, asked, answered

    def forward(self, x):
        self.answers.put(("exporting thread", (torch.compiler.is_exporting(), torch.compiler.is_compiling())))
        self.asked.set()
        assert self.answered.wait(60)
        return x + 1


def test_export_flags_are_true_in_the_exporting_thread_only():
    """Note [Export flags in one thread] (issue 36): while one thread exports, another thread's
    `torch.compiler.is_exporting()` and `is_compiling()` answer what they did before, not True."""
    answers: queue.Queue = queue.Queue()
    asked, answered = threading.Event(), threading.Event()

    def other_thread():
        asked.wait(60)
        answers.put(("other thread", (torch.compiler.is_exporting(), torch.compiler.is_compiling())))
        answered.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        predispatch.export(AsksWhileAnotherThreadAsks(answers, asked, answered), (torch.randn(2),))
    finally:
        answered.set()
        thread.join(60)
    seen = dict(answers.get_nowait() for _ in range(answers.qsize()))
    assert seen == {"exporting thread": (True, True), "other thread": (False, False)}
    assert (torch.compiler.is_exporting(), torch.compiler.is_compiling()) == (False, False)
