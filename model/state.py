"""The recurrent state protocol shared by every model family, and its byte format.

A `State` is a bag of named, batch-first tensors plus the identity of the model it
belongs to. Families decide which tensors exist; this module owns only what is common:
batching (stack / split), device moves, detaching (truncated BPTT), and serialisation.

Byte format (the single source of truth for it, `FORMAT_VERSION`):
a safetensors file whose `__metadata__["recur"]` holds a JSON header
    {"format": FORMAT_VERSION, "family", "fingerprint", "dtype", "shapes", "checksum",
     "n_tokens", "delta": null | {"base_n_tokens", "lengths": {name: [dim, length]}}}
`checksum` is a BLAKE2b digest over every tensor's name, dtype, shape and raw bytes, so
flipped bits anywhere in the payload are caught, not just a malformed header.

A *snapshot* (`delta` null) holds the whole persistent state. A *delta* holds only what
changed since the stream had consumed `base_n_tokens` tokens: the rows appended to each
time-axis tensor and the small fixed-size tensors in full, so its size grows with the
number of new tokens, never with the state's size. `merge(snapshot, deltas)` rebuilds the
exact state. This relies on the one rule every family's time-axis tensors keep: each gains
exactly one row per consumed token up to its bound, and then either slides (older rows fall
off) or, for the tensors named in `fills`, stops (it keeps the first tokens' rows: attention
sinks). Either way the rows a delta carries are the tensor's last ones.

Appending without copying (`Window`, `Growth`): a decode step adds one row to every
time-axis tensor. Built functionally (`torch.cat`, then slice the window) that step copies
each whole window, several times per layer. Outside autograd the families instead write
the new rows into an `Arena`, a buffer with spare rows after the window, and hand on a view
of it; the arena is copied only when its spare rows run out (once every `ARENA_SLACK`
steps). Rows an arena has handed out are never written again: a view may append in place
only while it ends exactly where the arena's claimed rows end, so two states grown from one
(a fork, a retried request) never write the same rows, and no view ever changes under its
holder. Every other `State` operation makes ordinary tensors.

This module must never unpickle anything, and knows nothing of HTTP or Redis.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

FORMAT_VERSION = 1
ARENA_SLACK = 64  # spare rows an arena gets beyond the window it was made for

STORAGE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class StateError(ValueError):
    """A state blob that cannot be used with this model: wrong model, damaged, or malformed."""


def _digest(tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        # view as bytes without going through numpy (bf16 has no numpy dtype)
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


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
        """The time-axis tensor `name` [B, L, M, D], ready to grow (see `Window`)."""
        return Window(self.tensors[name], self.arenas.get(name))

    def _holding(self, tensors: dict[str, torch.Tensor], arenas: dict[str, Arena] | None = None) -> State:
        """A state of the same model and layout holding `tensors` (new tensors: no arenas)."""
        return State(
            self.family, self.fingerprint, tensors, self.seq_dims, self.persistent, arenas or {}, self.fills
        )

    def replace(self, **tensors: torch.Tensor) -> State:
        return self._holding({**self.tensors, **tensors}, self.arenas)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> State:
        return self._holding({k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors.items()})

    def clone(self) -> State:
        return self._holding({k: v.clone() for k, v in self.tensors.items()})

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
    def stack(states: Iterable[State]) -> State:
        """Concatenate single- or multi-stream states along the batch axis.

        Tensors in `seq_dims` are left-padded with zeros to the longest; the family's
        validity counters (which are ordinary tensors) say which rows are real. A tensor
        that some of the states lack (a cache one holds and another, loaded from bytes, does
        not yet) is left out: the family recomputes it.
        """
        states = list(states)
        if not states:
            raise ValueError("stack() needs at least one state")
        first = states[0]
        for s in states[1:]:
            if s.fingerprint != first.fingerprint:
                raise StateError("cannot batch states of different models")
        out: dict[str, torch.Tensor] = {}
        for name in [n for n in first.tensors if all(n in s.tensors for s in states)]:
            parts = [s.tensors[name] for s in states]
            dim = first.seq_dims.get(name)
            if dim is not None:
                longest = max(p.shape[dim] for p in parts)
                parts = [_left_pad(p, dim, longest) for p in parts]
            out[name] = torch.cat(parts, 0)
        return first._holding(out)

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
        return self._serialise(dtype, since=None)

    def delta_bytes(self, since: int, dtype: str | torch.dtype = "float32") -> bytes:
        """Serialise what changed since this single stream had consumed `since` tokens."""
        if self.batch_size != 1:
            raise ValueError("delta_bytes() is for single-stream states")
        if not 0 <= since <= int(self.n_tokens[0]):
            raise ValueError(f"since={since} is outside 0..{int(self.n_tokens[0])}")
        return self._serialise(dtype, since=since)

    def _serialise(self, dtype: str | torch.dtype, since: int | None) -> bytes:
        store_dtype = STORAGE_DTYPES[dtype] if isinstance(dtype, str) else dtype
        dtype_name = next(k for k, v in STORAGE_DTYPES.items() if v == store_dtype)
        tensors, lengths = {}, {}
        on_gpu = any(t.is_cuda for t in self.tensors.values())
        for name in self.persistent or tuple(self.tensors):
            t = self.tensors[name].detach()
            dim = self.seq_dims.get(name)
            if since is not None and dim is not None:
                length = t.shape[dim]
                if name in self.fills:  # rows since..length-1 are new; a full one gains none
                    new_rows = max(length - since, 0)
                else:  # a sliding window's last rows, up to all of them
                    new_rows = min(int(self.n_tokens[0]) - since, length)
                t = t.narrow(dim, length - new_rows, new_rows)
                lengths[name] = [dim, length]
            if t.is_floating_point():
                t = t.to(store_dtype)
            if on_gpu:  # device -> pinned host copies, all queued before one synchronise
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                tensors[name] = host.copy_(t, non_blocking=True)
            else:
                tensors[name] = t.contiguous()
        if on_gpu:
            torch.cuda.synchronize()
        header = {
            "format": FORMAT_VERSION,
            "family": self.family,
            "fingerprint": self.fingerprint,
            "dtype": dtype_name,
            "n_tokens": self.n_tokens.tolist(),
            "shapes": {k: list(v.shape) for k, v in tensors.items()},
            "checksum": _digest(tensors),
            "delta": None if since is None else {"base_n_tokens": since, "lengths": lengths},
        }
        return st_save(tensors, metadata={"recur": json.dumps(header, sort_keys=True)})


@dataclass(frozen=True)
class Persist:
    """How a commit stores a single-stream state. `since` None: a snapshot. Else a delta
    of what changed since the stored state's `since` tokens, unless it would exceed
    `delta_budget` bytes (what the stored deltas may still grow before reading them back
    costs more than one snapshot): then a snapshot, which also replaces the deltas."""

    dtype: str = "float32"
    since: int | None = None
    delta_budget: int = 0


@dataclass(frozen=True)
class Encoded:
    """A state's bytes as a commit writes them."""

    kind: Literal["snapshot", "delta"]
    blob: bytes


