"""`predispatch COMMAND ...`: parse the command line, call the library, print the result.

Every command is a short function over library calls: `predispatch.export`, `predispatch.save`
and `load_for_display`, `predispatch.render`, `predispatch.audit`.  Failures become one message
and an exit code (see `failures.ExitCode`); `--traceback` shows where they came from.  Text a
file may hold reaches the terminal only through `terminal.visible` (`_out`, `_err`).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
import os
import shutil
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import predispatch
from predispatch.cli.failures import EXIT_CODES_HELP, CommandError, ExitCode, MissingError, UsageError
from predispatch.cli.terminal import visible
from predispatch.errors import PredispatchError

if TYPE_CHECKING:  # torch and what needs it are imported by the commands, not by `--help`
    from predispatch.cli.specs import ParsedInputs
    from predispatch.cli.targets import Target
    from predispatch.program.displayed import DisplayedProgram
    from predispatch.signature import Program

_DRAW_FORMATS = {".svg": "svg", ".html": "html", ".htm": "html", ".dot": "dot", ".gv": "dot"}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit code (the console script exits with it)."""
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as exc:  # argparse printed --help (0) or a usage error (2)
        return int(exc.code or 0)
    if ns.command is None:
        parser.print_help(sys.stderr)
        return ExitCode.USAGE
    try:
        with _quiet_torch_logs(unless=ns.traceback):
            code = ns.run(ns)
            sys.stdout.flush()  # here, so that a closed pipe is seen here and not at exit
            return code
    except BrokenPipeError:
        return _closed_pipe()
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - every failure becomes a message and an exit code
        return _report(exc, ns)


