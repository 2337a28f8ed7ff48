"""Load saved programs in a fresh interpreter and run them: what a user of another process does.

    python tests/load_in_fresh_process.py JOBS.json

JOBS.json is a list of `{"program", "inputs", "outputs", "types"}`: the program file; a
safetensors file of the calls' arguments (`"i.j"`: argument j of call i); where to write every
tensor leaf of each call's result (`"i.k"`: leaf k of call i's result, in pytree order); and the
classes the loading user allows, as `module:qualname`.  The script imports those modules (the
user's own choice of code, as `import torchao` is) and nothing the file names, loads each program
with `predispatch.load(path, types=[...])`, and runs its `module()` (a joint program's computes
its gradients itself).
"""

from __future__ import annotations

import importlib
import json
import sys

import safetensors.torch
import torch
import torch.utils._pytree as pytree

import predispatch


def _class(name: str) -> type:
    module, _, qualname = name.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _calls(path: str) -> list[tuple[torch.Tensor, ...]]:
    flat = safetensors.torch.load_file(path)
    calls: dict[int, dict[int, torch.Tensor]] = {}
    for key, tensor in flat.items():
        i, j = map(int, key.split("."))
        calls.setdefault(i, {})[j] = tensor
    return [tuple(args[j] for j in sorted(args)) for _, args in sorted(calls.items())]


def run(job: dict) -> None:
    program = predispatch.load(job["program"], types=[_class(name) for name in job["types"]])
    module = program.module()
    results = {}
    for i, args in enumerate(_calls(job["inputs"])):
        leaves = pytree.tree_leaves(module(*args))
        results.update({f"{i}.{k}": leaf.detach().contiguous() for k, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)})
    safetensors.torch.save_file(results, job["outputs"])


def main() -> None:
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    for job in jobs:
        run(job)
        print(json.dumps({"done": job["program"]}), flush=True)


if __name__ == "__main__":
    main()