def encode(state: State, persist: Persist) -> Encoded:
    """The bytes a commit of `state` writes, as `persist` asks: a pure function of the state."""
    if persist.since is not None:
        delta = state.delta_bytes(persist.since, persist.dtype)
        if len(delta) <= persist.delta_budget:
            return Encoded("delta", delta)
    return Encoded("snapshot", state.to_bytes(persist.dtype))


class Arena:
    """Rows [B, L, capacity, D] behind a time-axis tensor; rows before `end` are claimed.

    `time_major`: in memory, each (stream, layer)'s rows are laid out along time (a row's D
    values are `capacity` apart), layer by layer, so that a kernel scanning the time axis
    reads it contiguously and one layer's (stream, feature) rows are a single batch of
    equally spaced rows (a decode step's attention, `model.transformer_xl`). The tensor is
    the same."""

    __slots__ = ("data", "end", "time_major")

    def __init__(self, data: torch.Tensor, end: int, time_major: bool = False):
        self.data, self.end, self.time_major = data, end, time_major

    @staticmethod
    def empty(like: torch.Tensor, capacity: int, time_major: bool) -> torch.Tensor:
        """An uninitialised [B, L, capacity, D] buffer for rows like `like` [B, L, M, D]."""
        B, L, _, D = like.shape
        if time_major:  # (L, B, D, capacity) in memory
            return like.new_empty(L, B, D, capacity).permute(1, 0, 3, 2)
        return like.new_empty(B, L, capacity, D)

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
    """A time-axis tensor `rows` [B, L, M, D] (L layers or groups), and the arena it is the
    newest window of, if any."""

    rows: torch.Tensor
    arena: Arena | None = None

    def grow(self, T: int, in_place: bool, time_major: bool = False) -> Growth:
        """Make room for T new rows per layer. `in_place` must be False under autograd (the
        functional path keeps every step in the graph); `time_major` picks the layout of a
        new arena (see `Arena`)."""
        return Growth(self, T, in_place, time_major)


