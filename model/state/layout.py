"""A family's state as data: its persistent tensors, the time axes that grow one row per
consumed token, and the fixed-size ones (`StateLayout`), with the checks every family's
state must pass before it runs, the size of the largest one, a fresh state's tensors and a
stored one's moved onto a model's device. A family declares its
layout (`LanguageModel.time_axes`, `fixed_shapes`, `persistent`); `LanguageModel.layout`
hands it here, and a family extends the checks with its own.

Nothing here runs a module: any thread may check a state (the engine's loader does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import precision as grid
from .blob import Declared, StateError, as_held
from .protocol import State


class TimeAxis(NamedTuple):
    """A state tensor [B, layers, M, width] along a time axis (dim 2) of at most `bound`
    rows, one per consumed token (`model.state`): a sliding window of the last tokens' rows,
    or, where it `fills`, the first tokens' rows, kept once the axis is full (attention
    sinks)."""

    layers: int
    width: int
    bound: int
    fills: bool = False


# safetensors' names of the dtypes a stored state's tensors may have
_STORED_FLOATS = ("F32", "BF16", "F16")


@dataclass(frozen=True)
class StateLayout:
    family: str
    fingerprint: str
    persistent: tuple[str, ...]  # the tensors a stored state holds, n_tokens among them
    axes: dict[str, TimeAxis]
    fixed: dict[str, tuple[int, ...]]  # the fixed tensors' shapes, but for the batch
    max_stream_tokens: int

    def lengths(self, n_tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-row valid lengths of the time axes, for streams that consumed `n_tokens`."""
        return {name: n_tokens.clamp(max=axis.bound) for name, axis in self.axes.items()}

    def fresh(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The tensors of a state for `batch_size` streams that have consumed nothing: empty
        time axes, zero fixed-size tensors, zero counts."""

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(batch_size, *shape, device=device, dtype=dtype)

        tensors = {name: zeros(axis.layers, 0, axis.width) for name, axis in self.axes.items()}
        tensors.update({name: zeros(*shape) for name, shape in self.fixed.items()})
        tensors["n_tokens"] = torch.zeros(batch_size, dtype=torch.long, device=device)
        return tensors

    def moved(
        self, tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype, snap_to: str | None
    ) -> dict[str, torch.Tensor]:
        """Verified tensors on `device`, floats at `dtype`, and where `snap_to` names a
        precision (a state stored at another), the time axes rounded onto its grid."""
        on_gpu = device.type == "cuda"  # (pinned host memory lets the copy run asynchronously)
        moved = {}
        for k, v in tensors.items():
            v = (v.pin_memory() if on_gpu else v).to(device, non_blocking=on_gpu)
            moved[k] = v.to(dtype) if v.is_floating_point() else v
            if snap_to is not None and k in self.axes:
                moved[k] = grid.snap(moved[k], snap_to)
        return moved

    def check(self, tensors: dict[str, torch.Tensor]) -> None:
        """Raise StateError unless these persistent tensors fit this layout: the names, a
        non-negative token count within the family's bound, every shape, memory lengths
        that fit the bound and the count, finite values."""
        if set(tensors) != set(self.persistent):
            raise StateError(f"state holds tensors {sorted(tensors)}, expected {sorted(self.persistent)}")
        n = tensors["n_tokens"]
        if n.dim() != 1 or n.dtype != torch.long or (n < 0).any():
            raise StateError("state n_tokens must be a non-negative int64 vector")
        if (n > self.max_stream_tokens).any():
            raise StateError(
                f"state n_tokens {int(n.max())} is past the most a stream of this model may consume "
                f"({self.max_stream_tokens})"
            )
        B = n.shape[0]
        if B < 1:
            raise StateError("state has an empty batch")
        for name in self.persistent:
            if name == "n_tokens":
                continue
            t = tensors[name]
            if not t.is_floating_point():
                raise StateError(f"state {name} must be floating point")
            self._check_shape(name, list(t.shape), B)
            if name in self.axes and t.shape[2] < int(n.clamp(max=self.axes[name].bound).max()):
                raise StateError(
                    f"state {name}: memory length {t.shape[2]} does not fit the bound "
                    f"{self.axes[name].bound} and n_tokens"
                )
        if not all(torch.isfinite(t).all() for name, t in tensors.items() if name != "n_tokens"):
            raise StateError("state holds non-finite values")

    def check_declared(self, declared: Declared) -> None:
        """Raise StateError unless the tensors a blob's header declares (a snapshot or a
        delta) could be this layout's state: its family and model, its names, a stored
        dtype, and shapes within the layout (a time axis's rows within its bound). Checked
        before the payload is loaded, so a blob's size cannot exceed what its batch of this
        model's states needs."""
        header = declared.header
        if header.get("family") != self.family:
            raise StateError(
                f"state is for model family {header.get('family')!r}, this model is {self.family!r}"
            )
        if header.get("fingerprint") != self.fingerprint:
            raise StateError(
                f"state was made by model {header.get('fingerprint')!r}, this is {self.fingerprint!r}"
            )
        # its caches (the persistent time axes) as the state holds them: float32
        t = as_held(declared, self.persistent, [name for name in self.persistent if name in self.axes])
        dtype, shape = t["n_tokens"]
        if dtype != "I64" or len(shape) != 1:
            raise StateError("state n_tokens must be a non-negative int64 vector")
        for name, (dtype, shape) in t.items():
            if name == "n_tokens":
                continue
            if dtype not in _STORED_FLOATS:
                raise StateError(
                    f"state {name} has dtype {dtype}, expected one of {', '.join(_STORED_FLOATS)}"
                )
            self._check_shape(name, shape, t["n_tokens"][1][0])

    def max_bytes(self) -> int:
        """The size of the largest snapshot of one stream (float32, every time axis at its
        bound, its headers included)."""
        tensors = {
            name: torch.zeros(1, self.axes[name].layers, self.axes[name].bound, self.axes[name].width)
            if name in self.axes
            else torch.zeros(1, *self.fixed[name])
            for name in self.persistent
            if name != "n_tokens"
        }
        tensors["n_tokens"] = torch.full((1,), self.max_stream_tokens, dtype=torch.long)
        return len(State(self.family, self.fingerprint, tensors, {}, self.persistent).to_bytes())

    def _check_shape(self, name: str, shape: list[int], B: int) -> None:
        """Raise StateError unless a state tensor of `shape` fits the layout for a batch of B:
        a time axis [B, layers, M, width] with M within its bound, a fixed tensor its shape."""
        if name not in self.axes:
            if shape != [B, *self.fixed[name]]:
                raise StateError(f"state {name} has shape {shape}, expected {[B, *self.fixed[name]]}")
            return
        axis = self.axes[name]
        if len(shape) != 4 or shape[0] != B or shape[1] != axis.layers or shape[3] != axis.width:
            raise StateError(
                f"state {name} has shape {shape}, expected [{B}, {axis.layers}, M, {axis.width}]"
            )
        if shape[2] > axis.bound:
            raise StateError(
                f"state {name}: memory length {shape[2]} does not fit the bound {axis.bound} and n_tokens"
            )
