"""The command line: the input spec language, MODULE:ATTR, each command, exit codes and messages.

Commands run in-process through `main(argv)` (the models below are found as `test_cli:NAME`);
a few run as real subprocesses to check the console script, `python -m predispatch` and what
reaches stderr.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from expecttest import TestCase
from helpers import subprocess_env
from torch import nn

import predispatch
from predispatch.cli import ExitCode, main
from predispatch.cli.failures import EXIT_CODES_HELP, ModelError, UsageError
from predispatch.cli.specs import (
    ParsedInputs,
    SpecError,
    TensorSpec,
    describe,
    make_example,
    parse_dim_range,
    parse_inputs,
)
from predispatch.cli.targets import Target, load_model, parse_target

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "examples" / "quickstart.py")


# ---- models the commands load as test_cli:NAME


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, scale=1.0):
        return self.lin(x) * scale


class Norm(nn.Module):
    """BatchNorm: training mode updates running stats (mutation outputs), eval mode does not."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(x)


class NeedsArgs(nn.Module):
    def __init__(self, dim):
        super().__init__()


class Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent: export refuses with DataDependentError
            return x
        return -x


tiny = Tiny()


def make_tiny():
    return Tiny()


def double(x):
    return x * 2


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---- the spec language


@pytest.mark.parametrize(
    "text, args, kwargs",
    [
        ("f32[2,5,16], i64[2,5]", (TensorSpec(torch.float32, (2, 5, 16)), TensorSpec(torch.int64, (2, 5))), {}),
        ("f32[2,5,16], mask=b8[5,5]", (TensorSpec(torch.float32, (2, 5, 16)),), {"mask": TensorSpec(torch.bool, (5, 5))}),
        ("f32[], bf16[1], float64[2], long[3]", (TensorSpec(torch.float32, ()), TensorSpec(torch.bfloat16, (1,)),
                                                 TensorSpec(torch.float64, (2,)), TensorSpec(torch.int64, (3,))), {}),
        ("3, -0.5, 1e3, None, True, false, 'mean'", (3, -0.5, 1000.0, None, True, False, "mean"), {}),
        ("(f32[2],), [i32[1], 2], {ids: i64[4], 'm': b8[]}",
         ((TensorSpec(torch.float32, (2,)),), [TensorSpec(torch.int32, (1,)), 2],
          {"ids": TensorSpec(torch.int64, (4,)), "m": TensorSpec(torch.bool, ())}), {}),
        ("", (), {}),
        ("f32[1],", (TensorSpec(torch.float32, (1,)),), {}),
    ],
)
def test_spec_parses(text, args, kwargs):
    assert parse_inputs(text) == ParsedInputs(args, kwargs)


def test_spec_round_trips_through_describe():
    text = "f32[2,5,16], (i64[2], 3), mask=b8[5,5], mode='sum'"
    assert describe(parse_inputs(text)) == text


def test_named_dimensions_are_dynamic():
    parsed = parse_inputs("f32[batch=4,16], ids=i64[batch=4]")
    assert parsed.args == (TensorSpec(torch.float32, (4, 16), ("batch", None)),)
    assert parsed.kwargs == {"ids": TensorSpec(torch.int64, (4,), ("batch",))}
    assert describe(parsed) == "f32[batch=4,16], ids=i64[batch=4]"
    assert parse_dim_range("batch=2..64") == ("batch", 2, 64)
    assert parse_dim_range(" batch = ..64") == ("batch", None, 64)
    assert parse_dim_range("batch=2..") == ("batch", 2, None)
    with pytest.raises(SpecError, match="a dimension range is NAME=MIN..MAX"):
        parse_dim_range("batch=2-64")


