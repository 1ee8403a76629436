"""The byte format of a state, the single source of truth for it (`FORMAT_VERSION`).

A safetensors file whose `__metadata__["recur"]` holds a JSON header
    {"format": FORMAT_VERSION, "family", "fingerprint", "precision", "dtype", "shapes",
     "checksum", "n_tokens", "delta": null | {"base_n_tokens", "lengths": {name: [dim, length]}}}
`checksum` is a BLAKE2b digest over every tensor's name, dtype, shape and raw bytes, so
flipped bits anywhere in the payload are caught, not just a malformed header.

`precision` is the state's own (`model.state.precision`): a state kept at bfloat16 or int8
stores its caches (its time-axis tensors) in that compact form, an int8 cache `k` as `k`
and its exponents `k.exp`, from which they are rebuilt bit for bit. `dtype` is what its
other float tensors are stored in (float32, unless an export asked for less). Format 1,
which had no precision (float32), is still read.

A *snapshot* (`delta` null) holds the whole persistent state. A *delta* holds only what
changed since the stream had consumed `base_n_tokens` tokens: the rows appended to each
time-axis tensor and the small fixed-size tensors in full, so its size grows with the
number of new tokens, never with the state's size. `merge(snapshot, deltas)` rebuilds the
exact state. This relies on the one rule every family's time-axis tensors keep: each gains
exactly one row per consumed token up to its bound, and then either slides (older rows fall
off) or, for the tensors named in `fills`, stops (it keeps the first tokens' rows: attention
sinks). Either way the rows a delta carries are the tensor's last ones.

A blob is checked against caps before its payload is parsed (`peek`). Nothing here ever
unpickles anything.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from . import precision as grid

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)  # 1: before a state had a precision (float32 caches)

STORAGE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class StateError(ValueError):
    """A state blob that cannot be used with this model: wrong model, damaged, or malformed."""


def checksum_of(tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        # its bytes as they lie (a uint8 view: bf16 has no numpy dtype), not a copy: hashing
        # lets go of the GIL, a copy would hold it for 47 MB
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


class Serialisable(Protocol):
    """What a state offers to be written (`protocol.State` does): this module owns the
    format, and needs nothing else of a state, so it does not import it."""

    @property
    def family(self) -> str: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def tensors(self) -> Mapping[str, torch.Tensor]: ...
    @property
    def seq_dims(self) -> Mapping[str, int]: ...
    @property
    def persistent(self) -> tuple[str, ...]: ...
    @property
    def fills(self) -> tuple[str, ...]: ...
    @property
    def n_tokens(self) -> torch.Tensor: ...
    @property
    def precision(self) -> str: ...


def serialise(state: Serialisable, dtype: str | torch.dtype, since: int | None) -> bytes:
    """`state`'s persistent tensors as bytes: a snapshot (`since` None), or a delta of what
    changed since it had consumed `since` tokens (`State.to_bytes`, `State.delta_bytes`).
    A state kept at a precision stores its caches in its compact form (`precision.pack`);
    its other float tensors, and a float32 state's caches, are stored in `dtype`."""
    store_dtype = STORAGE_DTYPES[dtype] if isinstance(dtype, str) else dtype
    dtype_name = next(k for k, v in STORAGE_DTYPES.items() if v == store_dtype)
    precision = grid.check(state.precision)
    tensors, lengths = {}, {}
    on_gpu = any(t.is_cuda for t in state.tensors.values())
    for name in state.persistent or tuple(state.tensors):
        t = state.tensors[name].detach()
        dim = state.seq_dims.get(name)
        if since is not None and dim is not None:
            length = t.shape[dim]
            if name in state.fills:  # rows since..length-1 are new; a full one gains none
                new_rows = max(length - since, 0)
            else:  # a sliding window's last rows, up to all of them
                new_rows = min(int(state.n_tokens[0]) - since, length)
            t = t.narrow(dim, length - new_rows, new_rows)
        if dim is not None and precision != "float32":
            parts = grid.pack(name, t, precision)
        else:
            parts = {name: t.to(store_dtype) if t.is_floating_point() else t}
        for part, p in parts.items():
            if since is not None and dim is not None:
                lengths[part] = [dim, length]
            if on_gpu:  # device -> pinned host copies, all queued before one synchronise
                host = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
                tensors[part] = host.copy_(p, non_blocking=True)
            else:
                tensors[part] = p.contiguous()
    if on_gpu:
        torch.cuda.synchronize()
    header = {
        "format": FORMAT_VERSION,
        "family": state.family,
        "fingerprint": state.fingerprint,
        "precision": precision,
        "dtype": dtype_name,
        "n_tokens": state.n_tokens.tolist(),
        "shapes": {k: list(v.shape) for k, v in tensors.items()},
        "checksum": checksum_of(tensors),
        "delta": None if since is None else {"base_n_tokens": since, "lengths": lengths},
    }
    return st_save(tensors, metadata={"recur": json.dumps(header, sort_keys=True)})


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
        if (
            not isinstance(dtype, str)
            or not isinstance(shape, list)
            or not all(isinstance(d, int) and d >= 0 for d in shape)
        ):
            raise StateError(f"state blob's header describes tensor {name!r} badly")
        tensors[name] = (dtype, shape)
    if not isinstance(meta, dict) or not isinstance(meta.get("recur"), str):
        raise StateError("state blob has no recur header")
    header = _json_object(meta["recur"].encode(), "state header")
    if header.get("format") not in READABLE_FORMATS:
        raise StateError(
            f"unsupported state format {header.get('format')!r} (this build reads "
            f"{', '.join(map(str, READABLE_FORMATS))})"
        )
    if precision_of(header) not in grid.PRECISIONS:
        raise StateError(
            f"unknown state precision {header.get('precision')!r} (one of {', '.join(grid.PRECISIONS)})"
        )
    return Declared(header, tensors)