def _closed_pipe() -> int:
    """The reader of our output went away (`predispatch show f | head -3`): a normal end.

    Python's advice (docs of `signal`, "Note on SIGPIPE"): point stdout at devnull so that the
    interpreter's final flush does not fail again, and stop quietly.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return ExitCode.OK


# ---- commands


def export_command(ns: argparse.Namespace) -> int:
    save = _library("save") if ns.save else None  # before exporting, which may take a while
    ep = _export(ns)
    if not ns.quiet:
        _out(str(ep))
    if save is not None:
        with _writing(ns.save):
            save(ep, ns.save)
        _status(f"saved the program to {ns.save}")
    return ExitCode.OK


def show_command(ns: argparse.Namespace) -> int:
    _out(str(_load(ns.file, ns.imports)))
    return ExitCode.OK


def draw_command(ns: argparse.Namespace) -> int:
    from predispatch.render import ClusterKind, GraphvizNotFoundError, picture, to_dot, to_html, to_svg

    fmt = _draw_format(ns.output, ns.format)
    if fmt == "svg" and shutil.which("dot") is None:
        raise GraphvizNotFoundError()  # before exporting, which may take a while
    if os.path.isfile(ns.source):
        if ns.inputs is not None or ns.kwargs is not None or ns.dim or ns.mode:
            raise UsageError(f"{ns.source!r} is a saved program; --inputs, --kwargs, --dim, --train and --eval "
                             "apply to MODULE:ATTR only")
        ep: Program = _load(ns.source, ns.imports)
    else:
        ep = _export(ns)
    pic = picture(ep, title=ns.title or ns.source)
    render: dict[str, Callable[[Any], str]] = {"svg": lambda p: to_svg(to_dot(p)), "html": to_html, "dot": to_dot}
    text = visible(render[fmt](pic))  # a picture is text too: `cat model.dot` must not run the file's escapes
    with _writing(ns.output), open(ns.output, "w", encoding="utf-8") as f:
        f.write(text)
    regions = sum(c.kind is not ClusterKind.SUBGRAPH for c in pic.clusters)
    _status(f"wrote {ns.output} ({fmt}): {len(pic.nodes)} nodes, {regions} regions")
    return ExitCode.OK


def audit_command(ns: argparse.Namespace) -> int:
    try:
        from predispatch.audit import load_table
        from predispatch.audit.render import render_markdown, render_summary
    except ImportError as exc:
        raise MissingError(f"the composite audit is not available in this install: {exc}",
                           fix="update predispatch; the audit lives in predispatch/audit/") from exc
    try:
        table = load_table()
    except FileNotFoundError as exc:
        raise MissingError(f"no audit table is shipped with this install ({exc.filename} is missing)",
                           fix="generate it with `python -m predispatch.audit --write`") from exc
    _out(render_markdown(table) if ns.markdown else render_summary(table, show=ns.show))
    return ExitCode.OK


# ---- steps shared by the commands


def _export(ns: argparse.Namespace) -> predispatch.ExportedProgram:
    from predispatch.cli.specs import make_example
    from predispatch.cli.targets import load_model

    if ns.inputs is None:
        raise UsageError(f"{ns.source!r}: --inputs is required to export MODULE:ATTR",
                         fix='give example inputs as shapes and dtypes, e.g. --inputs "f32[2,16]"')
    target = _target(ns.source)
    parsed = _parse_specs(ns.inputs, ns.kwargs)
    dims = _dims(parsed, ns.dim or [])
    preserve, decompose = _op_names(ns.preserve), _op_names(ns.decompose)
    model = load_model(target)
    _set_mode(model, ns.mode, target)
    shapes = _dynamic_shapes(model, parsed, dims, target) if dims else None
    args, kwargs = make_example((parsed.args, parsed.kwargs))
    return predispatch.export(model, args, kwargs, preserve=preserve, decompose=decompose, dynamic_shapes=shapes)


def _target(text: str) -> Target:
    from predispatch.cli.targets import parse_target

    if ":" not in text and not os.path.exists(text):
        raise UsageError(f"{text!r} is neither MODULE:ATTR nor an existing file",
                         fix="name a model as mypkg.models:Net or path/to/model.py:Net, or a saved program file")
    return parse_target(text)


def _parse_specs(inputs: str, kwargs: str | None) -> ParsedInputs:
    from predispatch.cli.specs import ParsedInputs, SpecError, parse_inputs

    try:
        parsed = parse_inputs(inputs)
        extra = parse_inputs(kwargs, keywords_only=True) if kwargs is not None else ParsedInputs()
    except SpecError as exc:
        option = "--kwargs" if kwargs is not None and exc.text == kwargs else "--inputs"
        raise UsageError(f"{option}: {exc}") from exc
    both = sorted(set(parsed.kwargs) & set(extra.kwargs))
    if both:
        raise UsageError(f"keyword input {both[0]!r} is given in both --inputs and --kwargs")
    return ParsedInputs(parsed.args, {**parsed.kwargs, **extra.kwargs})


def _dims(parsed: ParsedInputs, ranges: list[str]) -> dict[str, Any]:
    """One `torch.export.Dim` per dynamic dimension name in the specs, with its --dim range."""
    import torch
    import torch.utils._pytree as pytree

    from predispatch.cli.specs import SpecError, TensorSpec, parse_dim_range

    sizes: dict[str, int] = {}
    for spec in (leaf for leaf in pytree.tree_leaves((parsed.args, parsed.kwargs)) if isinstance(leaf, TensorSpec)):
        for name, size in zip(spec.dims, spec.shape):
            if name and sizes.setdefault(name, size) != size:
                raise UsageError(f"dynamic dimension {name!r} has example size {sizes[name]} in one input and {size} "
                                 "in another", fix="give a dimension one example size everywhere it appears")
    bounds = {}
    for text in ranges:
        try:
            name, low, high = parse_dim_range(text)
        except SpecError as exc:
            raise UsageError(f"--dim: {exc}") from exc
        if name not in sizes:
            used = ", ".join(sizes) or "none (name one as f32[batch=4,16])"
            raise UsageError(f"--dim {name!r}: no input has a dimension named {name!r}",
                             fix=f"dynamic dimensions in the inputs: {used}")
        bounds[name] = {"min": low, "max": high}
    return {name: torch.export.Dim(name, **bounds.get(name, {})) for name in sizes}


def _dynamic_shapes(model: Any, parsed: ParsedInputs, dims: dict[str, Any], target: Target) -> dict[str, Any]:
    """torch.export's `dynamic_shapes`, by parameter name of the model's forward (or the function)."""
    from torch import nn

    from predispatch.cli.specs import dynamic_shapes

    fn = model.forward if isinstance(model, nn.Module) else model
    try:
        bound = inspect.signature(fn).bind(*parsed.args, **parsed.kwargs)
    except TypeError as exc:
        raise UsageError(f"the inputs do not fit {target}'s signature {inspect.signature(fn)}: {exc}") from exc
    return {name: dynamic_shapes(value, dims) for name, value in bound.arguments.items()}


def _set_mode(model: Any, mode: str | None, target: Target) -> None:
    from torch import nn

    if mode is None:
        return
    if not isinstance(model, nn.Module):
        raise UsageError(f"--{mode} applies to nn.Module models; {target} is a function")
    model.train(mode == "train")


def _op_names(values: list[str] | None) -> list[str]:
    """Op names from repeated, comma-separated options, each checked to exist."""
    names = [n.strip() for v in values or [] for n in v.split(",") if n.strip()]
    for name in names:
        _check_op(name)
    return names


def _check_op(name: str) -> None:
    import torch

    parts = name.replace("::", ".").split(".")
    form = "write namespace.op or namespace.op.overload, e.g. aten.linear or aten.linear.default"
    if len(parts) not in (2, 3):
        raise UsageError(f"{name!r} is not an op name", fix=form)
    try:
        packet = getattr(getattr(torch.ops, parts[0]), parts[1])
    except (AttributeError, RuntimeError):
        raise UsageError(f"there is no op {name!r} in torch {torch.__version__}", fix=form) from None
    if len(parts) == 3 and parts[2] not in packet.overloads():
        raise UsageError(f"op {'.'.join(parts[:2])!r} has no overload {parts[2]!r}",
                         fix=f"its overloads: {', '.join(sorted(packet.overloads()))}")


def _load(path: str, imports: list[str] | None = None) -> DisplayedProgram:
    """The program in `path`, read for display only: its classes are kept by name, none is
    imported or built (`load_for_display`), so no `--import` is needed to show it."""
    from predispatch._files import load_for_display

    if not os.path.isfile(path):
        raise UsageError(f"no such file: {path!r}", fix="give the path of a program saved with `predispatch export --save`")
    _import_modules(imports or [])
    return load_for_display(path)


def _import_modules(names: list[str]) -> None:
    """Import what `--import` names, as the user asked: with the search path an installed
    command has (predispatch/_paths.py), never the current folder first, so a downloaded
    model's folder cannot put its own `json.py` in the place of the module named."""
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any failure to import is the user's to fix
            raise UsageError(f"--import {name}: {type(exc).__name__}: {exc}",
                             fix="name a module installed for this Python (PYTHONPATH=DIR adds DIR to the search)") from exc


