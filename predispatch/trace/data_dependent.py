"""The fix for the user's own data-dependent Python: which one fits depends on the statement.

Export traces shapes, not values, so `if x.sum() > 0:`, `while x.sum() < 10:` and
`for _ in range(n.item()):` all fail the same way in torch (a guard on a data-dependent
symbol).  Their fixes differ: a branch becomes `torch.where` / `torch.cond` (arms of one
shape only), a `while` loop becomes `while_loop`, and a loop count read from a tensor becomes a
`while_loop` over a counter or a Python int.  The statement is read from the user's source at
the frame that failed (`linecache` + `ast`, as `_return_lines` does for forward's returns); a
line that cannot be read or parsed gets the branch fix, which names all three.
"""

from __future__ import annotations

import ast
import linecache
import traceback
from types import TracebackType

from predispatch.errors import is_user_file

#: The branch fix, for `if`, a conditional expression, and any statement not told apart.
BRANCH_FIX = (
    "compute both arms and pick with torch.where(cond, a, b), or use torch.cond(pred, true_fn, false_fn, "
    "(x,)) with arms that return new tensors (x * 1, not x itself); both need arms of one shape: where "
    "the arms differ in shape (x[:2] vs x) neither fits (torch.where cannot pick between them, and "
    "torch.cond's output size then depends on data, which a saved program cannot hold), so make both "
    "arms the same shape (pad or mask the shorter one) or move the branch out of forward (decide before "
    "calling the program, and export each arm)."
)


def data_dependent_fix(exc: BaseException) -> str:
    """The fix that fits the statement of the user's that read a tensor's value."""
    statement = _user_statement(exc.__traceback__)
    if isinstance(statement, ast.While):
        return _while_fix(statement)
    if isinstance(statement, ast.For) and _range_count(statement) is not None:
        return _loop_count_fix(statement)
    return BRANCH_FIX


def _user_statement(tb: TracebackType | None) -> ast.stmt | None:
    """The innermost statement of the user's source at the innermost user frame, or None."""
    frames = [frame for frame in traceback.extract_tb(tb) if is_user_file(frame.filename)]
    if not frames or frames[-1].lineno is None:
        return None
    filename, line = frames[-1].filename, frames[-1].lineno
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return None
    headers = [node for node in ast.walk(tree) if isinstance(node, (ast.While, ast.For, ast.If))
               and node.lineno <= line <= _header_end(node)]
    if headers:  # the failure is in a loop's or branch's own header (`while x.sum() < 10:`)
        return max(headers, key=lambda node: node.lineno)
    simple = [node for node in ast.walk(tree) if isinstance(node, ast.stmt)
              and not isinstance(node, (ast.While, ast.For, ast.If)) and node.lineno <= line <= (node.end_lineno or node.lineno)]
    return max(simple, key=lambda node: node.lineno) if simple else None


def _header_end(node: ast.While | ast.For | ast.If) -> int:
    """The last line of a compound statement's header (`while` / `for` / `if` up to its colon)."""
    head = node.test if isinstance(node, (ast.While, ast.If)) else node.iter
    return head.end_lineno or node.lineno


def _assigned(body: list[ast.stmt], skip: str = "") -> list[str]:
    """The names the body assigns, in order of first assignment: what a while_loop carries."""
    names: list[str] = []
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id not in names and node.id != skip:
            names.append(node.id)
    return names


def _while_fix(loop: ast.While) -> str:
    """`while cond: body` becomes `while_loop(cond_fn, body_fn, carried)` on the names the body sets."""
    carried = _assigned(loop.body) or ["x"]
    params, values = ", ".join(carried), ", ".join(carried) + ("," if len(carried) == 1 else "")
    return (
        f"write the loop with torch._higher_order_ops.while_loop: while_loop(lambda {params}: "
        f"{ast.unparse(loop.test)}, body_fn, ({values})), where body_fn({params}) returns the loop body's new "
        f"({values}) (tensors of unchanged shapes) and while_loop returns them after the last step; "
        "torch.where and torch.cond do not loop."
    )


def _range_count(loop: ast.For) -> ast.expr | None:
    """The count of `for _ in range(count)` (the stop of `range(start, stop)`), or None."""
    call = loop.iter
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "range" and call.args:
        return call.args[0] if len(call.args) == 1 else call.args[1]
    return None


def _loop_count_fix(loop: ast.For) -> str:
    """A loop count read from a tensor: a while_loop over a counter tensor, or a Python int."""
    count = _range_count(loop)
    assert count is not None
    tensor = count
    if isinstance(count, ast.Call) and isinstance(count.func, ast.Attribute) and count.func.attr in ("item", "int"):
        tensor = count.func.value  # n.item() -> n
    elif isinstance(count, ast.Call) and isinstance(count.func, ast.Name) and count.func.id == "int" and count.args:
        tensor = count.args[0]  # int(n) -> n
    n = ast.unparse(tensor)
    index = loop.target.id if isinstance(loop.target, ast.Name) and loop.target.id != "_" else "i"
    carried = _assigned(loop.body, skip=index) or ["x"]
    params = ", ".join([index, *carried])
    return (
        f"the loop count {ast.unparse(count)} is a tensor's value: loop with torch._higher_order_ops.while_loop "
        f"over a counter, while_loop(lambda {params}: {index} < {n}, lambda {params}: ({index} + 1, <the body's new "
        f"{', '.join(carried)}>), ({n}.new_zeros(()), {', '.join(carried)}))[1:], or pass the count as a Python int "
        "(export then fixes it in the program); torch.where and torch.cond do not loop."
    )