def test_example_tensors_have_the_spec_dtypes_and_shapes():
    args, kwargs = make_example((parse_inputs("f32[2,3], i64[4], b8[2]").args, {"s": TensorSpec(torch.float16, ())}))
    assert [(t.dtype, tuple(t.shape)) for t in args] == [(torch.float32, (2, 3)), (torch.int64, (4,)), (torch.bool, (2,))]
    assert args[1].eq(0).all() and args[2].all() and kwargs["s"].dtype is torch.float16
    again = make_example(parse_inputs("f32[2,3]").args)
    assert torch.equal(again[0], args[0])  # seeded: the same command makes the same inputs


class SpecErrors(TestCase):
    maxDiff = None

    def error(self, text: str, **options) -> str:
        with self.assertRaises(SpecError) as info:
            parse_inputs(text, **options)
        return str(info.exception)

    def test_unknown_dtype_lists_the_allowed_ones(self):
        self.assertExpectedInline(self.error("f32[2,5,16], f33[2,5]"), """\
unknown dtype 'f33'
    f32[2,5,16], f33[2,5]
                 ^
  allowed dtypes: f16 (float16), bf16 (bfloat16), f32 (float32), f64 (float64), c64, c128, i8, i16, i32, i64 (int64), u8, b8 (bool)""")

    def test_bad_dimension(self):
        self.assertExpectedInline(self.error("f32[2,-1]"), """\
a dimension must be a non-negative integer, found '-1'
    f32[2,-1]
          ^
  example: f32[2,5,16], or f32[batch=2,5,16] for a dynamic dimension""")

    def test_positional_after_keyword(self):
        self.assertExpectedInline(self.error("mask=b8[5,5], f32[2]"), """\
a positional input follows a keyword input
    mask=b8[5,5], f32[2]
                  ^
  write positional inputs first, as in a Python call""")

    def test_missing_comma_and_missing_shape(self):
        self.assertIn("expected ',' between inputs, found 'i64'", self.error("f32[2] i64[3]"))
        self.assertIn("dtype 'f32' needs a shape in brackets", self.error("f32"))
        self.assertIn("unknown input 'x'", self.error("x"))
        self.assertIn("expected ')', found the end of the spec", self.error("(f32[2]"))

    def test_kwargs_takes_keywords_only(self):
        self.assertIn("--kwargs takes keyword inputs only", self.error("f32[2]", keywords_only=True))


# ---- MODULE:ATTR


def test_targets_resolve_instances_classes_factories_and_functions():
    assert load_model(parse_target("test_cli:tiny")) is tiny
    assert type(load_model(parse_target("test_cli:Tiny"))) is Tiny
    assert type(load_model(parse_target("test_cli:make_tiny"))) is Tiny
    assert load_model(parse_target("test_cli:double")) is double  # has parameters: exported itself
    assert type(load_model(parse_target(f"{QUICKSTART}:Block"))).__name__ == "Block"
    assert parse_target("a.b:c.d") == Target("a.b", "c.d")


def test_target_errors_say_what_and_how_to_fix():
    with pytest.raises(UsageError, match="is not of the form MODULE:ATTR"):
        parse_target("test_cli")
    with pytest.raises(UsageError, match="no module named 'no_such_module'") as info:
        load_model(parse_target("no_such_module:Net"))
    assert "path/to/model.py:ATTR" in str(info.value)
    with pytest.raises(UsageError, match="has no attribute 'Tinny'") as info:
        load_model(parse_target("test_cli:Tinny"))
    assert "Tiny" in str(info.value) and "make_tiny" in str(info.value)
    with pytest.raises(ModelError, match=r"constructing test_cli:NeedsArgs\(\) raised TypeError") as info:
        load_model(parse_target("test_cli:NeedsArgs"))
    assert "give every constructor argument a default" in str(info.value)
    with pytest.raises(UsageError, match="not an nn.Module subclass"):
        load_model(parse_target("test_cli:TensorSpec"))


