"""The recurrent state protocol shared by every model family.

A `State` is a bag of named, batch-first tensors plus the identity of the model it
belongs to. Families decide which tensors exist; this module owns only what is common:
batching (stack / split), device moves, detaching (truncated BPTT), and its bytes (the
format is blob.py's).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from .arena import Arena, Window, huge_pages
from .blob import StateError, serialise


@dataclass
class State:
    """Per-stream recurrent state: batch-first tensors for `batch_size` independent streams.

    `seq_dims` names the tensors that grow along a time axis up to a bound (the family's
    memory); rows shorter than the batch's longest are left-padded, and the family masks
    the padding. `persistent` names the tensors that are serialised; anything else is a
    cache the family can rebuild from the persistent ones (`LanguageModel.load_state`).
    """

    family: str
    fingerprint: str
    tensors: dict[str, torch.Tensor]
    seq_dims: dict[str, int] = field(default_factory=dict)
    persistent: tuple[str, ...] = ()
    # arenas the time-axis tensors are views of (see `Window`): never serialised, and
    # dropped by every operation that makes new tensors
    arenas: dict[str, Arena] = field(default_factory=dict, repr=False, compare=False)
    # the time-axis tensors that fill and then stop rather than slide (see the module's docstring)
    fills: tuple[str, ...] = ()
    # the grid its persistent time-axis tensors (its caches) lie on, kept as each row is
    # appended (`model.state.precision`): a property of the state, which its bytes record
    precision: str = "float32"

    # -- basic properties -------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return int(self.tensors["n_tokens"].shape[0])

    @property
    def n_tokens(self) -> torch.Tensor:
        """Tokens consumed so far, per stream: LongTensor [B]."""
        return self.tensors["n_tokens"]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def window(self, name: str) -> Window:
        """The time-axis tensor `name` [B, L, M, D], ready to grow (see `Window`): a cache that
        is stored grows by rows rounded to the state's precision, a derived one by rows as given."""
        precision = self.precision if name in self.persistent else "float32"
        return Window(self.tensors[name], self.arenas.get(name), precision)

    def _holding(self, tensors: dict[str, torch.Tensor], arenas: dict[str, Arena] | None = None) -> State:
        """A state of the same model and layout holding `tensors` (new tensors: no arenas)."""
        return State(
            self.family,
            self.fingerprint,
            tensors,
            self.seq_dims,
            self.persistent,
            arenas or {},
            self.fills,
            self.precision,
        )

    def replace(self, **tensors: torch.Tensor) -> State:
        return self._holding({**self.tensors, **tensors}, self.arenas)

    def with_arenas(self, arenas: dict[str, Arena]) -> State:
        """The same tensors, with `arenas` the arenas behind them (none: `{}`)."""
        return self._holding(self.tensors, arenas)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> State:
        return self._holding({k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors.items()})

    def clone(self) -> State:
        return self._holding({k: v.clone() for k, v in self.tensors.items()})

    def plain(self) -> State:
        """This state in contiguous tensors and no arenas: one memory layout, whatever made
        it (a stack into arenas, an in-place step), for code traced on one (a compiled step)."""
        return self._holding({k: v.contiguous() for k, v in self.tensors.items()})

    def detach(self) -> State:
        """The same state with every tensor cut from the autograd graph (truncated BPTT)."""
        return self._holding({k: v.detach() for k, v in self.tensors.items()})

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def finite(self) -> bool:
        """Whether every float tensor holds only finite values (a step can turn huge but
        finite values into infinities and NaN: such a state must never be committed)."""
        return all(bool(torch.isfinite(t).all()) for t in self.tensors.values() if t.is_floating_point())

    def compact(self) -> State:
        """This state, or a copy whose tensors own exactly their memory. A row split off a
        batch (or a window narrowed out of an arena) is a view that keeps the whole storage
        alive while `nbytes()` counts only the view: a cache that keeps such a state would
        hold up to batch-size times its budget."""
        if all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in self.tensors.values()):
            return self
        return self.clone()

    # -- batching --------------------------------------------------------------------
    @staticmethod
    def stack(states: Iterable[State], layouts: Mapping[str, bool] | None = None) -> State:
        """Concatenate single- or multi-stream states along the batch axis.

        Tensors in `seq_dims` are left-padded with zeros to the longest; the family's
        validity counters (which are ordinary tensors) say which rows are real. A tensor
        that some of the states lack (a cache one holds and another, loaded from bytes, does
        not yet) is left out: the family recomputes it. The time-axis tensors named in
        `layouts` are stacked straight into an arena (`Arena.stacked`; the value: whether it
        is time-major), as the family's decode steps grow them.
        """
        states = list(states)
        if not states:
            raise ValueError("stack() needs at least one state")
        first = states[0]
        for s in states[1:]:
            if s.fingerprint != first.fingerprint:
                raise StateError("cannot batch states of different models")
            if s.precision != first.precision:
                raise StateError(f"cannot batch a {s.precision} state with a {first.precision} one")
        out: dict[str, torch.Tensor] = {}
        arenas: dict[str, Arena] = {}
        for name in [n for n in first.tensors if all(n in s.tensors for s in states)]:
            parts = [s.tensors[name] for s in states]
            dim = first.seq_dims.get(name)
            if dim is None:
                out[name] = _cat_rows(parts)
                continue
            longest = max(p.shape[dim] for p in parts)
            if layouts is not None and name in layouts and _arena_rows(parts, dim, longest):
                arenas[name] = Arena.stacked(parts, longest, layouts[name])
                out[name] = arenas[name].data[:, :, :longest]
            else:
                out[name] = _cat_rows([_left_pad(p, dim, longest) for p in parts])
        return first._holding(out, arenas)

    def split(self, lengths: Mapping[str, torch.Tensor] | None = None) -> list[State]:
        """Split into single-stream states. `lengths[name]` ([B]) trims left padding per row."""
        out = []
        for b in range(self.batch_size):
            tensors = {}
            for name, t in self.tensors.items():
                row = t[b : b + 1]
                dim = self.seq_dims.get(name)
                if dim is not None and lengths is not None and name in lengths:
                    keep = int(lengths[name][b])
                    row = row.narrow(dim, row.shape[dim] - keep, keep)
                tensors[name] = row
            out.append(self._holding(tensors))
        return out

    # -- bytes -----------------------------------------------------------------------
    def to_bytes(self, dtype: str | torch.dtype = "float32") -> bytes:
        """Serialise the persistent tensors (a snapshot). Float tensors are stored in `dtype`."""
        return serialise(self, dtype, since=None)

    def delta_bytes(self, since: int, dtype: str | torch.dtype = "float32") -> bytes:
        """Serialise what changed since this single stream had consumed `since` tokens."""
        if self.batch_size != 1:
            raise ValueError("delta_bytes() is for single-stream states")
        if not 0 <= since <= int(self.n_tokens[0]):
            raise ValueError(f"since={since} is outside 0..{int(self.n_tokens[0])}")
        return serialise(self, dtype, since=since)


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(parts, 0)`, into a buffer backed by huge pages (`huge_pages`: a batch's
    caches are the largest buffers a step fills) unless autograd follows the parts."""
    if any(p.requires_grad for p in parts):
        return torch.cat(parts, 0)
    dtype = functools.reduce(torch.promote_types, (p.dtype for p in parts))
    shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    return torch.cat(parts, 0, out=huge_pages(torch.empty(shape, dtype=dtype, device=parts[0].device)))


def _arena_rows(parts: list[torch.Tensor], dim: int, longest: int) -> bool:
    """Whether time-axis `parts` can be stacked into an arena: [B, L, M, D] rows along dim
    2, of one dtype, not followed by autograd, and not empty."""
    first = parts[0]
    return (
        dim == 2
        and longest > 0
        and first.dim() == 4
        and all(p.dtype == first.dtype and p.device == first.device and not p.requires_grad for p in parts)
    )


def _left_pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    missing = size - t.shape[dim]
    if missing == 0:
        return t
    pad_shape = list(t.shape)
    pad_shape[dim] = missing
    return torch.cat([t.new_zeros(pad_shape), t], dim)
