"""Peak memory of exporting a Llama built on the meta device: 7B (32 layers) or 70B-shaped (80 layers).

    python benchmarks/peak_memory.py {baseline,predispatch,torch.export} [7b|70b]

Prints one JSON line: the tool, export seconds, graph nodes and the process's peak resident
memory.  `baseline` builds the model and exports nothing: what import and the model itself
cost.  Run each tool in a fresh process (benchmarks/run.py does), so that one peak is not the
other's.

Note [Peak memory of a child process]: on Linux `getrusage(RUSAGE_SELF).ru_maxrss` survives
fork and exec: a child started by a big parent reports at least the parent's peak (the kernel
folds the old address space's high-water mark into the process's maxrss at exec).  So the
peak is read from `VmHWM` in /proc/self/status, the high-water mark of this process's own
address space since exec; `ru_maxrss` is reported beside it.  Started from a shell (as
`/usr/bin/time -v` does) the two agree.
"""

from __future__ import annotations

import json
import re
import resource
import sys
import time

import torch
import transformers

TOOLS = ("baseline", "predispatch", "torch.export")

#: Llama configurations by size: transformers' default (Llama-2 7B) and Llama-3 70B's shape.
SIZES = {
    "7b": {},
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256),
}


def main(tool: str, size: str = "7b") -> dict:
    transformers.logging.set_verbosity_error()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(use_cache=False, **SIZES[size])).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 128))
    start = time.perf_counter()
    nodes = 0
    if tool == "predispatch":
        import predispatch

        nodes = len(predispatch.export(model, (ids,)).graph.nodes)
    elif tool == "torch.export":
        nodes = len(torch.export.export(model, (ids,), strict=False).graph.nodes)
    return {
        "tool": tool,
        "size": size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": time.perf_counter() - start,
        "nodes": nodes,
        "peak_rss_mib": _vm_hwm_kib() / 1024,
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
    }


def _vm_hwm_kib() -> int:
    """This address space's peak resident memory; see Note [Peak memory of a child process]."""
    status = open("/proc/self/status").read()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1))


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or sys.argv[1] not in TOOLS or sys.argv[2:3] not in ([], *([k] for k in SIZES)):
        sys.exit(f"usage: python benchmarks/peak_memory.py {{{','.join(TOOLS)}}} [{'|'.join(SIZES)}]")
    print(json.dumps(main(*sys.argv[1:])))