class Growth:
    """One append of T rows to each layer of a `Window`: `append(i, rows)` per layer (all T
    rows at once, or a few at a time), then `result(keep)` for the window the next state
    carries."""

    def __init__(self, window: Window, T: int, in_place: bool, time_major: bool = False):
        old = window.rows
        M = old.shape[2]
        self.old, self.M, self.T = old, M, T
        self.arena: Arena | None = None
        self.joined: list[torch.Tensor | None] = [None] * old.shape[1]
        self.filled = [0] * old.shape[1]  # new rows appended so far, per layer
        if not in_place:
            return
        arena = window.arena
        if (
            arena is None
            or arena.time_major != time_major
            or not arena.holds(old)
            or arena.end + T > arena.data.shape[2]
        ):
            data = Arena.empty(old, M + T + max(T, ARENA_SLACK), time_major)
            data[:, :, :M] = old
            arena = Arena(data, M, time_major)
        self.arena, self.start = arena, arena.end - M
        self.layers = arena.data.unbind(1)  # [B, capacity, D] per layer
        arena.end += T  # claimed now: no other view of this arena can append to these rows

    def append(self, i: int, rows: torch.Tensor) -> torch.Tensor:
        """Add n of layer i's new rows [B, n, D]; returns its old rows then every new row so
        far [B, M+filled, D]."""
        n = rows.shape[1]
        filled = self.filled[i] = self.filled[i] + n
        if filled > self.T:
            raise RuntimeError(f"Growth of {self.T} rows: layer {i} got {filled}")
        if self.arena is None:
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


# Caps a blob must meet before its payload is parsed: a real state's safetensors header is
# about a kilobyte and holds a few tensors, and a header past these is refused before the
# parser (whose time and memory grow with it) ever sees it.
MAX_HEADER_BYTES = 1 << 16
MAX_TENSORS = 64
MAX_JSON_DEPTH = 8  # the recur header nests 3 deep; the safetensors header 2


@dataclass(frozen=True)
class Declared:
    """What a blob's safetensors header declares, read without parsing its payload: the
    recur header, and each tensor's dtype (safetensors' name, e.g. "F32") and shape."""

    header: dict
    tensors: dict[str, tuple[str, list[int]]]


def peek(blob: bytes) -> Declared:
    """The headers of a state blob, checked against the caps above, without loading a
    tensor: cheap enough for any thread. Raises StateError."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise StateError(f"state must be bytes, not {type(blob).__name__}")
    if len(blob) < 8:
        raise StateError("state blob is truncated (shorter than its length prefix)")
    n = int.from_bytes(blob[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise StateError(f"state blob's header is {n} bytes; a state's is at most {MAX_HEADER_BYTES}")
    if 8 + n > len(blob):
        raise StateError("state blob is truncated (shorter than its header)")
    outer = _json_object(bytes(blob[8 : 8 + n]), "safetensors header")
    meta = outer.pop("__metadata__", None) or {}
    if len(outer) > MAX_TENSORS:
        raise StateError(f"state blob holds {len(outer)} tensors; a state holds at most {MAX_TENSORS}")
    tensors = {}
    for name, info in outer.items():
        dtype, shape = info.get("dtype") if isinstance(info, dict) else None, None
        if isinstance(info, dict):
            shape = info.get("shape")
        if not isinstance(dtype, str) or not isinstance(shape, list) or not all(
            isinstance(d, int) and d >= 0 for d in shape
        ):
            raise StateError(f"state blob's header describes tensor {name!r} badly")
        tensors[name] = (dtype, shape)
    if not isinstance(meta, dict) or not isinstance(meta.get("recur"), str):
        raise StateError("state blob has no recur header")
    header = _json_object(meta["recur"].encode(), "state header")
    if header.get("format") != FORMAT_VERSION:
        raise StateError(f"unsupported state format {header.get('format')!r} (this build reads {FORMAT_VERSION})")
    return Declared(header, tensors)


def read_blob(
    blob: bytes, expect: Callable[[Declared], None] | None = None
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Parse and verify a state blob: returns (header, tensors). Raises StateError.

    Checks the caps on its header (`peek`), then what `expect` demands of the declared
    tensors (a model's layout: so a blob that could never fit is refused before its
    payload is loaded), then the container, the header's claims against the tensors
    actually present, and the checksum. Whether the tensors fit a particular model is
    `LanguageModel.load_state`'s job.
    """
    declared = peek(blob)
    if expect is not None:
        expect(declared)
    blob = bytes(blob)
    try:
        tensors = st_load(blob)
    except (SafetensorError, ValueError, RuntimeError, OverflowError) as exc:
        raise StateError(f"state blob is not a valid safetensors payload: {exc}") from None
    header = declared.header
    shapes = header.get("shapes")
    if not isinstance(shapes, dict) or set(shapes) != set(tensors):
        raise StateError("state header lists different tensors than the payload holds")
    for name, t in tensors.items():
        if list(t.shape) != shapes[name]:
            raise StateError(f"state header says {name} has shape {shapes[name]}, payload has {list(t.shape)}")
    if header.get("checksum") != _digest(tensors):
        raise StateError("state checksum mismatch: the blob is corrupted")
    if header.get("dtype") not in STORAGE_DTYPES:
        raise StateError(f"unknown state dtype {header.get('dtype')!r}")
    if "n_tokens" not in tensors:
        raise StateError("state blob has no n_tokens")
    return header, tensors