def _library(name: str) -> Callable[..., Any]:
    """`predispatch.save` or `predispatch.load`, or a clear message when this build lacks it."""
    fn = getattr(predispatch, name, None)
    if fn is None:
        raise MissingError(f"this version of predispatch has no predispatch.{name}(), so programs cannot be "
                           f"{'saved' if name == 'save' else 'loaded'} yet",
                           fix="update predispatch; meanwhile print the program (omit --save) or draw it from MODULE:ATTR")
    return fn


def _draw_format(output: str, fmt: str | None) -> str:
    if fmt:
        return fmt
    ext = os.path.splitext(output)[1].lower()
    if ext not in _DRAW_FORMATS:
        raise UsageError(f"cannot tell the picture format from {output!r}",
                         fix=f"end -o with one of {', '.join(_DRAW_FORMATS)}, or pass --format svg|html|dot")
    return _DRAW_FORMATS[ext]


#: torch loggers that print a traceback at ERROR level for failures export then reports itself.
_NOISY_TORCH_LOGGERS = ("torch._subclasses.fake_tensor",)


@contextlib.contextmanager
def _quiet_torch_logs(unless: bool) -> Iterator[None]:
    """Keep torch's own error logging out of the one-message error report (not with --traceback)."""
    loggers = [logging.getLogger(name) for name in _NOISY_TORCH_LOGGERS]
    levels = [logger.level for logger in loggers]
    if not unless:
        for logger in loggers:
            logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def _writing(path: str) -> Iterator[None]:
    """A file the user named cannot be written: a usage error that names it."""
    try:
        yield
    except OSError as exc:
        raise UsageError(f"cannot write {path!r}: {exc.strerror or exc}",
                         fix="give a path in an existing directory that you can write to") from exc


