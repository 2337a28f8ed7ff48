"""Write the example notebooks (examples/*.ipynb) from the cells below, executed.

    python examples/make_notebooks.py           # (re)write and execute every notebook (~1 min)
    python examples/make_notebooks.py --check   # exit 1 if a stored notebook's cells differ from this file

The notebooks are the source users open, stored with their outputs so that browsing one shows
what it prints; this file is how they are kept small and reviewable: one place to edit, cell
ids fixed so a diff shows only what changed.  They run in a kernel on this interpreter, in
examples/.  tests/test_notebooks.py checks that each stored notebook's cells match this file,
re-executes it, and compares the new outputs with the stored ones (numbers and paths aside).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent


def md(text: str) -> tuple[str, str]:
    return ("markdown", text)


def code(text: str) -> tuple[str, str]:
    return ("code", text)


# Every notebook starts the same way: seed, quiet torch.export's deprecation notices, and make
# examples/ importable whether the kernel runs in examples/ (Jupyter) or in the repository root.
SETUP = """\
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import predispatch

warnings.filterwarnings("ignore")  # torch.export's deprecation notices are not the point here
torch.manual_seed(0)
EXAMPLES = Path("examples") if Path("examples/quickstart.py").exists() else Path(".")
print(f"torch {torch.__version__}, predispatch {predispatch.__version__}")


def check(claim, holds):
    \"\"\"Print a claim this notebook makes; stop with an error if it does not hold.\"\"\"
    print(f"{claim}: {holds}")
    assert holds, claim"""


# ---------------------------------------------------------------------------------------------
# 01: export a model and read its program

NB01 = [
    md("""\
# 1. Exporting a model and reading its program

`predispatch.export(model, args, kwargs)` captures a PyTorch program at the PreDispatch
dispatch key, on fake tensors, and returns an `ExportedProgram`: a **functional** ATen graph
(no in-place op anywhere, without a second pass over the graph) that keeps composite ops such
as `aten.linear` whole where that is safe, and keeps the *training* semantics of the model
(grad-mode regions, custom backward formulas, in-place updates as explicit outputs).

This notebook exports a small classifier and reads the result: the printed program, the
signature (which graph input is a parameter, a buffer, a user input; which output writes back
into a buffer), the lifted state, and `ep.module()`, which runs and trains like the model.
[docs/ir.md](../docs/ir.md) is the reference for everything that can appear in a graph."""),
    code(SETUP),
    md("""\
## A small model

It has parameters, a batch-norm layer in training mode (whose running statistics are updated
in place on every call), a step counter buffer updated in place (`self.steps += 1`), a plain
tensor attribute (`temperature`, neither a parameter nor a buffer), an optional keyword input,
and a dict output."""),
    code("""\
class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.temperature = torch.tensor(2.0)  # a plain tensor attribute: lifted as a constant

    def forward(self, x, mask=None):
        self.steps += 1
        h = F.gelu(self.bn(self.embed(x)))
        logits = self.head(h) / self.temperature
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        return {"logits": logits, "features": h}


model = TinyNet()
x = torch.randn(6, 8)
mask = torch.rand(6, 4) > 0.2"""),
    md("""\
## Export, and check that the model is untouched

`export` runs no real compute and copies no weights. Whether it succeeds or fails, the module is
left bit-identical: same `state_dict` values (the in-place updates in `forward` ran on fake
tensors only), same parameter objects, same training flag; and torch's global state (grad
mode, RNG, default dtype, ...) is as before. We snapshot the model first to show it."""),
    code("""\
before = {k: v.clone() for k, v in model.state_dict().items()}
params_before = [id(p) for p in model.parameters()]
rng_before = torch.get_rng_state()

ep = predispatch.export(model, (x,), {"mask": mask})

check("state_dict bit-identical", all(torch.equal(before[k], v) for k, v in model.state_dict().items()))
check("same parameter objects", params_before == [id(p) for p in model.parameters()])
check("still in training mode, grad mode on", model.training and torch.is_grad_enabled())
check("RNG state unchanged", torch.equal(rng_before, torch.get_rng_state()))
check("steps buffer still 0", model.steps.item() == 0)"""),
    md("""\
## Reading the program

`print(ep)` shows the graph as Python (FX's readable form, every value annotated with its
dtype and shape), then the signature. Things to notice:

- **Placeholders are named after what they are**: `p_` + the parameter's fully qualified name
  (`p_embed_weight` is `embed.weight`), `b_` for buffers, `c_` for constant tensors, then the
  user inputs by argument name. The order is always parameters, buffers, constants, user inputs.
- **Composites stay whole**: `aten.linear` (not `t` + `addmm`), `aten.gelu`.
- **No in-place op**: `self.steps += 1` became `add = aten.add(b_steps, 1)`, and batch norm's
  running-statistics update became the functional `_native_batch_norm_legit_functional`,
  whose new statistics are returned.
- **Mutations are outputs**: the graph returns the new buffer values first, each described as
  `BUFFER_MUTATION target='bn.running_mean'`, then the user outputs with their pytree paths
  (`output['logits']`)."""),
    code("print(ep)"),
    md("""\
## The signature as data

Everything printed above is available as frozen dataclasses: `ep.signature.inputs[i]` describes
graph placeholder `i`, `ep.signature.outputs[j]` describes graph output `j`. A compiler pass or
an optimizer wrapper can find, for example, the trainable parameters and the buffers the
program updates without parsing names."""),
    code("""\
from predispatch import InputKind, OutputKind

sig = ep.signature
print("parameters: ", [s.target for s in sig.inputs if s.kind is InputKind.PARAMETER])
print("buffers:    ", [s.target for s in sig.inputs if s.kind is InputKind.BUFFER])
print("constants:  ", [s.target for s in sig.inputs if s.kind is InputKind.CONSTANT_TENSOR])
print("user inputs:", [s.name for s in sig.inputs if s.kind is InputKind.USER_INPUT])
print()
for spec in sig.outputs:
    print(f"graph output {spec.name:<12} {spec.kind.name:<16} -> {spec.target}")

placeholders = [n.name for n in ep.graph.nodes if n.op == "placeholder"]
print()
check("one spec per placeholder, in order", placeholders == [s.name for s in sig.inputs])"""),
    md("""\
## Lifted state

`ep.state_dict` holds the parameters and buffers by fully qualified name; they are the model's
own tensors (export copies nothing). Tensor attributes that are neither parameters nor buffers
are in `ep.constants`."""),
    code("""\
print("state_dict:", list(ep.state_dict))
print("constants: ", {k: v.item() for k, v in ep.constants.items()})
check("shares the model's tensors", ep.state_dict["embed.weight"] is model.embed.weight)"""),
    md("""\
## `ep.module()` runs like the model

