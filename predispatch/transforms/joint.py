"""`ep.joint()`: the functional joint forward-backward program of an `ExportedProgram`.

Note [The joint program]
------------------------
An exported program runs under eager autograd; its backward is built at run time from the
graph's ops and HOPs (`autograd_function_apply` carries the user's backward, grad-mode and
autocast regions are HOPs, `keep_history` has its own formula).  The joint program is that
backward written out as ops, in the same graph as the forward:

    (*parameters, *buffers, *user_inputs)
        -> (*buffer_mutations, *user_outputs, *gradients)

It is made by differentiating the program, not the user's code, with torch's own machinery:
make_fx traces, below autograd and under functionalization (as AOTAutograd traces its joint),
a function that runs `ep.graph_module` on inputs that require grad and calls
`torch.autograd.grad(loss, differentiable inputs)` (`ti.trace_differentiated`).  So the backward
is exactly the one eager builds for the program, with eager's formulas: captured Function
backwards and backward hooks appear as their traced bodies, regions stop gradients where eager
does, autocast casts are ops whose backward casts back.  Random ops run once, in the
forward, and the backward reads their saved masks (`native_dropout` ->
`native_dropout_backward(grad, mask)`): with the same RNG state, a joint run draws what eager
draws.  (AOTAutograd's own joint export records formulas in their double-differentiable form,
`silu_backward` as `sigmoid` arithmetic, whose last bits differ from eager's.)

The graph is at the level below autograd, where composites have been taken apart
(`linear` -> `t` + `addmm`): that is the level at which backward formulas exist.

A program that shares repeated blocks (`invoke_subgraph`) keeps them in its joint: each call
becomes a call of the body's forward part and, in the backward, of its backward part, both
made once per body (Note [Shared bodies in the joint] in trace/dedup/backward.py), so the
joint of 32 identical layers traces one layer's joint.  With symbolic sizes the joint is flat.

Gradients are taken of the loss with respect to every parameter that requires grad and every
floating user input.  A parameter the loss does not reach gets no gradient output, and its
entry in `grads` is None, as its `.grad` stays None in eager.  Tied weights are one input,
so one gradient; `grads` lists it under each of their names.

The signature's `out_spec` is the spec of `(outputs, grads)`: running the program with the
original calling convention returns exactly that pair.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

from predispatch import _torch_internals as ti
from predispatch.errors import JointError, user_frame
from predispatch.passes import check_functional, inlined_copy, name_placeholders
from predispatch.trace.dedup.backward import SharedBodies, drop_autograd_only, forward_nodes, static_calls
from predispatch.signature import ExportSignature, InputKind, Leaf, OutputKind, OutputSpec, Program

#: The output kind of the gradient of each kind of differentiable input.
GRADIENT_KIND = {
    InputKind.PARAMETER: OutputKind.GRADIENT_TO_PARAMETER,
    InputKind.USER_INPUT: OutputKind.GRADIENT_TO_USER_INPUT,
}

def joint_program(ep: Program, loss: str | None = None) -> tuple[fx.GraphModule, ExportSignature]:
    """The graph and signature of `ep`'s joint forward-backward program (same state, hooks and
    log: `ExportedProgram.joint` puts them together); see Note [The joint program]."""
    _check_not_joint(ep)
    loss_position = _loss_position(ep, loss)
    wants_grad = [_differentiable(ep, spec) for spec in ep.signature.inputs]
    gm, has_grad = _trace_joint(ep, loss_position, wants_grad, user_frame())
    name_placeholders(gm, [spec.name for spec in ep.signature.inputs])
    _tidy(gm)
    check_functional(gm)
    signature = _joint_signature(ep, gm, [w and g for w, g in zip(wants_grad, has_grad)])
    ti.generate_code(gm)  # once, after every edit: the trace left it lazy
    return gm, signature


def _check_not_joint(ep: Program) -> None:
    if ep.signature.outputs_of(*GRADIENT_KIND.values()):
        raise JointError(
            "this program is already a joint forward-backward program.",
            where=user_frame(),
            fix="call joint() on the exported forward program.",
        )


def _loss_position(ep: Program, loss: str | None) -> tuple[int, ...]:
    """The positions, among the graph outputs, of the loss: the one output, or the named leaf
    (a tensor subclass loss: each of its parts)."""
    sig = ep.signature
    user = [(i, spec) for i, spec in enumerate(sig.outputs) if spec.kind is OutputKind.USER_OUTPUT]
    paths = [spec.target for _, spec in user]
    if loss is None and len(sig.output_leaves) == 1 and sig.output_leaves[0].layout is not None:
        return _subclass_loss(ep, user)
    if loss is None:
        if len(sig.output_leaves) != 1 or len(user) != 1:
            raise JointError(
                f"joint() needs to know which output is the loss; forward returns {len(sig.output_leaves)} "
                f"leaves ({', '.join(leaf.path for leaf in sig.output_leaves)}).",
                where=user_frame(),
                fix="name it: ep.joint(loss='<path>') with one of the paths above.",
            )
        position = user[0][0]
    else:
        matches = [i for i, spec in user if spec.target == loss or _short_path(spec.target) == _short_path(loss)]
        if len(matches) != 1:
            raise JointError(
                f"no tensor output is at path {loss!r}; the tensor outputs are {', '.join(paths) or 'none'}.",
                where=user_frame(),
                fix="pass one of those paths as loss=.",
            )
        position = matches[0]
    _check_scalar(ep, position, sig.outputs[position].target)
    return (position,)


def _subclass_loss(ep: Program, user: list[tuple[int, Any]]) -> tuple[int, ...]:
    """A tensor subclass loss (a `TwoTensor` scalar): its parts' positions.  Eager's
    `loss.backward()` seeds each part with one, which is differentiating their sum."""
    for position, spec in user:
        _check_scalar(ep, position, f"{spec.target}.{spec.inner}")
    return tuple(position for position, _ in user)


def _short_path(path: str) -> str:
    """`output['loss']`, `['loss']` and `loss` name the same leaf."""
    path = path.removeprefix("output")
    if path.startswith("[") and path.endswith("]") and path[1:-1].strip("'\"").isidentifier():
        return path[1:-1].strip("'\"")
    return path


def _check_scalar(ep: Program, position: int, path: str) -> None:
    value = ep.graph.output_node().args[0][position]
    example = value.meta.get("val") if isinstance(value, fx.Node) else None
    if not isinstance(example, torch.Tensor) or example.numel() != 1 or not example.is_floating_point():
        what = "not a tensor" if not isinstance(example, torch.Tensor) else f"{example.dtype} {tuple(example.shape)}"
        raise JointError(
            f"the loss {path!r} must be a floating tensor with one element; it is {what}.",
            where=user_frame(),
            fix="return a scalar loss (for example out.sum() or a criterion's output), or name it with loss=.",
        )


def _differentiable(ep: Program, spec: Any) -> bool:
    """Gradients are wanted for parameters that require grad and for floating user inputs (for a
    tensor subclass, for its floating parts: Note [Tensor subclasses] in frontend/subclasses.py)."""
    if spec.kind is InputKind.PARAMETER:
        return ep.state_dict[spec.target].requires_grad and (not spec.inner or _example(ep, spec).is_floating_point())
    if spec.kind is InputKind.USER_INPUT:
        return _example(ep, spec).is_floating_point()
    return False


def _example(ep: Program, spec: Any) -> torch.Tensor:
    """The fake value of the placeholder `spec` describes."""
    return ep.graph.find_nodes(op="placeholder")[ep.signature.inputs.index(spec)].meta["val"]


def _trace_joint(
    ep: Program, loss_position: tuple[int, ...], wants_grad: list[bool], where: str | None
) -> tuple[fx.GraphModule, list[bool]]:
    """Trace forward + `autograd.grad` of the program below autograd, functionalized
    (`ti.trace_differentiated`).

    Returns the graph `(*inputs) -> (*forward outputs, *gradients)` and, per input, whether
    it got a gradient output (`where`: the user's `joint()` call, for errors raised while
    tracing, whose stack holds the program's generated code).  The forward outputs are
    returned detached: they are values, and only the loss is differentiated.
    """
    placeholders = ep.graph.find_nodes(op="placeholder")
    fake_mode = ti.detect_fake_mode([n.meta["val"] for n in placeholders])
    with fake_mode:
        args = tuple(_fresh(n.meta["val"], wants) for n, wants in zip(placeholders, wants_grad))
    bodies = SharedBodies(fake_mode)
    if static_calls(ep.graph_module):  # see Note [Shared bodies in the joint]
        program = copy.deepcopy(ep.graph_module)
        bodies.retarget(program)
    else:
        program = inlined_copy(ep.graph_module)

    def forward(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = program(*inputs)
        if not any(outputs[p].requires_grad for p in loss_position):
            _no_gradient(ep.signature.outputs[loss_position[0]].target, where)
        return outputs

    got_grad: list[bool] = []

    def joint(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = forward(*inputs)
        differentiable = [t for t, wants in zip(inputs, wants_grad) if wants]
        losses = [outputs[p] for p in loss_position if outputs[p].requires_grad]
        grads = torch.autograd.grad(losses, differentiable, allow_unused=True)
        got_grad[:] = [False] * len(inputs)
        positions = [i for i, wants in enumerate(wants_grad) if wants]
        for i, grad in zip(positions, grads):
            got_grad[i] = grad is not None
        return (*(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs), *(g for g in grads if g is not None))

    with ti.outside_trace():
        gm = ti.trace_differentiated(joint, args, fake_mode)
    bodies.check_engaged(gm)  # every body call went through `bodies`
    gm.meta["forward_outputs"] = len(ep.signature.outputs)
    return gm, got_grad


def _no_gradient(path: str, where: str | None) -> None:
    raise JointError(
        f"the loss {path!r} has no gradient: it depends on no parameter that requires grad and no floating "
        "input, or it is computed with grad mode off (eager's loss.backward() would fail too).",
        where=where,
        fix="compute the loss with grad mode on, from the parameters you train.",
    )


def _fresh(example: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A new fake leaf like `example` (call under its fake mode), requiring grad if wanted."""
    fresh = torch.empty_strided(example.shape, example.stride(), dtype=example.dtype, device=example.device)
    return fresh.requires_grad_(requires_grad)


def _tidy(gm: fx.GraphModule) -> None:
    """Drop autograd-only identities and dead code; put the forward first, then the backward."""
    drop_autograd_only(gm.graph)
    forward = forward_nodes(gm.graph, gm.meta["forward_outputs"])
    first_backward = next((n for n in gm.graph.nodes if n.op != "placeholder" and n not in forward), None)
    for node in list(gm.graph.nodes):
        if first_backward is not None and node in forward and node.op != "placeholder":
            first_backward.prepend(node)
    gm.graph.lint()
    gm.__class__.__name__ = "GraphModule"


def _joint_signature(ep: Program, gm: fx.GraphModule, has_grad: list[bool]) -> ExportSignature:
    """The forward's signature with the gradient outputs appended, and `out_spec` for `(outputs, grads)`."""
    sig = ep.signature
    outputs = list(gm.graph.output_node().args[0])
    specs = [OutputSpec(spec.kind, _name(node), spec.target, spec.inner) for spec, node in zip(sig.outputs, outputs)]
    grad_nodes = iter(outputs[len(sig.outputs):])
    grads: dict[str, tuple[list[Any], Any]] = {}  # name -> (gradient nodes, subclass layout)
    layouts = dict(sig.subclass_state)
    new_outputs: list[Any] = list(outputs[: len(sig.outputs)])
    for spec, got in zip(sig.inputs, has_grad):
        if not _differentiable(ep, spec):
            continue
        node = next(grad_nodes) if got else None
        for name in spec.names:
            nodes, _ = grads.setdefault(name, ([], layouts.get(spec.target) if spec.inner else None))
            nodes.append(node)
            if node is not None:
                new_outputs.append(node)
                specs.append(OutputSpec(GRADIENT_KIND[spec.kind], node.name, name, spec.inner))
    gm.graph.output_node().args = (tuple(new_outputs),)
    forward_value = pytree.tree_unflatten([object()] * len(sig.output_leaves), sig.out_spec)
    grad_leaves = [_gradient_leaf(name, nodes, layout) for name, (nodes, layout) in grads.items()]
    out_spec = pytree.tree_structure((forward_value, dict.fromkeys(grads, object())))
    return ExportSignature(
        sig.inputs,
        tuple(specs),
        sig.in_spec,
        out_spec,
        sig.input_leaves,
        (*sig.output_leaves, *grad_leaves),
        sig.grad_mode_on_exit,
        sig.arg_names,
        sig.shapes,
        training_flags=sig.training_flags,
        outside_tree=sig.outside_tree,
        state_order=sig.state_order,
        placements=sig.placements,
        subclass_state=sig.subclass_state,
    )


def _gradient_leaf(name: str, nodes: list[Any], layout: Any) -> Leaf:
    """The `grads[name]` leaf: a tensor, None (no gradient reached it), or for a tensor subclass
    parameter the subclass built from its parts' gradients, as eager's `.grad` is one."""
    if layout is None or all(node is None for node in nodes):
        return Leaf(f"grads[{name!r}]", nodes[0] is not None)
    if None in nodes or len(nodes) != len(layout.paths()):
        raise JointError(
            f"the gradient of the tensor subclass parameter {name!r} ({layout}) reaches only some of its parts "
            "(integer parts get none); the joint cannot build a gradient of that class.",
            where=user_frame(),
            fix="freeze the parameter (requires_grad_(False)) as quantized weights are, or train through a "
            "subclass whose parts are all floating (torchao's QAT fake-quantizes plain weights).",
        )
    return Leaf(f"grads[{name!r}]", True, layout=layout)


def _name(node: object) -> str:
    return node.name if isinstance(node, fx.Node) else repr(node)


def backward_start(gm: fx.GraphModule, signature: ExportSignature) -> fx.Node | None:
    """The first node of a joint graph's backward part (None for a forward-only program)."""
    if not signature.outputs_of(*GRADIENT_KIND.values()):
        return None
    forward_count = sum(s.kind not in GRADIENT_KIND.values() for s in signature.outputs)
    forward = forward_nodes(gm.graph, forward_count)
    return next((n for n in gm.graph.nodes if n.op not in ("placeholder", "output") and n not in forward), None)



def mark_backward(code: str, ep: Program) -> str:
    """`code` (the joint graph printed) with a comment line where its backward part starts."""
    start = backward_start(ep.graph_module, ep.signature)
    if start is None:
        return code
    lines = code.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith((f"{start.name}:", f"{start.name} =")):
            indent = line[: len(line) - len(line.lstrip())]
            lines.insert(i, f"{indent}# ---- backward: gradients of the loss ----")
            break
    return "\n".join(lines)
