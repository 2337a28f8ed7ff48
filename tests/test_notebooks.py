"""The examples keep working: every notebook in examples/ executes without an error and prints
what its stored outputs show, the stored notebooks are the generator's cells, executed, and the
example scripts print what they promise (docs/comparison.md's table included).

The notebooks run in a Jupyter kernel started with this interpreter (`sys.executable`), from a
kernelspec written for the test, so they see the same environment as the tests whatever
kernelspecs the machine has installed.  Together these tests take about a minute.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

import predispatch
from predispatch import _torch_internals as ti
from predispatch._torch_versions import DEVELOPMENT

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
CELL_TIMEOUT_S = 180  # one cell; the slowest runs three CLI subprocesses (~5 s each)


# ---- notebooks


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kernelspec directory whose only kernel, `python3`, is this interpreter."""
    root = tmp_path_factory.mktemp("kernels")
    spec = root / "python3"
    spec.mkdir()
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "Python 3", "language": "python"}))
    return root


def execute(nb: nbformat.NotebookNode, kernel_dir: Path) -> nbformat.NotebookNode:
    """Run every cell of `nb` in a fresh kernel, in examples/ as Jupyter would; raises on an error."""
    specs = KernelSpecManager(kernel_dirs=[str(kernel_dir)], ensure_native_kernel=False)
    manager = AsyncKernelManager(kernel_name="python3", kernel_spec_manager=specs)
    client = NotebookClient(nb, km=manager, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(EXAMPLES)}})
    client.execute()
    return nb


def printed(nb: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for cell in nb.cells for o in cell.get("outputs", ()))


def test_kernel_runs_this_interpreter_in_examples(kernel_dir: Path):
    cell = nbformat.v4.new_code_cell("import os, sys; print(sys.executable); print(os.getcwd())")
    nb = execute(nbformat.v4.new_notebook(cells=[cell]), kernel_dir)
    executable, cwd = printed(nb).splitlines()
    assert (executable, Path(cwd).resolve()) == (sys.executable, EXAMPLES)


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS] == [
        "01_export_and_read.ipynb",
        "02_composite_audit.ipynb",
        "03_regions_and_mutations.ipynb",
        "04_autograd_functions.ipynb",
        "05_hooks.ipynb",
        "06_save_load_cli.ipynb",
    ]


def _generator():
    spec = importlib.util.spec_from_file_location("make_notebooks", EXAMPLES / "make_notebooks.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    return generator


def _torch_release(printed: list[str]) -> str | None:
    """`2.13` from the `torch 2.13.0+cpu, predispatch ...` line a notebook prints first."""
    found = re.search(r"torch (\d+\.\d+)\.", "".join(printed))
    return found.group(1) if found else None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_as_stored(path: Path, kernel_dir: Path):
    """Each notebook asserts the claims it prints (`check(...)`), so running it checks them, on
    every torch release; and on the release the notebooks were stored with (the development
    torch), what it prints now is what the stored outputs show, numbers and temporary paths aside."""
    generator = _generator()
    stored = nbformat.read(path, as_version=4)
    fresh = nbformat.read(path, as_version=4)
    for cell in fresh.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    execute(fresh, kernel_dir)
    assert f"predispatch {predispatch.__version__}" in "".join(generator.printed(fresh))  # this predispatch
    if _torch_release(generator.printed(stored)) != _torch_release(generator.printed(fresh)):
        return  # stored on the development torch: graphs and counts differ by release; the claims ran
    for i, (now, then) in enumerate(zip(generator.printed(fresh), generator.printed(stored))):
        assert generator.comparable(now) == generator.comparable(then), (
            f"{path.name}, code cell {i}: prints something else than its stored output; run examples/make_notebooks.py"
        )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_executed(path: Path):
    """Stored with outputs, from one run top to bottom, with no error: what a reader browses."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code_cells] == list(range(1, len(code_cells) + 1)), (
        f"{path.name}: store it executed (python examples/make_notebooks.py)"
    )
    assert not [o for cell in code_cells for o in cell.outputs if o.output_type == "error"]
    assert any(cell.outputs for cell in code_cells)


def test_notebooks_match_their_generator():
    generator = _generator()
    assert sorted(generator.NOTEBOOKS) == [p.name for p in NOTEBOOKS]
    for name, cells in generator.NOTEBOOKS.items():
        assert generator.sources(nbformat.read(EXAMPLES / name, as_version=4)) == generator.sources(generator.build(cells)), (
            f"{name} differs from examples/make_notebooks.py: edit the generator and run it"
        )


def test_cells_needing_graphviz_print_the_same_either_way():
    """A cell that draws with Graphviz only when `dot` is installed prints the skip line
    otherwise, which `comparable` equates with the SVG: the stored outputs, made on a machine
    with or without Graphviz, match a run on the other kind (README command 2 on a fresh machine)."""
    generator = _generator()
    for name, cells in generator.NOTEBOOKS.items():
        for cell in generator.build(cells).cells:
            if 'shutil.which("dot")' in cell.source:
                assert "skipping the SVG" in cell.source, f"{name}: a Graphviz cell prints nothing without `dot`"
    shown = generator.comparable("<IPython.core.display.SVG object>")
    assert generator.comparable("Graphviz's `dot` is not installed (apt-get/brew/conda install graphviz): skipping the SVG\n") == shown


def test_notebooks_use_only_the_public_api():
    """Users copy from the notebooks: only `predispatch`'s public names and subpackages."""
    public = {"predispatch", "predispatch.audit", "predispatch.render", "predispatch.errors"}
    for path in NOTEBOOKS:
        for cell in nbformat.read(path, as_version=4).cells:
            for module in re.findall(r"^\s*(?:from|import) (predispatch[\w.]*)", cell.source, re.M):
                assert module in public, f"{path.name} imports {module}"


# ---- scripts


def run_example(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_quickstart():
    out = run_example("examples/quickstart.py")
    assert out.startswith("ExportedProgram:\n")
    assert "torch.ops.aten.scaled_dot_product_attention.default(" in out
    assert "add: BUFFER_MUTATION target='steps'" in out
    assert re.search(r"^export took [0-9.]+ s; program output equals eager: True$", out, re.MULTILINE), out


def markdown_rows(text: str, first_column: str) -> list[dict[str, str]]:
    """The rows of the markdown table whose header starts with `first_column`, as dicts."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_column} |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")))))
    return rows


def test_compare_with_torch_export_matches_docs():
    """The script's table equals docs/comparison.md's, timings aside (they vary by machine)."""
    out = run_example("examples/compare_with_torch_export.py")
    assert re.match(r"torch 2\.1[1-5]\.\S+, predispatch \S+\n", out)
    for case in ("no_grad_region", "enable_grad_under_caller_no_grad", "in_place_ops", "mutation_under_no_grad",
                 "custom_backward", "composites"):
        assert f"===== {case}:" in out
    assert "torch.ops.higher_order.autograd_function_apply(square_fwd_0, square_bwd_0, x" in out
    assert "torch.ops.predispatch.keep_history.default(" in out

    measured = markdown_rows(out, "case")
    documented = markdown_rows((ROOT / "docs" / "comparison.md").read_text(), "case")
    for row in measured + documented:
        del row["seconds"]
    if ti.TORCH == DEVELOPMENT:  # the page was measured on the development torch
        assert measured == documented, "docs/comparison.md's table is out of date: rerun the script and update it"
    for row in measured:
        if row["exporter"] == "predispatch":
            assert (row["runs like eager"], row["in-place ops"]) == ("yes", "none"), row
