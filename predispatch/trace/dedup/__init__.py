"""Repeated blocks: each distinct block is traced (twice, compared), then replayed as torch's
`invoke_subgraph` HOP; see Note [Sharing repeated blocks] in share.py.

    reads.py   the attributes a forward reads, and their values (the dynamic part of a key)
    body.py    a recorded call's run of nodes as a subgraph; the node-by-node comparison
    replay.py  the trace-time HOP that emits `invoke_subgraph` for a replayed call
    fold.py    after the trace: the calls traced in full become `invoke_subgraph` calls too
    share.py   the keys, the record/compare/replay decision, the per-key report
"""

from predispatch.trace.dedup.share import BlockReport, Dedup, share_repeated_blocks

__all__ = ["BlockReport", "Dedup", "share_repeated_blocks"]
