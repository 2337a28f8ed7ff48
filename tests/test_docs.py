"""The code in the docs runs as written: README's training loop, docs/ir.md's side effects
example, and every block of docs/huggingface.md (with the `models` extra), each in order.

The Python blocks of a page run together in one process (the page's session), except a block
that starts with `# a new Python process`, which runs in a process of its own, as the page says,
after the session; a `bash` block's `predispatch ...` lines run, in the same folder, as
`python -m predispatch ...`.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import predispatch

ROOT = Path(__file__).resolve().parents[1]
NEW_PROCESS = "# a new Python process"


def blocks(path: Path, section: str | None = None) -> list[tuple[str, str]]:
    """The fenced `(language, code)` blocks of `path`, of its `## section` only when given."""
    text = path.read_text()
    if section is not None:
        start = text.index(f"\n## {section}\n")
        end = text.find("\n## ", start + 1)
        text = text[start:end if end != -1 else None]
    return re.findall(r"^```(\w+)\n(.*?)^```$", text, re.M | re.S)


#: The page's processes import this checkout's predispatch.
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def run_python(code: str, cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600, env=ENV)
    assert done.returncode == 0, f"{code}\n---\n{done.stdout}\n{done.stderr}"
    return done.stdout


def run_page(path: Path, cwd: Path, skip: tuple[str, ...] = ()) -> list[str]:
    """Run the blocks of `path` (see the module docstring): first its session, the Python blocks
    not marked as a new process, together in one process (they save the files the others read);
    then the marked blocks and the shell lines, in the page's order.  Returns each run's stdout.
    Blocks containing a string of `skip` are left out."""
    kept = [(language, code) for language, code in blocks(path) if not any(s in code for s in skip)]
    session = [code for language, code in kept if language == "python" and not code.startswith(NEW_PROCESS)]
    outputs = [run_python("\n".join(session), cwd)]
    for language, code in kept:
        if language == "python" and code.startswith(NEW_PROCESS):
            outputs.append(run_python(code, cwd))
        elif language == "bash":
            for line in code.splitlines():
                command = shlex.split(line, comments=True)
                assert command[0] == "predispatch", line
                done = subprocess.run([sys.executable, "-m", "predispatch", *command[1:]], cwd=cwd,
                                      capture_output=True, text=True, timeout=600, env=ENV)
                assert done.returncode == 0, done.stderr
                outputs.append(done.stdout)
        else:
            assert language == "python", language
    return outputs


def test_readme_training_loop_runs_and_equals_eager_sgd():
    """README's joint training loop runs as written, and its closing assert (the program's
    gradients through torch.optim.SGD equal eager training bitwise) holds."""
    ((language, code),) = blocks(ROOT / "README.md", "Training: the joint forward-backward program")
    assert language == "python" and "assert all(torch.equal(p, q)" in code
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})


def test_readme_hand_written_update_claims():
    """What README says of updates written by hand: `add_(g, alpha=-lr)` equals SGD bitwise,
    `p -= lr * g` does not; a tied weight's gradient is one tensor under both names, and
    applying it under both names steps it twice."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(self.head(torch.tanh(self.emb(ids))), ids)

    torch.manual_seed(0)
    ids = torch.randint(0, 10, (64,))
    lr = 0.1
    models = {name: Tied() for name in ("eager", "add_", "sub")}
    for m in models.values():
        m.load_state_dict(models["eager"].state_dict())
    steps = {name: predispatch.export(m, (ids,)).joint().module() for name, m in models.items() if name != "eager"}
    opt = torch.optim.SGD(models["eager"].parameters(), lr=lr)
    for _ in range(10):
        opt.zero_grad()
        models["eager"](ids).backward()
        opt.step()
        for name, step in steps.items():
            _, grads = step(ids)
            assert grads["emb.weight"] is grads["head.weight"]
            with torch.no_grad():
                for p_name, p in models[name].named_parameters():
                    if name == "add_":
                        p.add_(grads[p_name], alpha=-lr)
                    else:
                        p -= lr * grads[p_name]
    assert torch.equal(models["add_"].emb.weight, models["eager"].emb.weight)
    assert not torch.equal(models["sub"].emb.weight, models["eager"].emb.weight)

    twice = Tied()
    twice.load_state_dict(models["eager"].state_dict())
    before = twice.emb.weight.detach().clone()
    _, grads = predispatch.export(twice, (ids,)).joint().module()(ids)
    with torch.no_grad():
        for p_name, p in twice.named_parameters(remove_duplicate=False):
            p.add_(grads[p_name], alpha=-lr)
    assert torch.allclose(twice.emb.weight, before - 2 * lr * grads["emb.weight"])


def test_ir_side_effects_example_runs(capsys: pytest.CaptureFixture[str]):
    """docs/ir.md's example: print and logging run once, at export; attribute writes are undone
    after export and not done by the program (its own asserts), and the print shows a fake tensor."""
    ((language, code),) = blocks(ROOT / "docs" / "ir.md", "Python side effects in forward")
    assert language == "python"
    exec(compile(code, "docs/ir.md", "exec"), {"__name__": "ir_md"})
    printed = capsys.readouterr().out
    assert printed.count("forward ran") == 1 and "FakeTensor" in printed, printed


def test_audit_is_decompositions():
    """`ep.audit` (the documented name) is the record the program holds as `decompositions`."""
    ep = predispatch.export(nn.Linear(2, 2), (torch.randn(1, 2),))
    assert ep.audit is ep.decompositions


@pytest.mark.models
def test_huggingface_page_runs(tmp_path: Path):
    """docs/huggingface.md, every block in order, in a fresh folder; the ONNX block when
    onnxruntime and onnxscript are installed (the consumers extra)."""
    pytest.importorskip("transformers")
    onnx = all(importlib.util.find_spec(m) for m in ("onnx", "onnxscript", "onnxruntime"))
    outputs = run_page(ROOT / "docs" / "huggingface.md", tmp_path, skip=() if onnx else ("onnxruntime",))
    printed = "\n".join(outputs)
    assert "CausalLMOutputWithCrossAttentions ['logits']" in printed
    assert "outside the range [2, 64] of Dim 'seq'" in printed
    assert "types=[transformers.modeling_outputs.CausalLMOutputWithCrossAttentions]" in printed  # the refusal's fix
    assert "DynamicCache" in printed and "Range constraints:" in printed
    if onnx:
        assert "[('input_ids', [1, 'seq'])]" in printed
