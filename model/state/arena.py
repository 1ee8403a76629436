"""Appending without copying (`Window`, `Growth`).

A decode step adds one row to every time-axis tensor. Built functionally (`torch.cat`,
then slice the window) that step copies each whole window, several times per layer. A
forward that runs in place (`model.family.Execution`, never under autograd) instead writes
the new rows into an `Arena`, a buffer with spare rows after the window, and hands on a
view of it; the arena is copied only when its spare rows run out (once every
`ARENA_SLACK` steps). A batch stacked for decoding starts in arenas of the layout its steps
grow (`Arena.stacked`, `State.stack`), so a batch whose membership changed is copied once,
not twice. Rows an arena has handed out are never written again: a view may append in
place only while it ends exactly where the arena's claimed rows end, so two states grown
from one (a fork, a retried request) never write the same rows, and no view ever changes
under its holder. Every other `State` operation makes ordinary tensors.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from .precision import snap

ARENA_SLACK = 64  # spare rows an arena gets beyond the window it was made for
HUGE_PAGE = 2 << 20  # bytes in a transparent huge page (x86-64, arm64)
_MADV_HUGEPAGE = 14


def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_MADVISE = _madvise()


def huge_pages(t: torch.Tensor) -> torch.Tensor:
    """`t`, its memory (a new, untouched CPU buffer) backed by huge pages where the kernel
    has them: the whole 2 MiB pages inside it are advised (MADV_HUGEPAGE; Linux, where
    transparent huge pages are `madvise` or `always`). Filling a new buffer of a batch's
    caches (an arena's re-layout, a stacked batch) then takes one page fault per 2 MiB
    instead of one per 4 KiB: for 64 `shakespeare` rows, stacking and the re-laying step ran
    1.7x and 1.6x faster (bench/streams.py, `relayouts`). Elsewhere, or where the call
    fails, nothing changes."""
    if _MADVISE is None or t.device.type != "cpu":
        return t
    start = t.untyped_storage().data_ptr()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = (start + t.untyped_storage().nbytes()) // HUGE_PAGE * HUGE_PAGE
    if last > first:
        _MADVISE(first, last - first, _MADV_HUGEPAGE)  # a refusal (EINVAL: THP off) is harmless
    return t


class Arena:
    """Rows [B, L, capacity, D] behind a time-axis tensor; rows before `end` are claimed.

    `time_major`: in memory, each (stream, layer)'s rows are laid out along time (a row's D
    values are `capacity` apart), layer by layer, so that a kernel scanning the time axis
    reads it contiguously and one layer's (stream, feature) rows are a single batch of
    equally spaced rows (a decode step's attention, `model.transformer_xl`). The tensor is
    the same."""

    __slots__ = ("data", "end", "layers", "time_major")

    def __init__(self, data: torch.Tensor, end: int, time_major: bool = False):
        self.data, self.end, self.time_major = data, end, time_major
        self.layers = data.unbind(1)  # [B, capacity, D] per layer: made once, not every step

    @staticmethod
    def empty(like: torch.Tensor, capacity: int, time_major: bool, batch: int | None = None) -> torch.Tensor:
        """An uninitialised [B, L, capacity, D] buffer for rows like `like` [B, L, M, D] (of
        `batch` streams, where given, rather than like's B)."""
        _, L, _, D = like.shape
        B = like.shape[0] if batch is None else batch
        if time_major:  # (L, B, D, capacity) in memory
            return huge_pages(like.new_empty(L, B, D, capacity)).permute(1, 0, 3, 2)
        return huge_pages(like.new_empty(B, L, capacity, D))

    @staticmethod
    def stacked(parts: list[torch.Tensor], M: int, time_major: bool) -> Arena:
        """An arena holding `parts` ([b, L, m, D] each, m <= M) one after another along the
        batch axis, each part's rows at the end of an M-row window (zeros before them: the
        left padding of a shorter stream), with ARENA_SLACK spare rows after it. A batch
        stacked so (`State.stack`) is already laid out as its decode steps grow it: its first
        step appends in place instead of copying every row into a new arena."""
        first = parts[0]
        data = Arena.empty(first, M + ARENA_SLACK, time_major, sum(p.shape[0] for p in parts))
        b = 0
        for p in parts:
            n, m = p.shape[0], p.shape[2]
            rows = data[b : b + n]
            rows[:, :, : M - m].zero_()
            rows[:, :, M - m : M].copy_(p)
            b += n
        return Arena(data, M, time_major)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` is this arena's newest window: its last row is the last claimed row."""
        d, M = self.data, t.shape[2]
        if M == 0 or t.dtype != d.dtype or t.device != d.device or t.stride() != d.stride():
            return False
        if (t.shape[0], t.shape[1], t.shape[3]) != (d.shape[0], d.shape[1], d.shape[3]):
            return False
        if t.untyped_storage().data_ptr() != d.untyped_storage().data_ptr():
            return False
        return t.storage_offset() == d.storage_offset() + (self.end - M) * d.stride(2)


@dataclass(frozen=True)
class Window:
    """A time-axis tensor `rows` [B, L, M, D] (L layers or groups), the arena it is the
    newest window of, if any, and the precision its new rows are rounded to as they are
    appended (`model.state.precision`)."""

    rows: torch.Tensor
    arena: Arena | None = None
    precision: str = "float32"

    def grow(
        self, T: int, in_place: bool, time_major: bool = False, readied: Readied | None = None
    ) -> Growth:
        """Make space for T new rows per layer, in place (`model.family.Execution`), into the
        arena `readied` says (`readied`, a compiled step's), or functionally; `time_major`
        picks the layout of a new arena (see `Arena`)."""
        if (in_place or readied is not None) and torch.is_grad_enabled():
            raise RuntimeError("a state grows in place only without autograd: run this forward functionally")
        return Growth(self, T, in_place, time_major, readied)

    def readied(self, T: int, keep: int, time_major: bool = False) -> tuple[Readied, Arena]:
        """This window readied for a compiled step that appends T rows per layer and keeps the
        last `keep` rows (see `Readied`), and the arena it will then be a view of. Runs
        outside the graph: the arena's rows are claimed now."""
        arena, start = ready(self, T, time_major)
        end = start + self.rows.shape[2] + T
        after = arena.data[:, :, end - keep : end]
        return Readied(arena.layers, start, after), arena


def ready(window: Window, T: int, time_major: bool) -> tuple[Arena, int]:
    """The arena `window` appends T rows per layer to in place, and the row the window starts
    at in it: its own, where it is the arena's newest window with T spare rows after it; else
    a new one with the window copied in. The T rows are claimed: no other view of the arena
    can append to them."""
    old, arena = window.rows, window.arena
    M = old.shape[2]
    if (
        arena is None
        or arena.time_major != time_major
        or not arena.holds(old)
        or arena.end + T > arena.data.shape[2]
    ):
        data = Arena.empty(old, M + T + max(T, ARENA_SLACK), time_major)
        data[:, :, :M] = old
        arena = Arena(data, M, time_major)
    start = arena.end - M
    arena.end += T
    return arena, start


@dataclass(frozen=True)
class Readied:
    """A window made ready, outside a compiled graph, for the graph to append to in place:
    the arena's layers as tensors of their own ([B, capacity, D] views, one per layer), the
    row the window starts at in them, and the window the step leaves ([B, L, keep, D], a
    view of the arena over rows the step writes). Inductor writes a slice of a graph input
    in place when the input is that layer's own tensor, but copies the whole arena every
    call when the layer is a view taken inside the graph of one [B, L, capacity, D] input
    (`bench/compiled_window.py` measures what it saves); the rest of the bookkeeping
    (whether the arena has room, which rows are claimed) is Python a graph cannot hold."""

    layers: tuple[torch.Tensor, ...]
    start: int
    after: torch.Tensor


class Growth:
    """One append of T rows to each layer of a `Window`: `append(i, rows)` per layer (all T
    rows at once, or a few at a time), then `result(keep)` for the window the next state
    carries."""

    def __init__(
        self, window: Window, T: int, in_place: bool, time_major: bool = False, readied: Readied | None = None
    ):
        old = window.rows
        M = old.shape[2]
        self.old, self.M, self.T, self.precision = old, M, T, window.precision
        self.arena: Arena | None = None
        self.readied = readied
        self.layers: tuple[torch.Tensor, ...] | None = None
        self.joined: list[torch.Tensor | None] = [None] * old.shape[1]
        self.filled = [0] * old.shape[1]  # new rows appended so far, per layer
        if readied is not None:  # (inside a compiled graph: the arena was readied outside it)
            self.layers, self.start = readied.layers, readied.start
        elif in_place:
            self.arena, self.start = ready(window, T, time_major)
            self.layers = self.arena.layers

    def append(self, i: int, rows: torch.Tensor) -> torch.Tensor:
        """Add n of layer i's new rows [B, n, D], rounded to the window's precision; returns its
        old rows then every new row so far [B, M+filled, D], as stored: a query that attends
        to them sees its own chunk's rows exactly as a later request will."""
        rows = snap(rows, self.precision)
        n = rows.shape[1]
        filled = self.filled[i] = self.filled[i] + n
        if filled > self.T:
            raise RuntimeError(f"Growth of {self.T} rows: layer {i} got {filled}")
        if self.layers is None:
            before = self.joined[i]
            joined = torch.cat([self.old[:, i] if before is None else before, rows.to(self.old.dtype)], 1)
            self.joined[i] = joined
            return joined
        end = self.start + self.M + filled
        layer = self.layers[i]
        layer.narrow(1, end - n, n).copy_(rows)
        return layer.narrow(1, self.start, end - self.start)

    def result(self, keep: int) -> Window:
        """The last `keep` rows of every layer, once all layers have appended."""
        if any(f != self.T for f in self.filled):
            raise RuntimeError("Growth.result() before every layer appended")
        if self.readied is not None:
            after = self.readied.after
            if keep != after.shape[2]:
                raise RuntimeError(f"a window readied to keep {after.shape[2]} rows, asked for {keep}")
            return Window(after, precision=self.precision)
        if self.arena is not None:
            end = self.start + self.M + self.T
            return Window(self.arena.data[:, :, end - keep : end], self.arena)
        B, L, _, D = self.old.shape
        if L == 0:
            return Window(self.old.new_empty(B, 0, keep, D))
        parts = [j[:, j.shape[1] - keep :] for j in self.joined if j is not None]
        return Window(torch.stack(parts, 1))


def unzip(windows: Mapping[str, Window]) -> tuple[dict[str, torch.Tensor], dict[str, Arena]]:
    """A new state's grown windows, by name -> (its tensors, the arenas behind them)."""
    tensors = {name: w.rows for name, w in windows.items()}
    return tensors, {name: w.arena for name, w in windows.items() if w.arena is not None}


def kv_appender(
    k: Growth, v: Growth, i: int
) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """For attention layer i: append its new keys and values, get back all of them."""
    return lambda k_new, v_new: (k.append(i, k_new), v.append(i, v_new))