`ep.module()` returns an `nn.Module` with the original calling convention (positional and
keyword arguments, dict output) and the original `state_dict()` keys. It holds `model`'s own
parameters and buffers, as torch.export's module does (no copy), so training it trains `model`.
It writes the mutation outputs back into those buffers after each call, as eager `forward`
does in place: the program's step below counts in `model.steps` too.

Below, the model and the program each run one training step from the same weights: outputs,
buffer updates and gradients are bitwise equal."""),
    code("""\
import copy

eager = copy.deepcopy(model)  # run eager on a copy, to compare with the program from the same start
program = ep.module()
check(f"{type(program).__name__} has the model's state_dict keys", sorted(program.state_dict()) == sorted(model.state_dict()))

out_e = eager(x, mask=mask)
out_p = program(x, mask=mask)
check("outputs equal", all(torch.equal(out_e[k], out_p[k]) for k in out_e))

out_e["logits"].nan_to_num(0.0).sum().backward()
out_p["logits"].nan_to_num(0.0).sum().backward()
grads_e = {n: p.grad for n, p in eager.named_parameters()}
grads_p = {n: p.grad for n, p in program.named_parameters()}
check("gradients equal", all(torch.equal(grads_e[n], grads_p[n]) for n in grads_e))

buffers_p = dict(program.named_buffers())
check("buffers updated like eager", all(torch.equal(b, buffers_p[n]) for n, b in eager.named_buffers()))
print("program steps:", buffers_p["steps"].item(), "| exported model's steps:", model.steps.item())
check("the program's buffers are the model's", buffers_p["steps"] is model.steps)"""),
    md("""\
## The graph is an ordinary FX graph

`ep.graph_module` is a `torch.fx.GraphModule`, so the usual FX tooling applies: iterate over
nodes, count ops, write passes. Every node carries its fake value in `node.meta["val"]`."""),
    code("""\
from collections import Counter

ops = Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function")
for op, count in ops.most_common():
    print(f"{count}  {op}")

linear = next(n for n in ep.graph.nodes if n.target is torch.ops.aten.linear.default)
print("\\n", linear.name, "->", linear.meta["val"].shape, linear.meta["val"].dtype)"""),
    md("""\
## Non-tensor inputs are constants

Export traces with the values it is given. `None` and Python scalars are baked into the program:
exported without a mask, the program has no `masked_fill` and returns `div` directly. Calling
a program with inputs unlike the exported ones (another structure, such as a mask where there
was none, another constant value, another shape or dtype) is refused with
`InputMismatchError` rather than silently computing something else."""),
    code("""\
ep_nomask = predispatch.export(model, (x,))
print(ep_nomask.graph_module.code.strip().splitlines()[-1])

try:
    ep_nomask.module()(x, mask=mask)
except predispatch.errors.InputMismatchError as error:
    print(f"\\n{type(error).__name__}: {error}")
else:
    raise AssertionError("the call should have been refused")"""),
    md("""\
Next: [02_composite_audit.ipynb](02_composite_audit.ipynb), which composites are kept whole
and why."""),
]


# ---------------------------------------------------------------------------------------------
# 02: the composite audit

NB02 = [
    md("""\
# 2. Which composites stay whole: the composite audit

CompositeImplicitAutograd (CIA) ops are the ones torch implements in terms of other ops
(`aten.linear` = `matmul` + `add`). A graph captured at the PreDispatch key sees them before
they decompose, so each can be **kept whole** (a backend can pattern-match one `linear`, a
quantizer can annotate it) or **decomposed**.

Keeping an op whole is only correct if its implementation does what its schema says. Some
composites lie: `aten.reshape` returns a view for some inputs and a copy for others;
`aten.dropout` returns its input itself in eval mode although its schema declares no alias.
A functional graph that kept those whole would be wrong. predispatch ships an **audit**: every
CIA kernel of every CIA aten overload was run on sample inputs under a mode that compares what
the kernel does with what the schema declares. The export keeps an op whole only when its
verdict is PRESERVE. [docs/audit.md](../docs/audit.md) is the full table."""),
    code(SETUP),
    md("""\
## The table

`predispatch.audit.load_table()` returns the shipped table as data: one `AuditEntry` per
overload, with a `Verdict`, a reason in words, a `Reason` code, and the evidence (which sample
on which kernel showed it)."""),
    code("""\
from collections import Counter

from predispatch.audit import Reason, Verdict, load_table

table = load_table()
print(f"audited with torch {table.torch_version}: {len(table.entries)} CIA aten overloads")
for verdict, count in table.summary().items():
    print(f"  {verdict.name:<15} {count}")

print("\\nwhy ops must decompose (main reason):")
reasons = Counter(e.code for e in table.entries.values() if e.verdict is Verdict.MUST_DECOMPOSE)
for reason, count in reasons.most_common():
    print(f"  {count:4}  {reason.value}")"""),
    md("""\
## A few verdicts, with their evidence

Ops are looked up by overload name as torch prints it (`aten.to.dtype`), by the dispatcher's
form (`aten::to.dtype`), or by the `OpOverload` itself."""),
    code("""\
def show(op):
    entry = table.get(op)
    print(f"{entry.op}: {entry.verdict.name}  [{entry.code.value}]")
    print(f"    reason:   {entry.reason}")
    print(f"    evidence: {entry.evidence}\\n")


for op in ["aten.linear.default", "aten.layer_norm.default", torch.ops.aten.scaled_dot_product_attention.default]:
    show(op)
for op in ["aten.reshape.default", "aten::to.dtype", "aten.dropout.default"]:
    show(op)"""),
    md("""\
Reading the evidence: `op_db:<OpInfo>#k` is torch's own OpInfo sample `k`, `hand:<name>` a
hand-written program, `schema:<variant>` a call built from the schema; `(C++)` / `(Python)`
says which kernel ran. `aten.dropout`'s C++ kernel returned its input unchanged (eval mode, or
`p=0`) while the schema promises a fresh tensor: a graph keeping it whole would let a later
in-place update of the result write through to the input.

`scaled_dot_product_attention` draws random numbers when `dropout_p > 0`, but its schema tags
say so (`nondeterministic_seeded`), so that is noted (`also`) and does not block:"""),
    code("""\
print(table.get("aten.scaled_dot_product_attention.default").also)
print(table.verdict("aten.some_op_from_a_newer_torch.default"), "<- an op missing from the table decomposes")"""),
    md("""\
## What an export decided: `ep.audit`

Each export records, for every composite the trace met, whether it was kept whole and why.
This attention block uses `layer_norm`, `linear`, `scaled_dot_product_attention` (all kept),
and `dropout`, `reshape`, `chunk` and `.to(dtype)` (decomposed: the first on the audit's
evidence, the others because their schemas alias, which no functional graph can hold)."""),
    code("""\