def precision_of(header: dict) -> str:
    """The precision a blob's header declares (format 1 had none: float32)."""
    return header.get("precision", "float32") if header.get("format") != 1 else "float32"


def as_held(
    declared: Declared, persistent: Iterable[str], caches: Iterable[str]
) -> dict[str, tuple[str, list[int]]]:
    """The tensors a blob declares (safetensors' dtype, shape), as the state will hold them:
    each of its `caches` stored in the form of the blob's precision (`precision.pack`) is
    checked against that form and given as the float32 tensor it becomes. Raises StateError
    unless the blob holds exactly the `persistent` tensors, in that form."""
    precision, t = precision_of(declared.header), declared.tensors
    caches = set(caches) if precision != "float32" else set()
    names = {
        part
        for name in persistent
        for part in grid.packed_names(name, precision if name in caches else "float32")
    }
    if set(t) != names:
        raise StateError(f"state holds tensors {sorted(t)}, expected {sorted(names)}")
    held = {}
    for name in persistent:
        if name not in caches:
            held[name] = t[name]
            continue
        shape, why = grid.declared_cache(name, t, precision)
        if why:
            raise StateError(why)
        held[name] = ("F32", shape)
    return held


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
            raise StateError(
                f"state header says {name} has shape {shapes[name]}, payload has {list(t.shape)}"
            )
    if header.get("checksum") != checksum_of(tensors):
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
    (each blob's declared tensors first checked by `expect`, as `read_blob` does). An int8
    state's caches come back as the float32 tensors it computed with (`precision.unpack`)."""
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
        if precision_of(dh) != precision_of(header):
            raise StateError("a delta holds a different precision than its snapshot")
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
    return header, _unpacked(tensors, precision_of(header))


def _unpacked(tensors: dict[str, torch.Tensor], precision: str) -> dict[str, torch.Tensor]:
    """Tensors as stored -> the state's: an int8 cache (the names with exponents) in float32."""
    if precision != "int8":
        return tensors
    scales = {name for name in tensors if name.endswith(grid.SCALE_SUFFIX)}
    out = {}
    for name, t in tensors.items():
        if name in scales:
            continue
        if name + grid.SCALE_SUFFIX in scales:
            try:
                t = grid.unpack(name, tensors, precision)
            except RuntimeError as exc:  # shapes that do not match (a caller checked none)
                raise StateError(f"state {name} and its exponents do not match: {exc}") from None
        out[name] = t
    return out


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
