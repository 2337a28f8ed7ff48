"""Run many small jobs so that one that crashes the interpreter loses only itself.

Some CIA kernels segfault on arguments they do not expect (``native_batch_norm``'s Python
kernel, in evaluation mode without running statistics, calls a C++ kernel that dereferences
a missing tensor), and the schema-built samples find such arguments.  ``try``/``except``
cannot catch a segfault, so the jobs run in a forked child that streams each result back
before starting the next.  When the child dies, a fresh child retries the job it was running
(an earlier job may have corrupted memory and left the crash to an innocent one); a job that
kills a fresh child as its first job is recorded as crashed, and the next child carries on
after it.  A job that runs past ``timeout_s`` is treated the same way.

The child runs torch single-threaded: an OpenMP pool inherited across ``fork`` can deadlock,
and the audit's tensors are too small to gain from threads anyway.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import select
import signal
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

J = TypeVar("J")
R = TypeVar("R")


def run_isolated(
    jobs: Sequence[J],
    run: Callable[[J], R],
    on_crash: Callable[[J, str], R],
    timeout_s: float = 60.0,
) -> list[R]:
    """``[run(job) for job in jobs]``, but ``on_crash(job, why)`` for a job that kills its child."""
    results: list[Any] = [None] * len(jobs)
    start = 0
    while start < len(jobs):
        done, why = _run_child(jobs, run, start, results, timeout_s)
        if done == len(jobs):
            break
        if done == start:  # it died on its first job: the job itself is to blame
            results[done] = on_crash(jobs[done], why)
            start = done + 1
        else:  # an earlier job may have corrupted memory: retry this one in a fresh child
            start = done
    return results


def _run_child(jobs: Sequence[J], run: Callable[[J], R], start: int, results: list[Any],
               timeout_s: float) -> tuple[int, str]:
    """Run jobs from ``start`` in one child; return the first index without a result, and why."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns from here
        os.close(read_fd)
        _child(jobs, run, start, write_fd)
    os.close(write_fd)
    next_index, why = start, ""
    try:
        while True:
            ready, _, _ = select.select([read_fd], [], [], timeout_s)
            if not ready:
                os.kill(pid, signal.SIGKILL)
                why = f"ran longer than {timeout_s:.0f} s"
                break
            frame = _read_frame(read_fd)
            if frame is None:
                break
            index, result = pickle.loads(frame)
            results[index] = result
            next_index = index + 1
    finally:
        os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    return next_index, why or _describe_exit(status)


def _child(jobs: Sequence[J], run: Callable[[J], R], start: int, write_fd: int) -> None:
    code = 0
    try:
        faulthandler.disable()  # a crash is an expected outcome here, not a bug to dump
        torch.set_num_threads(1)
        for index in range(start, len(jobs)):
            frame = pickle.dumps((index, run(jobs[index])))
            _write_all(write_fd, len(frame).to_bytes(8, "little") + frame)
    except BaseException:  # noqa: BLE001  (the parent sees the missing result)
        code = 1
    finally:
        os._exit(code)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_frame(fd: int) -> bytes | None:
    """One length-prefixed frame, or None at end of stream (the child finished or died)."""
    header = _read_exact(fd, 8)
    if header is None:
        return None
    return _read_exact(fd, int.from_bytes(header, "little"))


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, missing = [], n
    while missing:
        chunk = os.read(fd, missing)
        if not chunk:
            return None
        chunks.append(chunk)
        missing -= len(chunk)
    return b"".join(chunks)


def _describe_exit(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"crashed the process ({signal.Signals(sig).name})"
    return f"ended the process (exit status {os.WEXITSTATUS(status)})"
