"""`only_drawn_from`: did a generator's state move only by draws since a saved state?

torch keeps a generator's state layout in C++; this reads it (one concern of `_torch_internals`).

Note [Another thread's draws during an export]
----------------------------------------------
Export compares the states of the generators forward can reach before and after the trace,
to find a reseed forward made by calling a `torch.Generator` method directly (which cannot be
intercepted; see Note [RNG state in forward]).  Forward itself draws nothing real (the trace
runs on fake tensors), but another thread of the process may draw from the same generator
meanwhile (torch's default generator is process-wide).  Its draws move the state too: a plain
comparison refused such exports, and putting the saved state back rewound the other thread,
which then drew the same numbers again.

A draw only advances a generator along its stream; a reseed or a restored state puts it
elsewhere.  So export asks whether the state after is the state before advanced by some
number of draws:

- CPU generators (mt19937): the same seed, and the 624-word state array reached from the
  saved one by repeating the generator's twist (`_twist`, the step that makes the next 624
  numbers); within one array, a position at or after the saved one.  The search stops after
  `MAX_TWISTS` twists (about 40 million numbers drawn by other threads during one export).
- Philox generators (CUDA and others keeping a seed and an offset): the same seed, and an
  offset at or after the saved one.
- Any other state layout: equal states only.

torch keeps these layouts in C++ (`CPUGeneratorImplState` in aten/src/ATen/CPUGeneratorImpl.cpp,
`mt19937_engine` in ATen/core/MT19937RNGEngine.h); `_CPU_LAYOUT` reads them, and a state of
another size is compared for equality (loud, never silently accepted).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["MAX_TWISTS", "only_drawn_from"]

_N, _M = 624, 397  # mt19937's state length and its middle word
_MATRIX_A, _UPPER, _LOWER = np.uint32(0x9908B0DF), np.uint32(0x80000000), np.uint32(0x7FFFFFFF)

#: Twists searched before a moved CPU state counts as changed: 2**16 twists are ~41M numbers.
MAX_TWISTS = 1 << 16


@dataclass(frozen=True)
class _CpuLayout:
    """Byte offsets in a CPU generator's `get_state()` (`CPUGeneratorImplState`).

    seed: int64 `the_initial_seed`; next: uint64 index of the next word of `words` to use;
    words: 624 uint64 slots each holding one uint32 of the mt19937 state array; size: the
    state's length in bytes (the normal-sample caches after `words` are draws' by-products).
    """

    seed: int = 0
    next: int = 16
    words: int = 24
    size: int = 5056


_CPU_LAYOUT = _CpuLayout()
_PHILOX_SIZE = 16  # int64 seed, int64 offset


@dataclass(frozen=True)
class _MtState:
    """The parts of a CPU generator's state that draws move."""

    seed: int
    next: int
    words: np.ndarray


def only_drawn_from(generator: torch.Generator, saved: torch.Tensor) -> bool:
    """True when `generator`'s state is `saved` advanced by draws (Note [Another thread's draws
    during an export]); False when it was reseeded, restored elsewhere, or cannot be told."""
    state = generator.get_state()
    if torch.equal(state, saved):
        return True
    if state.numel() != saved.numel():
        return False
    if generator.device.type == "cpu" and state.numel() == _CPU_LAYOUT.size:
        return _mt_reached(_mt_state(saved), _mt_state(state))
    if state.numel() == _PHILOX_SIZE:
        (seed0, offset0), (seed1, offset1) = (_int64s(s, 2) for s in (saved, state))
        return seed0 == seed1 and offset1 >= offset0
    return False


def _int64s(state: torch.Tensor, count: int) -> tuple[int, ...]:
    return tuple(int(v) for v in np.frombuffer(state.numpy().tobytes(), np.int64, count))


def _mt_state(state: torch.Tensor) -> _MtState:
    raw = state.numpy().tobytes()
    seed = int(np.frombuffer(raw, np.int64, 1, _CPU_LAYOUT.seed)[0])
    position = int(np.frombuffer(raw, np.uint64, 1, _CPU_LAYOUT.next)[0])
    words = np.frombuffer(raw, np.uint64, _N, _CPU_LAYOUT.words).astype(np.uint32)
    return _MtState(seed, position, words)


def _mt_reached(before: _MtState, after: _MtState) -> bool:
    """Whether draws lead from `before` to `after`: same seed, and the state array after some
    number of twists (the same array: a later position in it)."""
    if before.seed != after.seed:
        return False
    words = before.words
    for twists in range(MAX_TWISTS + 1):
        if np.array_equal(words, after.words):
            return twists > 0 or after.next >= before.next
        words = _twist(words)
    return False


def _twist(s: np.ndarray) -> np.ndarray:
    """mt19937's `next_state`: the array the next 624 numbers are tempered from.

    Word i becomes `s[i + M] ^ mix(s[i], s[i + 1])`, where indices past the end read words
    already replaced (`new[i + M - N]`); computed in slices of N - M words, since each slice
    reads only the one before it.
    """
    new = np.empty_like(s)
    step = _N - _M
    new[:step] = s[_M:] ^ _mix(s[:step], s[1 : step + 1])
    new[step : 2 * step] = new[:step] ^ _mix(s[step : 2 * step], s[step + 1 : 2 * step + 1])
    new[2 * step : _N - 1] = new[step : _N - 1 - step] ^ _mix(s[2 * step : _N - 1], s[2 * step + 1 :])
    new[_N - 1] = new[_M - 1] ^ _mix(s[_N - 1 :], new[:1])[0]
    return new


def _mix(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """mt19937's `twist(u, v)`: the upper bit of u with the lower bits of v, shifted, and the
    matrix where v is odd."""
    return (((u & _UPPER) | (v & _LOWER)) >> np.uint32(1)) ^ ((v & np.uint32(1)) * _MATRIX_A)
