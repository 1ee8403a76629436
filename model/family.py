"""The interface every model family implements, and the generic operations built on it.

A family is an `nn.Module` subclass of `LanguageModel` with a config dataclass. The
server (`app/`) only ever talks to this interface: it never imports a family module,
so adding a family never touches `app/`.

The contract a family must keep:
  * `forward(tokens [B,T], state) -> (logits [B,T,V], state')` consumes every token once;
  * `state'` carries everything needed for the next token's distribution, which
    `next_logits(state')` returns without recomputing anything;
  * feeding a stream in any chunking gives the same logits (the family documents any
    exception, e.g. segment-dependent attention for pretrained checkpoints).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .state import State, StateError, merge
from .tokenizer import Tokenizer


class LanguageModel(nn.Module):
    family: ClassVar[str]
    config_class: ClassVar[type]

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.tokenizer: Tokenizer | None = None
        self.fingerprint = "unset"
        # bf16 autocast is used only on CUDA; CPU always computes in fp32
        self.precision = "fp32"
        # outside autograd, time-axis tensors grow in place (`model.state.Growth`); False
        # builds every step functionally (the benchmarks' baseline; the same results)
        self.append_in_place = True

    # -- to implement -------------------------------------------------------------------
    def new_state(self, batch_size: int = 1) -> State:
        raise NotImplementedError

    def forward(self, tokens: torch.Tensor, state: State | None = None) -> tuple[torch.Tensor, State]:
        raise NotImplementedError

    def next_logits(self, state: State) -> torch.Tensor:
        """Logits [B, V] for the token after everything `state` has consumed."""
        raise NotImplementedError

    def state_lengths(self, state: State) -> dict[str, torch.Tensor]:
        """Per-row valid lengths of the tensors in `state.seq_dims` (for `split_state`)."""
        raise NotImplementedError

    def check_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Raise StateError unless these persistent tensors fit this model's shapes."""
        raise NotImplementedError

    def rebuild_state(self, tensors: dict[str, torch.Tensor]) -> State:
        """Turn verified persistent tensors into a live state (recomputing any caches)."""
        raise NotImplementedError

    # -- shared behaviour -----------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def segment_len(self) -> int:
        """Chunk size for consuming long inputs. For families whose results do not depend
        on chunking this only bounds activation memory."""
        return int(getattr(self.config, "tgt_len", 512))

    def config_dict(self) -> dict:
        return dataclasses.asdict(self.config)

    def grows_in_place(self) -> bool:
        return self.append_in_place and not torch.is_grad_enabled()

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.device.type == "cuda" and self.precision == "bf16":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def load_state(self, blob: bytes, deltas: Iterable[bytes] = ()) -> State:
        """Bytes (a snapshot, then any deltas in order) -> State for this model.

        Raises StateError with a clear message for a state of another model, or truncated,
        corrupted or malformed bytes.
        """
        header, tensors = merge(blob, deltas)
        if header.get("family") != self.family:
            raise StateError(f"state is for model family {header.get('family')!r}, this model is {self.family!r}")
        if header.get("fingerprint") != self.fingerprint:
            raise StateError(
                f"state was made by model {header.get('fingerprint')!r}, this is {self.fingerprint!r}"
            )
        self.check_state_tensors(tensors)
        param_dtype = next(self.parameters()).dtype
        on_gpu = self.device.type == "cuda"
        moved = {}
        for k, v in tensors.items():
            if on_gpu:  # pinned host memory lets the copy run asynchronously
                v = v.pin_memory()
            v = v.to(self.device, non_blocking=on_gpu)
            moved[k] = v.to(param_dtype) if v.is_floating_point() else v
        return self.rebuild_state(moved)

    def stack_states(self, states: list[State]) -> State:
        return State.stack(states)

    def split_state(self, state: State) -> list[State]:
        return state.split(self.state_lengths(state))

    def prefill(
        self, ids: torch.Tensor, state: State, logprobs: bool = False
    ) -> tuple[torch.Tensor | None, State]:
        """Teacher-force one chunk `ids` [B, T] (T <= `segment_len`) into `state`: the one
        prefill step, shared by `consume` and the server's scheduler.

        Returns (logprobs [B, T] or None, state'). logprobs[:, i] is log p(ids[:, i] |
        everything before it); for i = 0 it comes from `next_logits(state)`, and is NaN for
        a stream that has consumed nothing (no context, no distribution).
        """
        out = None
        if logprobs:
            out = torch.empty(ids.shape, device=ids.device)
            first = F.log_softmax(self.next_logits(state).float(), -1).gather(1, ids[:, :1])[:, 0]
            out[:, 0] = torch.where(state.n_tokens > 0, first, torch.full_like(first, float("nan")))
        logits, state = self(ids, state)
        if out is not None:
            # logits at position i predict token i+1
            lp = F.log_softmax(logits[:, :-1].float(), -1)
            out[:, 1:] = lp.gather(2, ids[:, 1:, None])[..., 0]
        return out, state

    @torch.no_grad()
    def consume(self, tokens: list[int] | torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        """Teacher-force `tokens` into a single- or multi-stream state, `segment_len` tokens
        at a time (`prefill`). Returns (logprobs [B, T], state'), as `prefill` defines them."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        if ids.dim() == 1:
            ids = ids[None]
        parts = []
        for start in range(0, ids.shape[1], self.segment_len):
            lp, state = self.prefill(ids[:, start : start + self.segment_len], state, logprobs=True)
            assert lp is not None
            parts.append(lp)
        out = torch.cat(parts, 1) if parts else torch.empty(ids.shape, device=self.device)
        return out, state