def _out(text: str) -> None:
    """Print `text` to stdout, its control characters made visible (terminal.py)."""
    print(visible(text))


def _err(text: str) -> None:
    """Print `text` to stderr, its control characters made visible (terminal.py)."""
    print(visible(text), file=sys.stderr)


def _status(message: str) -> None:
    _err(message)


def _report(exc: Exception, ns: argparse.Namespace) -> int:
    """Print `exc` as a message (the traceback too with --traceback); return its exit code."""
    from predispatch.render import GraphvizNotFoundError

    if ns.traceback:
        _err("".join(traceback.format_exception(exc)).rstrip("\n"))
    prog = f"predispatch {ns.command}"
    if isinstance(exc, PredispatchError):
        code, message = ExitCode.REFUSED, str(exc)
    elif isinstance(exc, CommandError):
        code, message = exc.code, str(exc)
    elif isinstance(exc, GraphvizNotFoundError):
        code, message = ExitCode.MISSING, str(exc)
    else:
        code = ExitCode.INTERNAL
        message = (f"internal error: {type(exc).__name__}: {exc}\n"
                   "  this is a bug in predispatch: please report it with the command line that caused it")
    if code in (ExitCode.REFUSED, ExitCode.MODEL, ExitCode.INTERNAL) and not ns.traceback:
        message += "\n  (rerun with --traceback to see the traceback)"
    _err(f"{prog}: error: {message}")  # messages quote file text
    return code


# ---- the parser


_SPEC_HELP = """\
input specs:
  A comma-separated list of inputs, like the arguments of a call:
    f32[2,5,16]            a float32 tensor of shape (2, 5, 16); f32[] is 0-dim
    mask=b8[5,5]           a keyword input
    3, 0.5, True, None, 'mean'    constants (baked into the program)
    (f32[2], f32[3])  [i64[4]]  {ids: i64[2,5], mask: b8[2,5]}    tuple, list, dict
    f32[batch=4,16]        a dynamic dimension named batch, example size 4 (the same name in
                           several inputs is the same size); --dim batch=1..64 sets its range
  dtypes: f16 bf16 f32 f64 c64 c128 i8 i16 i32 i64 u8 b8, or torch names
  (float32, bfloat16, int64, long, bool, ...).  Values do not matter, export traces shapes
  and dtypes: floats are random normal (seed 0), integers 0, bools True.

MODULE:ATTR:
  MODULE is an importable module (mypkg.models; the current directory is searched first) or a
  path to a .py file (path/to/model.py).  ATTR is an nn.Module instance, an nn.Module class
  (constructed with no arguments), a factory function taking no arguments, or a function to
  export itself (one with required parameters)."""