def merge(
    snapshot: bytes, deltas: Iterable[bytes] = (), expect: Callable[[Declared], None] | None = None
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Rebuild (header, tensors) of the state a snapshot plus its deltas, in order, describe
    (each blob's declared tensors first checked by `expect`, as `read_blob` does)."""
    header, tensors = read_blob(snapshot, expect)
    if header.get("delta") is not None:
        raise StateError("the first blob of a state must be a snapshot, not a delta")
    for blob in deltas:
        dh, dt = read_blob(blob, expect)
        delta = dh.get("delta")
        if delta is None:
            raise StateError("expected a delta blob, got a snapshot")
        if (dh.get("family"), dh.get("fingerprint")) != (header.get("family"), header.get("fingerprint")):
            raise StateError("a delta belongs to a different model than its snapshot")
        if delta.get("base_n_tokens") != tensors["n_tokens"].tolist()[0]:
            raise StateError(
                f"delta starts at token {delta.get('base_n_tokens')}, the state is at {tensors['n_tokens'].tolist()}"
            )
        lengths = delta.get("lengths") or {}
        if set(dt) != set(tensors):
            raise StateError("a delta holds different tensors than its snapshot")
        for name, rows in dt.items():
            base = tensors[name]
            if name in lengths:
                dim, length = lengths[name]
                joined = torch.cat([base, rows.to(base.dtype)], dim)
                if joined.shape[dim] < length:
                    raise StateError(f"delta for {name} leaves fewer rows than it claims")
                tensors[name] = joined.narrow(dim, joined.shape[dim] - length, length)
            else:
                tensors[name] = rows.to(base.dtype) if rows.is_floating_point() else rows
        header = {**header, "n_tokens": dh.get("n_tokens")}
    return header, tensors


def _json_object(raw: bytes, what: str) -> dict:
    """A JSON object nested at most MAX_JSON_DEPTH deep, or StateError (never a RecursionError:
    the text is bounded by MAX_HEADER_BYTES, and the depth is checked before parsing)."""
    if _nesting(raw) > MAX_JSON_DEPTH:
        raise StateError(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        raise StateError(f"{what} is not valid JSON") from None
    if not isinstance(value, dict):
        raise StateError(f"{what} is not a JSON object")
    return value


def _nesting(raw: bytes) -> int:
    """How deep the brackets of JSON text nest (those inside strings included: an upper
    bound, which is all a refusal needs)."""
    depth = deepest = 0
    for c in raw.translate(None, _NOT_BRACKETS):
        depth += 1 if c in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def _left_pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    missing = size - t.shape[dim]
    if missing == 0:
        return t
    pad_shape = list(t.shape)
    pad_shape[dim] = missing
    return torch.cat([t.new_zeros(pad_shape), t], dim)