def test_a_module_that_fails_to_import_is_a_model_error(tmp_path, capsys):
    broken = tmp_path / "broken_model.py"
    broken.write_text("import torch\nraise RuntimeError('no weights here')\n")
    code, out, err = run(capsys, "export", f"{broken}:Net", "--inputs", "f32[2]")
    assert code == ExitCode.MODEL == 3
    assert "importing" in err and "raised RuntimeError: no weights here" in err
    assert f"{broken}:2" in err  # where: the user's file and line
    assert "Traceback" not in err


# ---- export


def test_export_prints_the_program(capsys):
    code, out, err = run(capsys, "export", "test_cli:Tiny", "--inputs", "f32[2,4]", "--kwargs", "scale=2.0")
    assert code == ExitCode.OK
    assert out.startswith("ExportedProgram:") and "torch.ops.aten.linear.default" in out
    assert "Constant inputs:\n        scale = 2.0" in out


def test_export_matches_the_library(capsys):
    code, out, _ = run(capsys, "export", f"{QUICKSTART}:Block", "--inputs", "f32[2,5,16], mask=b8[5,5]")
    torch.manual_seed(0)
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from quickstart import Block
    finally:
        sys.path.remove(str(ROOT / "examples"))
    expected = predispatch.export(Block(), (torch.randn(2, 5, 16),), {"mask": torch.ones(5, 5, dtype=torch.bool)})
    assert code == ExitCode.OK and out == str(expected) + "\n"


def test_train_and_eval(capsys):
    _, train, _ = run(capsys, "export", "test_cli:Norm", "--inputs", "f32[3,4]", "--train")
    _, evaluated, _ = run(capsys, "export", "test_cli:Norm", "--inputs", "f32[3,4]", "--eval")
    assert "BUFFER_MUTATION target='bn.running_mean'" in train
    assert "BUFFER_MUTATION" not in evaluated
    code, _, err = run(capsys, "export", "test_cli:double", "--inputs", "f32[3]", "--eval")
    assert code == ExitCode.USAGE and "--eval applies to nn.Module models" in err


def test_preserve_and_decompose(capsys):
    _, out, _ = run(capsys, "export", "test_cli:Tiny", "--inputs", "f32[2,4]", "--decompose", "aten.linear")
    assert "aten.linear" not in out and "aten.addmm" in out
    code, _, err = run(capsys, "export", "test_cli:Tiny", "--inputs", "f32[2,4]", "--preserve", "aten.lineer")
    assert code == ExitCode.USAGE and "there is no op 'aten.lineer'" in err


def test_dynamic_dimensions(capsys):
    code, out, _ = run(capsys, "export", "test_cli:Tiny", "--inputs", "f32[batch=3,4]", "--dim", "batch=2..16")
    assert code == ExitCode.OK
    assert re.search(r'x: "f32\[s\d+, 4\]"', out)
    assert re.search(r"Range constraints:\n        s\d+ \(batch\): \[2, 16\]  \(x.size\(\)\[0\]\)", out)
    code, _, err = run(capsys, "export", "test_cli:Tiny", "--inputs", "f32[batch=3,4]", "--dim", "rows=2..16")
    assert code == ExitCode.USAGE and "no input has a dimension named 'rows'" in err and "inputs: batch" in err
    code, _, err = run(capsys, "export", "test_cli:Tiny", "--inputs", "f32[b=3,4], f32[b=2]")
    assert code == ExitCode.USAGE and "has example size 3 in one input and 2 in another" in err


def test_dim_example_from_the_help_keeps_batch_one(capsys):
    """`--dim batch=1..64`, the help's own example: the range is 1 to 64, not torch's traced 2 to 64."""
    code, out, _ = run(capsys, "export", "test_cli:Tiny", "--inputs", "f32[batch=3,4]", "--dim", "batch=1..64")
    assert code == ExitCode.OK
    assert re.search(r"s\d+ \(batch\): \[1, 64\]  \(x.size\(\)\[0\]\)", out)


