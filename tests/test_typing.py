"""Users' type checkers see predispatch's types: the package ships `py.typed`, and a script
using the public API type-checks with the API's own types (not `Any`).

The script is checked as a user's would be: predispatch found in a site-packages directory (a
bare venv whose site-packages links this checkout's package and reaches torch through a
`.pth` file), where mypy reads a package's types only if it has a `py.typed` marker.  The
package's own check is `mypy` from the repository root (configured in pyproject.toml).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("mypy", reason="needs mypy (the test extra)")

ROOT = Path(__file__).resolve().parents[1]

USER_SCRIPT = textwrap.dedent("""\
    import torch
    import predispatch

    ep = predispatch.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
    reveal_type(ep)
    reveal_type(ep.module())
    reveal_type(predispatch.export_train_eval)
    predispatch.save(ep, "model.pd")
    loaded: predispatch.ExportedProgram = predispatch.load("model.pd")
    wrong: int = predispatch.load("model.pd")
""")


def _user_site(tmp_path: Path) -> Path:
    """A bare venv whose site-packages holds predispatch (a link to this checkout's package)
    and reaches torch and the rest through a `.pth` line, as an installed wheel would be seen."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "predispatch").symlink_to(ROOT / "predispatch", target_is_directory=True)
    (site / "test_site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def test_the_public_api_type_checks_in_a_users_script(tmp_path: Path):
    python = _user_site(tmp_path)
    (tmp_path / "user.py").write_text(USER_SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--python-executable", str(python), "--no-incremental", "user.py"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600, env={**os.environ, "MYPYPATH": ""},
    )
    out = done.stdout
    assert 'Revealed type is "predispatch.program.exported_program.ExportedProgram"' in out, out
    assert 'Revealed type is "torch.fx.graph_module.GraphModule"' in out, out
    assert "-> predispatch.program.train_eval.TrainEvalProgram" in out, out
    # the one error is the script's own: a program assigned to an int
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "user.py:10:" in errors[0] and '"ExportedProgram"' in errors[0], out


def test_py_typed_ships_with_the_package():
    import tomllib

    assert (ROOT / "predispatch" / "py.typed").is_file()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["predispatch"]