def _torch_version() -> str:
    """torch's version from its installed metadata: `--version` and `--help` do not import torch."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        import torch

        return torch.__version__


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS,
                        help="on failure, print the traceback as well as the message")
    parser = argparse.ArgumentParser(
        prog="predispatch",
        description="Export PyTorch programs to a functional pre-dispatch ATen graph, and look at them.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version",
                        version=f"predispatch {predispatch.__version__} (torch {_torch_version()})")
    parser.add_argument("--traceback", action="store_true", help="on failure, print the traceback as well as the message")
    commands = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    _add_export(commands, common)
    _add_show(commands, common)
    _add_draw(commands, common)
    _add_audit(commands, common)
    return parser


def _subparser(commands: Any, common: argparse.ArgumentParser, name: str, help: str, description: str, epilog: str, run: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    p = commands.add_parser(name, help=help, description=description, epilog=f"{epilog}\n\n{EXIT_CODES_HELP}".strip(),
                            parents=[common], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(run=run)
    return p


def _add_model_options(p: argparse.ArgumentParser, source: str, source_help: str, inputs_required: bool) -> None:
    p.add_argument("source", metavar=source, help=source_help)
    p.add_argument("--inputs", metavar="SPEC", required=inputs_required,
                   help='positional (and name=... keyword) example inputs, e.g. "f32[2,5,16], i64[2,5]"')
    p.add_argument("--kwargs", metavar="SPEC", help='keyword example inputs, e.g. "mask=b8[5,5]"')
    p.add_argument("--dim", action="append", metavar="NAME=MIN..MAX",
                   help="the range of a dynamic dimension named in the specs (f32[batch=4,16]); repeatable")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--train", dest="mode", action="store_const", const="train",
                      help="put the model in training mode first (default: leave it as created, which is training mode for a new module)")
    mode.add_argument("--eval", dest="mode", action="store_const", const="eval", help="put the model in eval mode first")
    p.add_argument("--preserve", action="append", metavar="OPS", help="composite ops to keep whole, comma-separated (aten.linear,aten.gelu); repeatable")
    p.add_argument("--decompose", action="append", metavar="OPS", help="composite ops to always decompose, comma-separated; repeatable")


def _add_export(commands: Any, common: argparse.ArgumentParser) -> None:
    p = _subparser(
        commands, common, "export", "export a model; print (and save) its program",
        "Export MODULE:ATTR called with example inputs and print the program (graph and signature).",
        "examples:\n"
        '  predispatch export examples/quickstart.py:Block --inputs "f32[2,5,16]" --kwargs "mask=b8[5,5]"\n'
        '  predispatch export mypkg.models:make_model --inputs "i64[2,128]" --eval --save model.pd\n\n' + _SPEC_HELP,
        export_command,
    )
    _add_model_options(p, "MODULE:ATTR", "the model: an importable module and an attribute in it", True)
    p.add_argument("--save", metavar="FILE", help="also save the program to FILE (read it back with `predispatch show FILE`)")
    p.add_argument("-q", "--quiet", action="store_true", help="do not print the program")


def _add_show(commands: Any, common: argparse.ArgumentParser) -> None:
    p = _subparser(commands, common, "show", "print a saved program",
                   "Print a program saved with `predispatch export --save` or predispatch.save().",
                   "example:\n  predispatch show model.pd", show_command)
    p.add_argument("file", metavar="FILE", help="a saved program")
    _add_import_option(p)


def _add_import_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                   help="import MODULE first (repeatable), from the installed packages (PYTHONPATH=DIR adds DIR; never the "
                   "current folder): importing runs that package's code. A saved program needs none: its classes are shown "
                   "by name, never imported or built")


def _add_draw(commands: Any, common: argparse.ArgumentParser) -> None:
    p = _subparser(
        commands, common, "draw", "draw a program as SVG, HTML or DOT",
        "Draw a program: regions (grad mode, autocast) and captured Functions as nested boxes, inputs "
        "coloured by kind (parameter, buffer, constant, user input), composite ops kept whole highlighted, "
        "mutation outputs marked with an edge back to what they write.",
        "formats (from the -o extension, or --format):\n"
        "  .svg   laid out by Graphviz; needs the `dot` program (apt-get install graphviz)\n"
        "  .html  one self-contained page, no network and nothing to install\n"
        "  .dot   Graphviz source\n\n"
        "examples:\n"
        '  predispatch draw examples/quickstart.py:Block --inputs "f32[2,5,16]" -o block.html\n'
        "  predispatch draw model.pd -o model.svg\n\n" + _SPEC_HELP,
        draw_command,
    )
    _add_model_options(p, "MODULE:ATTR|FILE", "the model (MODULE:ATTR, exported first; needs --inputs) or a saved program (FILE)", False)
    p.add_argument("-o", "--output", metavar="OUT", required=True, help="the picture to write: out.svg, out.html or out.dot")
    p.add_argument("--format", choices=("svg", "html", "dot"), help="the picture's format (default: from the -o extension)")
    p.add_argument("--title", help="a title for the picture (default: MODULE:ATTR or FILE)")
    _add_import_option(p)


def _add_audit(commands: Any, common: argparse.ArgumentParser) -> None:
    p = _subparser(commands, common, "audit", "print the composite-op audit table",
                   "Print the shipped composite-op audit: which CompositeImplicitAutograd ops the export "
                   "may keep whole, and the evidence. To regenerate it: python -m predispatch.audit --write.",
                   "examples:\n  predispatch audit\n  predispatch audit --markdown > audit.md", audit_command)
    p.add_argument("--markdown", action="store_true", help="print the whole table as markdown (as docs/audit.md)")
    p.add_argument("--show", type=int, default=20, metavar="N", help="list at most N evidence findings in the summary (0: all; default 20)")