def test_export_failure_is_a_message_without_traceback(capsys):
    code, out, err = run(capsys, "export", "test_cli:Branchy", "--inputs", "f32[3]")
    assert code == ExitCode.REFUSED == 1
    assert out == ""
    assert err.startswith("predispatch export: error: Python code branches on")
    assert "see docs/errors.md#datadependenterror" in err and "--traceback" in err
    assert "Traceback" not in err
    for argv in (["export", "test_cli:Branchy", "--inputs", "f32[3]", "--traceback"],
                 ["--traceback", "export", "test_cli:Branchy", "--inputs", "f32[3]"]):
        code, _, err = run(capsys, *argv)
        assert code == ExitCode.REFUSED and "Traceback (most recent call last)" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["export", "test_cli:Tiny", "--inputs", "f33[2,4]"], "--inputs: unknown dtype 'f33'"),
        (["export", "test_cli:Tiny", "--inputs", "f32[2,4]", "--kwargs", "f32[1]"], "--kwargs: --kwargs takes keyword"),
        (["export", "test_cli:Tiny", "--inputs", "f32[2,4], scale=1.0", "--kwargs", "scale=2.0"], "given in both"),
        (["export", "test_cli:Tiny"], "the following arguments are required: --inputs"),
        (["export", "test_cli", "--inputs", "f32[1]"], "neither MODULE:ATTR nor an existing file"),
        (["show", "no/such/file.pd"], "no such file: 'no/such/file.pd'"),
        (["draw", "test_cli:Tiny", "--inputs", "f32[2,4]", "-o", "out.png"], "cannot tell the picture format"),
        (["draw", "test_cli:Tiny", "-o", "out.html"], "--inputs is required"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["draw", "test_cli:Tiny", "--inputs", "f32[2,4]", "-o", "/no/such/dir/t.html"], "cannot write '/no/such/dir/t.html'"),
        (["export", "test_cli:Tiny", "--inputs", "f32[2,4]", "-q", "--save", "/no/such/dir/t.pd"], "cannot write '/no/such/dir/t.pd'"),
    ],
)
def test_usage_errors_exit_2(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == ExitCode.USAGE == 2
    assert message in err


def test_no_command_prints_help(capsys):
    code, _, err = run(capsys)
    assert code == ExitCode.USAGE and "exit codes:" in err


# ---- save, show, draw, audit


def test_save_then_show(tmp_path, capsys):
    path = tmp_path / "tiny.pd"
    code, printed, err = run(capsys, "export", "test_cli:Tiny", "--inputs", "f32[2,4]", "--save", str(path))
    assert code == ExitCode.OK and path.exists() and f"saved the program to {path}" in err
    code, shown, _ = run(capsys, "show", str(path))
    assert code == ExitCode.OK and shown == printed


_OUTPUT_CLASSES = """\
import dataclasses
import pathlib
import torch

pathlib.Path("imported.marker").touch()  # where a process imports this module (cwd: the test's folder)

@dataclasses.dataclass
class Out:
    y: torch.Tensor

class Net(torch.nn.Module):
    def forward(self, x):
        return Out(x + 1)
"""


def _fresh(folder: Path, *argv: str, script: bool = False) -> subprocess.CompletedProcess:
    """The command line in a new process started in `folder`, as a shell user's: the installed
    `predispatch` script (a copy of what pip writes, in a folder of its own) or `python -m predispatch`."""
    if script:
        launcher = folder.parent / "bin" / "predispatch"
        launcher.parent.mkdir(exist_ok=True)
        launcher.write_text("import re\nimport sys\nfrom predispatch.cli import main\nif __name__ == '__main__':\n"
                            "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n    sys.exit(main())\n")
        command = [sys.executable, str(launcher)]
    else:
        command = [sys.executable, "-m", "predispatch"]
    return subprocess.run([*command, *argv], capture_output=True, text=True, cwd=folder, timeout=300, check=False,
                          env=subprocess_env(ROOT))


def test_show_and_draw_build_no_class_the_program_names(tmp_path, monkeypatch, capsys):
    """Issue 38: a saved program whose output class lives in a module the shell's process has not
    imported (a Hugging Face `ModelOutput`) is shown and drawn without `--import`: the class is
    shown by name, and its module is never imported nor the class built."""
    (tmp_path / "output_classes_for_cli.py").write_text(_OUTPUT_CLASSES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, printed, _ = run(capsys, "export", "output_classes_for_cli:Net", "--inputs", "f32[2]", "--save", "p.pd")
    assert code == ExitCode.OK
    (tmp_path / "imported.marker").unlink()
    for script in (False, True):
        done = _fresh(tmp_path, "show", "p.pd", script=script)
        assert done.returncode == ExitCode.OK and done.stdout == printed, done.stderr
        done = _fresh(tmp_path, "draw", "p.pd", "-o", "p.html", script=script)
        assert done.returncode == ExitCode.OK and (tmp_path / "p.html").exists(), done.stderr
    assert not (tmp_path / "imported.marker").exists()
    done = _fresh(tmp_path, "show", "p.pd", "--import", "no_such_module_here")
    assert done.returncode == ExitCode.USAGE and "--import no_such_module_here" in done.stderr


def test_a_displayed_program_cannot_run(tmp_path):
    """What `show` and `draw` read is no runnable program: no module(), no save, and its classes
    are names pytree cannot unflatten and nobody can build."""
    import torch.utils._pytree as pytree

    from predispatch._files import load_for_display
    from predispatch.errors import NotAProgramError, SerializationError
    from predispatch.serialize.classes import DisplayedClass, displayed_name

    predispatch.save(predispatch.export(ReturnsOut(), (torch.randn(2),)), tmp_path / "p.pd")
    before = frozenset(pytree.SUPPORTED_NODES)
    shown = load_for_display(tmp_path / "p.pd")
    assert frozenset(pytree.SUPPORTED_NODES) == before
    out_type = shown.signature.out_spec.type
    assert issubclass(out_type, DisplayedClass) and displayed_name(out_type) == "test_cli:Out"
    assert not any(hasattr(shown, name) for name in ("module", "joint", "to_torch", "to_onnx"))
    with pytest.raises(NotAProgramError, match="display only"):
        predispatch.save(shown, tmp_path / "q.pd")
    with pytest.raises(KeyError):
        pytree.tree_unflatten([torch.ones(2)], shown.signature.out_spec)
    with pytest.raises(SerializationError, match="read for display only"):
        out_type(torch.ones(2))
    assert str(shown) == str(predispatch.load(tmp_path / "p.pd"))


#: What a file may hold to take over the terminal that prints it: OSC 52 (write the clipboard),
#: CSI 2 J (clear the screen), OSC 0 (the window title), a one-byte C1 CSI, a carriage return.
ESCAPES = {"\x1b]52;c;cHduZWQ=\x07": "\\x1b]52;c;cHduZWQ=\\x07", "\x1b[2J": "\\x1b[2J",
           "\x1b]0;pwned\x07": "\\x1b]0;pwned\\x07", "\x9b2J": "\\x9b2J", "\r": "\\x0d"}


def _with_escapes(data: bytes) -> bytes:
    """`data` (Tiny, exported with a dynamic batch and a constant `scale`) with every escape in
    ESCAPES in the constant input's path, a shape guard and a symbol's origin (load refuses a
    stack trace with control characters)."""
    import load_attacks

    text = "".join(ESCAPES)

    def edit(p):
        sig = p["signature"]
        sig["input_leaves"][1]["path"] += text
        sig["shapes"]["guards"] = {"tuple": [f"s77 >= 2{text}"]}
        sig["shapes"]["origins"]["tuple"][0]["tuple"][1] += text

    return load_attacks.edited(data, edit)


def test_show_and_draw_make_a_files_escape_sequences_visible(tmp_path, capsys):
    """Issue 40: every string from a file reaches the terminal with its control characters shown
    (`\\x1b`), never run: in the program `show` prints, in a picture, in an error."""
    ep = predispatch.export(Tiny(), (torch.randn(3, 4), 2.0), dynamic_shapes=({0: torch.export.Dim("batch")}, None))
    path = tmp_path / "p.pd"
    path.write_bytes(_with_escapes(_saved(ep)))
    code, out, err = run(capsys, "show", str(path))
    assert code == ExitCode.OK, err
    shown = "".join(ESCAPES.values())  # a carriage return, last, also ends a line for textwrap's indent
    for where in ("scale", "s77 >= 2", "(x.size()[0]"):
        assert where + shown in out, out
    assert not _controls(out)
    for output in ("p.dot", "p.html"):
        code, _, err = run(capsys, "draw", str(path), "-o", str(tmp_path / output))
        assert code == ExitCode.OK and not _controls((tmp_path / output).read_text()), err
    bad = tmp_path / "bad.pd"
    bad.write_bytes(_refused_with_escapes(_saved(ep)))
    code, _, err = run(capsys, "show", str(bad))
    assert code == ExitCode.REFUSED and "\\x1b]0;pwned\\x07" in err and not _controls(err), err


def test_visible_writes_every_control_character_as_its_escape():
    from predispatch.cli.terminal import visible

    assert visible("a\x1b[2Jb\x9b\u202ec\x7f\x00\r\tkept\n") == "a\\x1b[2Jb\\x9b\\u202ec\\x7f\\x00\\x0d\tkept\n"


def _refused_with_escapes(data: bytes) -> bytes:
    """A file refused with a message quoting its own text: a call of an op named with an escape."""
    import load_attacks

    def edit(program: dict) -> None:  # the first mul, whatever this torch names it
        first = next(n for n in program["graph_module"]["nodes"] if str(n.get("target", "")).startswith("aten.mul"))
        first.update(target="aten.mul\x1b]0;pwned\x07.Tensor")

    return load_attacks.edited(data, edit)


def _controls(text: str) -> list[str]:
    """The characters of `text` a terminal would act on (all but the newline)."""
    return [c for c in text if c != "\n" and (ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0)]


def _saved(ep) -> bytes:
    import io

    buffer = io.BytesIO()
    predispatch.save(ep, buffer)
    return buffer.getvalue()


_LOCAL_MODULES = {
    "typing_extensions.py": 'open("typing_extensions.ran", "w").close()\n',
    "json.py": 'open("json.ran", "w").close()\n',
}


def test_import_never_runs_the_current_folders_modules(tmp_path, capsys):
    """Issue 40: `predispatch show model.pd --import json` in a downloaded model's folder that
    holds its own `json.py` and `typing_extensions.py` imports the installed ones, as an
    installed command finds them: the folder's files never run (the script and `python -m`)."""
    folder = tmp_path / "model"
    folder.mkdir()
    predispatch.save(predispatch.export(Tiny(), (torch.randn(2, 4),)), folder / "model.pd")
    for name, code in _LOCAL_MODULES.items():
        (folder / name).write_text(code)
    for script in (True, False):
        done = _fresh(folder, "show", "model.pd", "--import", "json", script=script)
        assert done.returncode == ExitCode.OK and done.stdout.startswith("ExportedProgram:"), done.stderr
        assert sorted(p.name for p in folder.glob("*.ran")) == [], ("script" if script else "python -m", done.stderr)


def test_import_says_what_it_runs(capsys):
    code, out, _ = run(capsys, "show", "--help")
    assert code == ExitCode.OK and "importing runs that package's code" in " ".join(out.split())


class ReturnsOut(nn.Module):
    def forward(self, x):
        return Out(x + 1)


@dataclasses.dataclass
class Out:
    y: torch.Tensor


def test_show_refuses_a_file_that_is_not_a_program(tmp_path, capsys):
    path = tmp_path / "junk.pd"
    path.write_bytes(b"not a zip")
    code, _, err = run(capsys, "show", str(path))
    assert code == ExitCode.REFUSED and "predispatch show: error:" in err and "Traceback" not in err


def test_save_missing_from_the_library_is_exit_4(monkeypatch, capsys):
    monkeypatch.delattr(predispatch, "save", raising=False)
    monkeypatch.delitem(predispatch._LAZY, "save")  # public names are imported on first use
    code, out, err = run(capsys, "export", "test_cli:Tiny", "--inputs", "f32[2,4]", "--save", "x.pd")
    assert code == ExitCode.MISSING == 4
    assert out == ""  # checked before exporting
    assert "no predispatch.save()" in err


@pytest.mark.parametrize("suffix, marker", [(".html", "<!doctype html>"), (".dot", "digraph")])
def test_draw_from_a_model(tmp_path, capsys, suffix, marker):
    out = tmp_path / f"tiny{suffix}"
    code, _, err = run(capsys, "draw", "test_cli:Tiny", "--inputs", "f32[2,4]", "-o", str(out))
    assert code == ExitCode.OK and f"wrote {out}" in err
    text = out.read_text()
    assert text.startswith(marker) and "p_lin_weight" in text and "test_cli:Tiny" in text


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed (apt-get install graphviz)")
def test_draw_svg_from_a_saved_program(tmp_path, capsys):
    saved, svg = tmp_path / "tiny.pd", tmp_path / "tiny.svg"
    assert run(capsys, "export", "test_cli:Tiny", "--inputs", "f32[2,4]", "--save", str(saved), "-q")[0] == ExitCode.OK
    code, _, _ = run(capsys, "draw", str(saved), "-o", str(svg))
    assert code == ExitCode.OK and svg.read_text().lstrip().startswith("<?xml") and "p_lin_weight" in svg.read_text()
    code, _, err = run(capsys, "draw", str(saved), "--inputs", "f32[1]", "-o", str(svg))
    assert code == ExitCode.USAGE and "is a saved program" in err


def test_draw_svg_without_graphviz_is_exit_4(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    code, _, err = run(capsys, "draw", "test_cli:Tiny", "--inputs", "f32[2,4]", "-o", str(tmp_path / "t.svg"))
    assert code == ExitCode.MISSING
    assert "apt-get install graphviz" in err and "`pip install graphviz` is not enough" in err
    assert not (tmp_path / "t.svg").exists()


def test_audit_prints_the_table(capsys):
    code, out, _ = run(capsys, "audit", "--show", "3")
    assert code == ExitCode.OK
    assert re.search(r"torch \S+: \d+ CIA aten overloads", out)
    code, markdown, _ = run(capsys, "audit", "--markdown")
    assert code == ExitCode.OK and markdown.startswith("<!-- Generated") and "# Composite-op audit" in markdown


def test_audit_without_a_table_is_exit_4(monkeypatch, capsys):
    import predispatch.audit

    def missing():
        raise FileNotFoundError(2, "No such file", "audit_table.json")

    monkeypatch.setattr(predispatch.audit, "load_table", missing)
    code, _, err = run(capsys, "audit")
    assert code == ExitCode.MISSING and "python -m predispatch.audit --write" in err


# ---- the documented exit codes, and the real entry points


def test_exit_codes_are_documented():
    documented = dict(re.findall(r"^\| (\d) \| `(\w+)` \|", (ROOT / "docs" / "cli.md").read_text(), re.M))
    assert documented == {str(int(c)): c.name for c in ExitCode}
    assert [int(n) for n in re.findall(r"^  (\d)  ", EXIT_CODES_HELP, re.M)] == [int(c) for c in ExitCode]


@pytest.mark.parametrize("command", ["export", "show", "draw", "audit"])
def test_every_command_has_help_with_exit_codes(capsys, command):
    code, out, _ = run(capsys, command, "--help")
    assert code == ExitCode.OK and "exit codes:" in out and "--traceback" in out


def _subprocess(*argv: str) -> subprocess.CompletedProcess:
    env = subprocess_env(ROOT / "tests")
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env, check=False)


def test_python_dash_m_and_the_console_script():
    done = _subprocess(sys.executable, "-m", "predispatch", "export", "test_cli:Branchy", "--inputs", "f32[3]")
    assert done.returncode == 1 and done.stdout == ""
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("predispatch export: error:")
    script = Path(sys.executable).with_name("predispatch")
    if not script.exists():
        pytest.skip("the console script is not installed next to this interpreter (pip install -e .)")
    done = _subprocess(str(script), "--version")
    assert done.returncode == 0 and done.stdout.startswith(f"predispatch {predispatch.__version__}")


# ---- a closed pipe


def _read_one_line_and_close(*argv: str) -> subprocess.CompletedProcess:
    """Run the CLI as `predispatch ARGS | head -1` does: the reader leaves after one line."""
    env = subprocess_env(ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "predispatch", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    return subprocess.CompletedProcess(proc.args, proc.wait(), first, err)


def test_audit_into_a_closed_pipe_ends_quietly():
    result = _read_one_line_and_close("audit", "--markdown")  # ~150 KB: more than a pipe holds
    assert result.stdout.startswith(b"<!--")
    assert (result.returncode, result.stderr) == (0, "")


def test_show_into_a_closed_pipe_ends_quietly(tmp_path):
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(400)])  # its listing is over 64 KB
    path = tmp_path / "long.pd"
    predispatch.save(predispatch.export(model, (torch.randn(1, 2),)), path)
    result = _read_one_line_and_close("show", str(path))
    assert result.stdout.startswith(b"ExportedProgram")
    assert (result.returncode, result.stderr) == (0, "")


def test_import_and_help_do_not_import_dynamo():
    """torch._dynamo costs about 1 s of CPU: `import predispatch` and `--help` leave it unimported."""
    code = (
        "import sys, contextlib, io; import predispatch; from predispatch.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()): main(['--help'])\n"
        "print('torch._dynamo' in sys.modules)"
    )
    env = subprocess_env(ROOT)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.stdout.strip() == "False", done.stderr



def test_import_and_help_do_not_import_torch():
    """Start-up: `import predispatch` and `predispatch --help` cost little more than Python's
    start (the public names and the commands' work are imported on first use); torch is
    imported by the first call that needs it, and `predispatch.export` is there when asked."""
    code = (
        "import sys, contextlib, io; import predispatch; from predispatch.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()): main(['--help']); main(['export', '--help'])\n"
        "print('torch' in sys.modules, callable(predispatch.export), 'torch' in sys.modules)"
    )
    env = subprocess_env(ROOT)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.stdout.strip() == "False True True", done.stderr


def test_show_imports_only_what_loading_needs(tmp_path):
    """`show` loads and prints: it imports no tracing machinery (AOTAutograd, torch.export's
    fake-input helpers).  It does import torch._dynamo: the loaded graph's metadata are fake
    tensors, and torch's `FakeTensorMode()` imports `torch._dynamo.config` (see `_LAZY` in
    _torch_internals.py), so this pins that and fails once torch stops doing so."""
    path = tmp_path / "f.pd"
    predispatch.save(predispatch.export(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), (torch.randn(3, 4),)), path)
    code = (
        "import sys, contextlib, io; from predispatch.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out: code = main(['show', sys.argv[1]])\n"
        "assert code == 0 and out.getvalue().startswith('ExportedProgram'), (code, out.getvalue())\n"
        "names = ('torch._functorch.aot_autograd', 'torch._export.non_strict_utils', 'torch._dynamo')\n"
        "print([name in sys.modules for name in names])"
    )
    env = subprocess_env(ROOT)
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env, timeout=300)
    assert done.stdout.strip() == "[False, False, True]", done.stderr