class Attention(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.drop(out).reshape(b, t * d).to(torch.float64)


model = Attention().eval()
x = torch.randn(2, 5, 8)
ep = predispatch.export(model, (x,))
print(ep.audit)"""),
    code("""\
print(ep.graph_module.code)
check("program output equals eager", torch.equal(ep.module()(x), model(x)))"""),
    md("""\
In the graph, `chunk` became `split`, `dropout` (eval mode) became a `clone` (a fresh tensor,
as its schema promises), `reshape` a `view`, `.to` a `_to_copy`; the three honest composites
are single nodes.

`ep.audit` is also data: `kept`, `decomposed`, and `decisions` (name -> (kept whole?, why))."""),
    code("""\
print("kept:      ", ep.audit.kept)
print("decomposed:", ep.audit.decomposed)"""),
    md("""\
## Overrides: `decompose=` and `preserve=`

`decompose=[...]` always decomposes the ops named (an overload, or a whole packet such as
`"aten.linear"`): useful for a backend that has no `linear` kernel. `preserve=[...]` keeps
whole ops the default would decompose, when the audit allows it. Here `linear` is lowered to
its implementation (for this 3-D input: `t`, `view`, `addmm`):"""),
    code("""\
ep_lowered = predispatch.export(model, (x,), decompose=["aten.linear"])
print(ep_lowered.audit)
print()
print("graph ops:", sorted({str(n.target) for n in ep_lowered.graph.nodes if n.op == "call_function"}))
check("program output close to eager", torch.allclose(ep_lowered.module()(x), model(x)))"""),
    md("""\
**Preserving an op the audit condemns is refused**, with the audit's reason and evidence in the
message, before anything is traced. The same holds for an op whose schema aliases, and for a
name that is not a composite at all. Every such failure is a `DecompositionError` (a
`predispatch.errors.PredispatchError`) whose message says what, where, and what to do."""),
    code("""\
for preserve in (["aten.dropout"], ["aten.reshape"], ["aten.relu"], ["aten.lienar"]):
    try:
        predispatch.export(model, (x,), preserve=preserve)
    except predispatch.errors.DecompositionError as error:
        print(f"preserve={preserve}\\n{type(error).__name__}: {error}\\n")
    else:
        raise AssertionError(f"preserve={preserve} should have been refused")"""),
    md("""\
The same table from the command line (notebook 6 runs the CLI):

```
predispatch audit --show 5     # summary, and the first 5 ops decomposed on evidence
predispatch audit --markdown   # the whole table, as docs/audit.md
predispatch export model.py:Net --inputs "f32[2,8]" --preserve aten.linear --decompose aten.layer_norm
```

Next: [03_regions_and_mutations.ipynb](03_regions_and_mutations.ipynb)."""),
]


# ---------------------------------------------------------------------------------------------
# 03: grad-mode and autocast regions; mutations

NB03 = [
    md("""\
# 3. Grad-mode regions, autocast regions, and mutations

A program meant for *training* has to keep what eager autograd does. Two things are easy to
lose when a graph is made functional:

1. **Grad-mode regions.** `with torch.no_grad():` changes gradients, not values. predispatch
   turns each region into torch's higher-order op `wrap_with_set_grad_enabled(enabled,
   subgraph, *operands)`; autocast regions become `wrap_with_autocast(...)`. Regions nest.
2. **In-place updates under `no_grad`.** Eager autograd does not see them: the tensor's data
   changes, its autograd history stays. A functional graph replaces the update with a new value
   that has no history; predispatch re-attaches the history with
   `predispatch::keep_history(new_value, old_value)`.

This notebook shows both, and measures each against eager and against torch's own functional
form, `torch.export.export(...).run_decompositions({})`."""),
    code(SETUP),
    code("""\
def grad_of(module, x, *rest):
    \"\"\"d(sum of output)/dx of `module(x, *rest)`, on a fresh leaf copy of x.\"\"\"
    x = x.detach().clone().requires_grad_()
    module(x, *rest).sum().backward()
    return x.grad"""),
    md("""\
## `x + no_grad(2 * x)`: the gradient is 1, not 3"""),
    code("""\
class DetachedDouble(nn.Module):
    def forward(self, x):
        with torch.no_grad():
            y = 2 * x
        return x + y


x = torch.randn(3)
ep = predispatch.export(DetachedDouble(), (x,))
print(ep.graph_code())"""),
    md("""\
The region is a HOP whose subgraph `grad_region_0` is printed nested under the module. Its state
is **absolute**: the region sets grad mode to `False` whatever the caller's mode is.

Now the gradients. torch.export's default (non-functional) graph keeps the region too and gets
1; its functional form, `run_decompositions({})`, inlines the region and trains with 3:"""),
    code("""\
torch_ep = torch.export.export(DetachedDouble(), (x,), strict=False)
torch_functional = torch_ep.run_decompositions({})
print(torch_functional.graph_module.code.strip())
print()
grads = {
    "eager": grad_of(DetachedDouble(), x),
    "predispatch": grad_of(ep.module(), x),
    "torch.export": grad_of(torch_ep.module(), x),
    "torch.export.run_decompositions": grad_of(torch_functional.module(), x),
}
for name, grad in grads.items():
    print(f"{name:<32} {grad}")
assert torch.equal(grads["predispatch"], grads["eager"]) and grads["torch.export.run_decompositions"].eq(3).all()"""),
    md("""\
## Nested regions

`no_grad` > `enable_grad` > `no_grad` is three levels deep: each region is a HOP call inside
the enclosing region's subgraph. Running the program gives every output the same
`requires_grad` as eager, and the same gradient."""),
    code("""\
class Nested(nn.Module):
    def forward(self, x):
        with torch.no_grad():
            a = x * 2
            with torch.enable_grad():
                b = x * 3
                with torch.no_grad():
                    c = b * 4
                d = b + c
        return a, b, c, d, x + d


x = torch.randn(3)
ep = predispatch.export(Nested(), (x,))
print(ep.graph_code())

leaf = x.clone().requires_grad_()
eager_flags = [t.requires_grad for t in Nested()(leaf)]
print("requires_grad, eager:  ", eager_flags)
print("requires_grad, program:", [t.requires_grad for t in ep.module()(leaf)])
check("same requires_grad as eager", [t.requires_grad for t in ep.module()(leaf)] == eager_flags)
check("same gradient as eager", torch.equal(grad_of(lambda x: ep.module()(x)[-1], x), grad_of(lambda x: Nested()(x)[-1], x)))"""),
    md("""\
Because region states are absolute, an `enable_grad` region keeps its meaning when the program
is called under the caller's `no_grad` (gradient checkpointing and meta-learning inner loops do
this). torch.export drops a region whose state equals the grad mode at export time, so its
program loses the `requires_grad`:"""),
    code("""\
class GradInside(nn.Module):
    def forward(self, x):
        with torch.enable_grad():
            return x * x


leaf = torch.randn(3, requires_grad=True)
programs = {
    "eager": GradInside(),
    "predispatch": predispatch.export(GradInside(), (leaf,)).module(),
    "torch.export": torch.export.export(GradInside(), (leaf,), strict=False).module(),
}
with torch.no_grad():
    flags = {name: program(leaf).requires_grad for name, program in programs.items()}
for name, flag in flags.items():
    print(f"{name:<12} output.requires_grad under the caller's no_grad = {flag}")
assert flags == {"eager": True, "predispatch": True, "torch.export": False}"""),
    md("""\
## Autocast regions

An autocast block becomes `wrap_with_autocast(device_type, dtype, enabled, cache_enabled,
subgraph, *operands)`. The subgraph records the dtypes autocast chose (`linear` is `bf16`); the
HOP re-enters autocast at run time, so a composite kept whole inside it, like this `linear`, is
cast by the same autocast kernel as in eager. Autocast and grad regions nest in the order the
context managers were entered: here the `no_grad` region is inside the autocast region."""),
    code("""\
class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.lin(x)
            with torch.no_grad():
                scale = h.abs().amax()
        return h.float() / scale.float()


model, x = Mixed(), torch.randn(4, 8)
ep = predispatch.export(model, (x,))
print(ep.graph_code())
check("output equals eager", torch.equal(ep.module()(x), model(x)))
check("gradient equals eager", torch.equal(grad_of(ep.module(), x), grad_of(model, x)))"""),
    md("""\
## Mutations under `no_grad`: `predispatch::keep_history`

### An intermediate

In eager, `h.mul_(2)` under `no_grad` changes `h`'s data (now `6x`) but not its history (that
of `3x`), so `d(h * x)/dx = 6x + 3x = 9x`. A functional graph computes `mul_1 = h * 2` in the
region and uses `mul_1` afterwards, which has no history at all: `6x`. (torch's functional
form also drops the region, so `mul_1` gets the history of `6x`: `12x`.) predispatch rebinds
`h` to `keep_history(mul_1, mul)` when grad comes back on: the new value, the old history. It
is value-exact, so it changes no number, only where gradients flow."""),
    code("""\
class MutatedUnderNoGrad(nn.Module):
    def forward(self, x):
        h = x * 3
        with torch.no_grad():
            h.mul_(2)
        return h * x


x = torch.tensor([1.0, 2.0, 3.0])
ep = predispatch.export(MutatedUnderNoGrad(), (x,))
print(ep.graph_code())
print()
torch_functional = torch.export.export(MutatedUnderNoGrad(), (x,), strict=False).run_decompositions({})
grads = {
    "eager": grad_of(MutatedUnderNoGrad(), x),
    "predispatch": grad_of(ep.module(), x),
    "torch.export.run_decompositions": grad_of(torch_functional.module(), x),
}
for name, grad in grads.items():
    print(f"{name:<32} {grad}")
assert torch.equal(grads["eager"], 9 * x) and torch.equal(grads["predispatch"], 9 * x)"""),
    md("""\
### A user input

Mutating an input makes a `USER_INPUT_MUTATION` output; `ep.module()` copies it back into the
tensor the caller passed, as eager would have changed it."""),
    code("""\
class CountCalls(nn.Module):
    def forward(self, x, counter):
        with torch.no_grad():
            counter.add_(1)
        return x * counter


x, counter = torch.randn(3), torch.zeros(3)
ep = predispatch.export(CountCalls(), (x, counter))
for spec in ep.signature.outputs:
    print(f"{spec.name:<13} {spec.kind.name:<20} -> {spec.target}")

program = ep.module()
program(x, counter)
program(x, counter)
print("caller's counter after two calls:", counter)
assert counter.eq(2).all()"""),
    md("""\
### A parameter: an exponential moving average

A parameter updated in place under `no_grad` (EMA weights, weight normalisation by hand,
Hebbian updates) is a `PARAMETER_MUTATION` output. It keeps its identity as a leaf: its
gradient is the one eager computes, and the program's copy of the parameter is updated in
place like the model's."""),
    code("""\
class EMA(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))
        self.register_buffer("avg", torch.zeros(3))

    def forward(self, x):
        with torch.no_grad():
            self.weight.mul_(0.9).add_(x.mean(0), alpha=0.1)
            self.avg.lerp_(x.mean(0), 0.5)
        return (x * self.weight).sum(-1) + self.avg.sum()


model, x = EMA(), torch.randn(4, 3)
ep = predispatch.export(model, (x,))
print(ep)"""),
    code("""\
import copy

eager, program = copy.deepcopy(model), ep.module()
eager(x).sum().backward()
program(x).sum().backward()
check("weights after the call equal", torch.equal(eager.weight, program.weight))
check("avg buffers equal", torch.equal(eager.avg, program.avg))
check("weight gradients equal", torch.equal(eager.weight.grad, program.weight.grad))
check("the program's weight is still a leaf Parameter", isinstance(program.weight, nn.Parameter) and program.weight.is_leaf)"""),
    md("""\
Next: [04_autograd_functions.ipynb](04_autograd_functions.ipynb), custom backward formulas."""),
]


# ---------------------------------------------------------------------------------------------
# 04: custom autograd.Functions

NB04 = [
    md("""\
# 4. Custom `torch.autograd.Function`s keep their backward

Quantization-aware training, domain adaptation and many research models rely on a backward
that is **not** the derivative of the forward: a straight-through estimator passes gradients
through `round`, a gradient-reversal layer flips their sign. torch.export inlines a Function's
`forward` and drops its `backward`, so a program trained from it silently differentiates the
forward's ops instead.

predispatch captures both halves as subgraphs of torch's own higher-order op
`autograd_function_apply(fwd, bwd, *operands)`, and `ep.module()` differentiates with the
user's backward. [docs/autograd_function.md](../docs/autograd_function.md) lists what is
supported and what is refused."""),
    code(SETUP),
    md("""\
## Two Functions and a model that uses them

- `FakeQuant`: rounds to a grid of `2**bits` levels in `[-1, 1]`; backward is the
  straight-through estimator, clipped to that range.
- `GradReverse`: identity forward; backward multiplies by `-lambda` (domain-adversarial
  training)."""),
    code("""\

class FakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bits):
        ctx.save_for_backward(x)
        levels = 2 ** bits - 1
        return torch.round((x.clamp(-1, 1) + 1) / 2 * levels) / levels * 2 - 1

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x.abs() <= 1), None  # straight through inside the range; no grad for bits


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lambd):
        ctx.lambd = lambd
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.lambd * grad, None


class QuantDANN(nn.Module):
    \"\"\"A quantized feature extractor, a task head, and a domain head behind gradient reversal.\"\"\"

    def __init__(self):
        super().__init__()
        self.features = nn.Linear(6, 8)
        self.task = nn.Linear(8, 3)
        self.domain = nn.Linear(8, 2)

    def forward(self, x):
        w = FakeQuant.apply(self.features.weight, 4)
        h = torch.relu(F.linear(x, w, self.features.bias))
        return self.task(h), self.domain(GradReverse.apply(h, 0.5))


model, x = QuantDANN(), torch.randn(5, 6) * 2
ep = predispatch.export(model, (x,))
print(ep.graph_code())"""),
    md("""\
Each `Function.apply` is one `autograd_function_apply` node holding a forward subgraph, which
returns `((*outputs), (*saved))`, and a backward subgraph, which takes
`(*output_grads, *saved)` and returns one gradient per operand. The non-tensor arguments
(`bits=4`, `lambd=0.5`) are constants of the subgraphs; `ctx.lambd` is restored for backward.
The traced forward ran once on fake tensors; the user's Python does not run again when the
program runs.

## Gradients equal eager's

We run one backward on the model, on predispatch's program, and on torch.export's program,
from the same weights, and compare every parameter gradient with eager's."""),
    code("""\
import copy


def gradients(module):
    task, domain = module(x)
    (task.square().mean() + domain.square().mean()).backward()
    return {name: p.grad for name, p in module.named_parameters()}


torch_ep = torch.export.export(copy.deepcopy(model), (x,), strict=False)
eager_grads = gradients(copy.deepcopy(model))
differ = {}
for name, program in [("predispatch", ep.module()), ("torch.export", torch_ep.module())]:
    grads = gradients(program)
    differ[name] = [n for n, g in eager_grads.items() if not torch.equal(grads[n], g)]
    print(f"{name:<13}", f"gradients that differ from eager's: {differ[name] or 'none'}")
assert differ["predispatch"] == [] and "features.weight" in differ["torch.export"]"""),
    md("""\
## What torch.export made of them

torch.export's graph holds the forward's ops, `round` and `view_as`, and no trace of either
backward. Differentiating it, `round` has gradient zero (so the quantized weight gets
none: `features.weight`'s gradient is 0), and the reversal layer is an identity (so the
features are trained *towards* the domain classifier instead of against it)."""),
    code("""\
print(torch_ep.graph_module.code.strip())
print()
torch_grads = gradients(torch_ep.module())
print("sum |features.weight gradient|, eager:       ", eager_grads["features.weight"].abs().sum().item())
print("sum |features.weight gradient|, torch.export:", torch_grads["features.weight"].abs().sum().item())"""),
    md("""\
And the gradient-reversal layer on its own: eager and predispatch give `-0.5`, torch.export
gives `+1`."""),
    code("""\
class Reverse(nn.Module):
    def forward(self, h):
        return GradReverse.apply(h, 0.5)


def input_grad(module, h):
    h = h.detach().clone().requires_grad_()
    module(h).sum().backward()
    return h.grad


h = torch.randn(4)
grads = {
    "eager": input_grad(Reverse(), h),
    "predispatch": input_grad(predispatch.export(Reverse(), (h,)).module(), h),
    "torch.export": input_grad(torch.export.export(Reverse(), (h,), strict=False).module(), h),
}
for name, grad in grads.items():
    print(f"{name:<12} {grad}")
assert grads["eager"].eq(-0.5).all() and grads["predispatch"].eq(-0.5).all() and grads["torch.export"].eq(1).all()"""),
    md("""\
## Training the program

The program trains like the model: a few SGD steps from the same weights give identical
parameters.  And it trains the model itself: `ep.module()` holds the model's own parameters
and buffers, as torch.export's module does (no copy)."""),
    code("""\
def train(module, steps=3):
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        task, domain = module(x)
        (task.square().mean() + domain.square().mean()).backward()
        optimizer.step()
    return dict(module.named_parameters())


untrained = copy.deepcopy(model)
trained_eager, trained_program = train(copy.deepcopy(model)), train(ep.module())
check("parameters after 3 steps equal", all(torch.equal(p, trained_program[n]) for n, p in trained_eager.items()))
check("and they are the model's own", all(p is trained_program[n] for n, p in model.named_parameters()))"""),
    md("""\
## Into torch's ExportedProgram, and to inference consumers

`ep.to_torch()` keeps each Function with its backward, so the torch program trains with the
custom backward too.  The node is `predispatch_autograd_function_apply`: torch's
`autograd_function_apply` with a flat forward subgraph, which `torch.export.save`/`load`
round-trip (torch's own form cannot be read back by `torch.export.load`).  `to_torch()` registers
that op; a process that only loads the file runs `import predispatch.ops` first (`import
predispatch` alone does not register it).

Consumers that only run forward (ONNX, PT2E quantization, ExecuTorch) take
`ep.to_torch(for_inference=True)`: each Function's forward is inlined and its backward
dropped, with a warning that says so."""),
    code("""\
torch_program = predispatch.export(untrained, (x,)).to_torch()  # from the same weights again
trained_torch = train(torch_program.module())
check("torch's program trains like eager", all(torch.allclose(p, trained_torch[n]) for n, p in trained_eager.items()))

import logging
import os
import tempfile

logging.getLogger("torch._export.serde.serialize").setLevel(logging.ERROR)  # torch notes each empty list it writes
saved = os.path.join(tempfile.mkdtemp(), "functions.pt2")
torch.export.save(torch_program, saved)
reloaded = torch.export.load(saved)
check("torch.export.load reads it back, custom backward included",
      "predispatch_autograd_function_apply" in str(reloaded.graph)
      and all(torch.equal(a, b) for a, b in zip(reloaded.module()(x), torch_program.module()(x))))

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    inference = ep.to_torch(for_inference=True)
print(caught[0].message)
check("the inference program has no autograd_function_apply",
      all("autograd_function_apply" not in str(n.target) for n in inference.graph.nodes))
check("and runs forward like the model", all(torch.equal(a, b) for a, b in zip(inference.module()(x), model(x))))"""),
    md("""\
A backward that cannot be traced (it calls `.numpy()`, branches on a tensor's value, or reads a
module weight it was not given) is refused with `AutogradFunctionError` or `DataDependentError`,
naming the Function and the line:"""),
    code("""\
class Opaque(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return torch.from_numpy(grad.numpy() * 2)


class UsesOpaque(nn.Module):
    def forward(self, x):
        return Opaque.apply(x)


try:
    predispatch.export(UsesOpaque(), (torch.randn(3),))
except predispatch.errors.AutogradFunctionError as error:
    print(f"{type(error).__name__}: {error}")
else:
    raise AssertionError("export should have refused")"""),
    md("""\
Next: [05_hooks.ipynb](05_hooks.ipynb)."""),
]


# ---------------------------------------------------------------------------------------------
# 05: hooks

NB05 = [
    md("""\
# 5. Module hooks

Hooks change what a module computes without changing its code. predispatch treats each kind
according to whether a trace can keep it:

| hook | what export does |
| --- | --- |
| forward pre-hooks and forward hooks (module or global) | they run during the trace, so their ops are in the graph |
| pure backward pre-hooks, pure full backward hooks (reading `grad_input`, `grad_output`, their module's tensors) | captured: the module's outputs (pre-hooks) or inputs (full hooks) pass through an `autograd_function_apply` whose backward runs the hooks; `grad_output` reaches full hooks through a carrier tensor; the module's tensors are operands of that node |
| backward hooks with side effects, global backward hooks, the deprecated `register_backward_hook` | refused with `UnsupportedHookError`: a trace on fake tensors never builds the autograd nodes they live on, so the program would silently drop them |
| `Tensor.register_hook` with a pure hook on a fresh intermediate | captured: an `autograd_function_apply` node whose backward is the hook |
| `Tensor.register_hook` on a used tensor, an input, or with side effects | refused with `UnsupportedHookError`, saying which |
| `state_dict` / `load_state_dict` hooks | honoured by `ep.module().state_dict()` and `load_state_dict()` |

and `ep.verify_hooks(model)` tells you when the hooks changed after export."""),
    code(SETUP),
    code("""\
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.out = nn.Linear(3, 2)

    def forward(self, x):
        return self.out(torch.relu(self.lin(x)))


def double_input(module, args):
    return (args[0] * 2,)


def add_one(module, args, output):
    return output + 1


x = torch.randn(4, 3)"""),
    md("""\
## Forward hooks are traced

A pre-hook that doubles `lin`'s input and a hook that adds one to its output are ordinary ops
in the graph: the `mul` before and the `add` after `linear`."""),
    code("""\
net = Net()
net.lin.register_forward_pre_hook(double_input)
hook_handle = net.lin.register_forward_hook(add_one)

ep = predispatch.export(net, (x,))
print(ep.graph_module.code.strip())
print()
check("program output equals eager", torch.equal(ep.module()(x), net(x)))"""),
    md("""\
## Full backward hooks are captured, `grad_output` included

A backward hook lives on autograd nodes, which a trace on fake tensors never builds, so
torch.export drops it without a word. predispatch captures a pure one: here a deconvnet-style
hook on a ReLU, which passes back the positive part of the output gradient instead of masking it
by the input's sign. It reads `grad_output`, computed where the module's output is
differentiated, and returns `grad_input`, so a carrier tensor brings the one to the other in the
program (Note [Carrying grad_output] in `predispatch/custom_backward/hooks/full.py`). Gradients through the
program equal eager's, and differ from the model's without the hook."""),
    code("""\
class Deconv(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.act = nn.ReLU()
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.act(self.lin(x)))


def deconvnet(module, grad_input, grad_output):
    return (F.relu(grad_output[0]),)


def input_gradient(module):
    x_grad = x.clone().requires_grad_()
    module(x_grad).square().sum().backward()
    return x_grad.grad


deconv = Deconv()
plain = input_gradient(deconv)
deconv.act.register_full_backward_hook(deconvnet)
program = predispatch.export(deconv, (x,)).module()
check("input gradients equal eager's", torch.equal(input_gradient(program), input_gradient(deconv)))
check("the hook changed them", not torch.equal(input_gradient(program), plain))"""),
    md("""\
## Backward hooks with side effects are refused, by name

A hook that logs would run its `print` once, at export, and never in the program. predispatch
refuses it, naming the module, the hook and where it was defined, and says what to do instead.
The hook stays registered: export changes nothing."""),
    code("""\
def log_grads(module, grad_input, grad_output):
    print("grad_output norm:", grad_output[0].norm())


bw_handle = net.out.register_full_backward_hook(log_grads)
try:
    predispatch.export(net, (x,))
except predispatch.errors.UnsupportedHookError as error:
    print(f"{type(error).__name__}: {error}")
else:
    raise AssertionError("export should have refused")
print()
check("the hook is still registered", list(net.out._backward_hooks.values()) == [log_grads])
bw_handle.remove()"""),
    md("""\
A gradient transformation can also be written in forward, as an `autograd.Function` (identity
forward, the hook's effect as backward), which predispatch captures with its backward
(notebook 4). For example, scaling `out`'s input gradient by 0.1:"""),
    code("""\
class ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class ScaledNet(Net):
    def forward(self, x):
        return self.out(ScaleGrad.apply(torch.relu(self.lin(x)), 0.1))


scaled = ScaledNet()
program = predispatch.export(scaled, (x,)).module()
program.load_state_dict(scaled.state_dict())
scaled(x).sum().backward()
program(x).sum().backward()
check("lin.weight gradients equal", torch.equal(scaled.lin.weight.grad, program.lin.weight.grad))"""),
    md("""\
`Tensor.register_hook` inside forward, with a pure function of the gradient, is captured: the
hook becomes the backward subgraph of an `autograd_function_apply` node, and gradients through
the program go through it as in eager.  A hook with a side effect (here `print`) is refused,
pointing at the line:"""),
    code("""\
class Hooked(nn.Module):
    def forward(self, x):
        h = x * 2
        h.register_hook(lambda grad: grad * 10)
        return h.sum()


x3 = torch.randn(3)
hooked = predispatch.export(Hooked(), (x3,))
print(hooked.graph_code())
a, b = x3.clone().requires_grad_(), x3.clone().requires_grad_()
hooked.module()(a).backward()
Hooked()(b).backward()
check("the captured hook scales gradients as eager's does", torch.equal(a.grad, b.grad))


class Printing(nn.Module):
    def forward(self, x):
        h = x * 2
        h.register_hook(lambda grad: print(grad))
        return h.sum()


try:
    predispatch.export(Printing(), (torch.randn(3),))
except predispatch.errors.UnsupportedHookError as error:
    print(f"{type(error).__name__}: {error}")
else:
    raise AssertionError("export should have refused")"""),
    md("""\
## State-dict hooks

A module that renames keys when saved and loaded (checkpoint compatibility) keeps doing so
through its program: `ep.module().state_dict()` has the module's keys, hooks applied, and
`load_state_dict` accepts them, so weights move between model and program both ways."""),
    code("""\
class Renamed(nn.Module):
    \"\"\"Saves `lin.weight` under an old key, `legacy_weight`, and accepts it on load.\"\"\"

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self._register_state_dict_hook(Renamed._rename_out)
        self._register_load_state_dict_pre_hook(Renamed._rename_in)

    @staticmethod
    def _rename_out(module, state_dict, prefix, local_metadata):
        state_dict[prefix + "legacy_weight"] = state_dict.pop(prefix + "lin.weight")

    @staticmethod
    def _rename_in(state_dict, prefix, *args):
        if prefix + "legacy_weight" in state_dict:
            state_dict[prefix + "lin.weight"] = state_dict.pop(prefix + "legacy_weight")

    def forward(self, x):
        return self.lin(x)


model, other = Renamed(), Renamed()
program = predispatch.export(model, (x,)).module()
print("model keys:  ", sorted(model.state_dict()))
print("program keys:", sorted(program.state_dict()))
assert sorted(program.state_dict()) == sorted(model.state_dict())

program.load_state_dict(other.state_dict())  # a checkpoint with the legacy key
check("program now computes like `other`", torch.equal(program(x), other(x)))"""),
    md("""\
## `ep.verify_hooks` after a hook change

A program computes what the module computed **at export**, hooks included. If hooks are added
or removed later, the module and its program differ; `ep.verify_hooks(module)` raises
`HooksChangedError` listing the changes (and passes silently when nothing changed)."""),
    code("""\
ep.verify_hooks(net)
print("hooks unchanged: verify_hooks passed")

hook_handle.remove()                               # remove the forward hook on lin
net.out.register_forward_pre_hook(double_input)    # and add a pre-hook on out
try:
    ep.verify_hooks(net)
except predispatch.errors.HooksChangedError as error:
    print(f"\\n{type(error).__name__}: {error}")
else:
    raise AssertionError("verify_hooks should have raised")"""),
    code("""\
ep = predispatch.export(net, (x,))  # export again: the program follows the current hooks
ep.verify_hooks(net)
check("re-exported; program output equals eager", torch.equal(ep.module()(x), net(x)))"""),
    md("""\
Next: [06_save_load_cli.ipynb](06_save_load_cli.ipynb)."""),
]


# ---------------------------------------------------------------------------------------------
# 06: save, load, to_torch, the CLI, pictures

NB06 = [
    md("""\
# 6. Saving and loading, torch interop, the command line, and pictures

- `predispatch.save(ep, path)` / `predispatch.load(path)`: one zip file, no pickle, checksummed;
  the loaded program runs **bitwise** like the saved one ([docs/format.md](../docs/format.md)).
- `ep.to_torch()`: a genuine `torch.export.ExportedProgram`, for torch's own tools.
- `predispatch export | show | draw | audit`: the same from a shell ([docs/cli.md](../docs/cli.md)).
- `predispatch.render`: a picture of the program, as a self-contained HTML page or an SVG.

We use the attention block of `examples/quickstart.py`."""),
    code(SETUP + """

import tempfile

sys.path.insert(0, str(EXAMPLES))
from quickstart import Block

workdir = Path(tempfile.mkdtemp(prefix="predispatch-notebook-"))
model = Block()
x, mask = torch.randn(2, 5, 16), torch.ones(5, 5, dtype=torch.bool).tril()
ep = predispatch.export(model, (x,), {"mask": mask})
print(ep.signature)"""),
    md("""\
## Save and load

The loaded program prints the same, and its `module()` gives bitwise the same outputs,
gradients and buffer updates. Saving is deterministic: the same program always gives the same
bytes."""),
    code("""\
path = workdir / "block.pd"
predispatch.save(ep, path)
loaded = predispatch.load(path)
print(f"{path.name}: {path.stat().st_size} bytes")
check("prints the same", str(loaded) == str(ep))
again = workdir / "again.pd"
predispatch.save(loaded, again)
check("saved again, same bytes", again.read_bytes() == path.read_bytes())

original, restored = ep.module(), loaded.module()
out_o, out_r = original(x, mask=mask), restored(x, mask=mask)
out_o.square().sum().backward()
out_r.square().sum().backward()
grads_r = dict(restored.named_parameters())
check("outputs bitwise equal", torch.equal(out_o, out_r))
check("gradients bitwise equal", all(torch.equal(p.grad, grads_r[n].grad) for n, p in original.named_parameters()))
check("buffers equal", all(torch.equal(b, dict(restored.named_buffers())[n]) for n, b in original.named_buffers()))"""),
    md("""\
The file is a plain zip: a manifest with a SHA-256 per member, the program as JSON, and the
tensors as safetensors. Loading runs no code from the file: ops are looked up by name in
torch's registry, only in allowed namespaces."""),
    code("""\
import json
import zipfile

with zipfile.ZipFile(path) as archive:
    for info in archive.infolist():
        print(f"{info.file_size:8}  {info.filename}")
    manifest = json.loads(archive.read("manifest.json"))
print({k: manifest[k] for k in ("format", "version", "writer")})

corrupt = workdir / "corrupt.pd"
data = bytearray(path.read_bytes())
data[len(data) // 2] ^= 0xFF
corrupt.write_bytes(bytes(data))
try:
    predispatch.load(corrupt)
except predispatch.errors.SerializationError as error:
    print(f"\\n{type(error).__name__}: {error}")
else:
    raise AssertionError("load should have refused the corrupted file")"""),
    md("""\
## `ep.to_torch()`

A `torch.export.ExportedProgram` in torch's TRAINING dialect, which passes torch's verifier and
works with `torch.export.save`/`load`, `run_decompositions()` and `module()`. Its state is a
copy. Custom Functions convert with their backwards (notebook 4). A program torch's
`ExportedProgram` cannot hold (an in-place shape change of an input, `x.t_()`; a forward that
leaves grad mode changed for its caller) is refused with `NotRepresentableError` instead of
being converted wrongly."""),
    code("""\
torch_ep = ep.to_torch()
print(type(torch_ep).__module__ + "." + type(torch_ep).__name__)
print("user inputs:", torch_ep.graph_signature.user_inputs)
print("buffers mutated:", dict(torch_ep.graph_signature.buffers_to_mutate))
check("output equals predispatch's", torch.equal(torch_ep.module()(x, mask=mask), ep.module()(x, mask=mask)))

core = torch_ep.run_decompositions()  # torch's path to core ATen, for inference backends
print("core ATen ops:", len({n.target for n in core.graph.nodes if n.op == "call_function"}))"""),
    md("""\
## The command line

The CLI is a thin layer over the library. In a shell you would type
`predispatch export examples/quickstart.py:Block --inputs "f32[2,5,16]" --kwargs "mask=b8[5,5]"`;
here we call `python -m predispatch` (the same program) with the notebook's interpreter, so it
works in any environment. Input specs give dtypes and shapes: export traces with fake tensors,
so values do not matter."""),
    code("""\
import subprocess


def cli(*args, echo=True):
    \"\"\"Run `predispatch ARGS...`; show what it printed (stdout, then stderr) and its exit code.\"\"\"
    done = subprocess.run([sys.executable, "-m", "predispatch", *map(str, args)], capture_output=True, text=True)
    if echo:
        print(done.stdout + done.stderr, end="")
    print(f"[exit code {done.returncode}]")
    assert done.returncode == 0
    return done


saved = workdir / "cli_block.pd"
exported = cli("export", EXAMPLES / "quickstart.py:Block", "--inputs", "f32[2,5,16]", "--kwargs", "mask=b8[5,5]", "--save", saved)"""),
    md("""\
The program goes to stdout and status lines (`saved the program to ...`) to stderr, so
`predispatch export ... > program.txt` captures just the program. `predispatch show FILE`
prints a saved program exactly as export printed it:"""),
    code("""\
shown = cli("show", saved, echo=False)
print("\\n".join(shown.stdout.splitlines()[:3]), "\\n    ...")
check("same as what export printed", shown.stdout == exported.stdout)
check("same as print(predispatch.load(...))", shown.stdout.strip() == str(predispatch.load(saved)).strip())"""),
    md("""\
`predispatch audit` summarises the composite audit (notebook 2); `--show 5` lists the first
five ops decomposed on evidence:"""),
    code("""cli("audit", "--show", "5");"""),
    md("""\
Failures are one message on stderr, with an exit code that says what kind of failure it was
(1: predispatch refused the model, 2: a usage error such as a bad input spec, 3: the model
could not be created, ...); `predispatch export --help` lists them with examples."""),
    md("""\
## Pictures

`predispatch.render.picture(ep)` describes the program as data (nodes, edges, nested clusters
for regions and Functions); `to_html` renders a self-contained page (nothing to install: the
program in order, hover to highlight producers and users), `to_dot` the Graphviz source, and
`to_svg` a laid-out picture when Graphviz's `dot` program is installed. Parameters are green,
buffers orange, user inputs blue, composites kept whole yellow, mutation outputs red with a
dashed edge back to the buffer they write. (`predispatch draw ... -o block.svg` does the same
from a shell.)"""),
    code("""\
import shutil

from IPython.display import SVG, display

from predispatch.render import picture, to_dot, to_html, to_svg

pic = picture(ep, title="quickstart Block")
print(f"{len(pic.nodes)} nodes, {len(pic.edges)} edges, {len(pic.clusters)} clusters")

html_path = workdir / "block.html"
html_path.write_text(to_html(pic))
print(f"wrote {html_path} ({html_path.stat().st_size} bytes); open it in a browser")

if shutil.which("dot"):
    svg = to_svg(to_dot(pic))
    (workdir / "block.svg").write_text(svg)
    display(SVG(svg))
else:
    print("Graphviz's `dot` is not installed (apt-get/brew/conda install graphviz): skipping the SVG")"""),
    md("""\
Regions make the picture more interesting: here a `no_grad` region and an autocast region are
nested boxes, and `keep_history` (pink) re-attaches the history of the tensor updated in
place."""),
    code("""\
class Regions(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps += 1
        h = self.lin(x)
        with torch.no_grad():
            h.mul_(2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = h @ h.t()
        return y.float()


small = picture(predispatch.export(Regions(), (torch.randn(2, 4),)), title="Regions")
for cluster in small.clusters:  # the boxes, as data
    members = [n.name for n in small.nodes if n.cluster == cluster.id]
    print(f"{cluster.label} ({cluster.detail}): {members}")
if shutil.which("dot"):
    display(SVG(to_svg(to_dot(small))))
else:
    print("Graphviz's `dot` is not installed (apt-get/brew/conda install graphviz): skipping the SVG")"""),
    code("""\
shutil.rmtree(workdir)  # the files above were written to a temporary directory"""),
]


NOTEBOOKS = {
    "01_export_and_read.ipynb": NB01,
    "02_composite_audit.ipynb": NB02,
    "03_regions_and_mutations.ipynb": NB03,
    "04_autograd_functions.ipynb": NB04,
    "05_hooks.ipynb": NB05,
    "06_save_load_cli.ipynb": NB06,
}


def build(cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    """A notebook without outputs, with fixed cell ids so regenerating it changes nothing."""
    nb = new_notebook()
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    for i, (kind, source) in enumerate(cells):
        cell = new_markdown_cell(source) if kind == "markdown" else new_code_cell(source)
        cell.id = f"cell-{i:02d}"
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def render(cells: list[tuple[str, str]]) -> str:
    """The notebook's text without outputs (what `sources` of the executed one must equal)."""
    return nbformat.writes(build(cells)) + "\n"


def sources(nb: nbformat.NotebookNode) -> list[tuple[str, str, str]]:
    """Each cell's id, kind and source: what this file decides, outputs aside."""
    return [(cell.id, cell.cell_type, cell.source) for cell in nb.cells]


def execute(nb: nbformat.NotebookNode, kernel_dir: Path) -> nbformat.NotebookNode:
    """Run every cell of `nb` in a fresh kernel on this interpreter, in examples/; raises on an error."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient

    specs = KernelSpecManager(kernel_dirs=[str(kernel_dir)], ensure_native_kernel=False)
    manager = AsyncKernelManager(kernel_name="python3", kernel_spec_manager=specs)
    NotebookClient(nb, km=manager, timeout=180, resources={"metadata": {"path": str(HERE)}}).execute()
    return nb


def write_kernelspec(root: Path) -> Path:
    """A kernelspec directory whose only kernel, `python3`, is this interpreter."""
    spec = root / "python3"
    spec.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "Python 3", "language": "python"}))
    return root


def comparable(text: str) -> str:
    """Output text with what changes from run to run masked: numbers, addresses, temporary paths,
    and whether this machine has Graphviz (the SVG, or the line saying it is skipped)."""
    text = re.sub(r"Graphviz's `dot` is not installed[^\n]*: skipping the SVG\n?|<IPython.core.display.SVG object>", "<svg>", text)
    text = re.sub(r"/tmp/\S*|/var/folders/\S*", "<tmp>", text)
    text = re.sub(r"0x[0-9a-f]+", "<addr>", text)
    return re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", text)


def printed(nb: nbformat.NotebookNode) -> list[str]:
    """Per code cell, the text it printed (stdout and stderr streams, and text results)."""
    texts = []
    for cell in nb.cells:
        if cell.cell_type == "code":
            parts = [o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in cell.outputs]
            texts.append("".join(parts))
    return texts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if a stored notebook differs from this file")
    ns = parser.parse_args()
    stale = []
    kernel_dir = write_kernelspec(Path(tempfile.mkdtemp(prefix="predispatch-kernels-")))
    for name, cells in NOTEBOOKS.items():
        path = HERE / name
        if ns.check:
            if not path.exists() or sources(nbformat.read(path, as_version=4)) != sources(build(cells)):
                stale.append(name)
        else:
            nb = execute(build(cells), kernel_dir)
            for cell in nb.cells:  # nbclient's timestamps would make every run a diff
                cell.metadata.pop("execution", None)
            path.write_text(nbformat.writes(nb) + "\n")
            print(f"wrote {path.name}, executed")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python examples/make_notebooks.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
