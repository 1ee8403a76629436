"""The interface every model family implements, and the generic operations built on it.

A family is an `nn.Module` subclass of `LanguageModel` with a config dataclass. The
server (`app/`) only ever talks to this interface: it never imports a family module,
so adding a family never touches `app/`.

The contract a family must keep (it implements `advance`; `forward` gives it a fresh state
when there is none):
  * `forward(tokens [B,T], state) -> (logits [B,T,V], state')` consumes every token once
    (the logits [B,1,V], the last position's, where `how.last_logits`);
  * `state'` carries everything needed for the next token's distribution, which
    `next_logits(state')` returns without recomputing anything;
  * feeding a stream in any chunking gives the same logits (the family documents any
    exception, e.g. segment-dependent attention for pretrained checkpoints).

A family declares its state's layout (`time_axes`, `fixed_shapes`, `persistent`); from it
this module builds fresh states, checks loaded ones and finds each row's valid lengths, so
those are written once for every family. Weight init is shared too (GPT-2's).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .generation_config import GenerationConfig
from .state import Arena, Declared, Readied, State, merge
from .state import precision as grid
from .state.blob import precision_of
from .state.layout import StateLayout, TimeAxis
from .tokenizer import Tokenizer


class ContextFull(ValueError):
    """A chunk would take a stream past the most tokens its model keeps (an exact-attention
    hybrid's `max_context`): the request is refused, and the state consumed nothing of it."""


@dataclasses.dataclass(frozen=True)
class Execution:
    """How one forward runs, as its caller says (nothing is read from the surroundings):

    - `in_place`: whether it appends to its state's arenas in place (`model.state.Arena`),
      which only a forward without autograd and outside a graph being compiled may do (the
      arena's bookkeeping is Python over buffers the step mutates); else the state grows
      functionally, a new tensor per step, which autograd and a compiled graph follow;
    - `parts`: compiled versions of the family's `parts()`, by name, to run in place of its
      own (an RLT per-token step, say);
    - `readied`: time axes a caller readied for this forward outside a compiled graph
      (`model.state.Readied`, by name: `compiled_in_place` does it), which it appends to in
      place inside the graph;
    - `last_logits`: whether the caller reads only the last position's logits (a prefill
      without log-probs, which wants `next_logits` alone): the head then runs over that
      position only (`logit_rows`) and the logits come back [B, 1, V]. A head is one
      vocabulary-wide product per position (SmolLM2's: 49,152 x 576, a fifth of a prompt's
      FLOPs), which such a prefill would compute for every position and discard.

    `FUNCTIONAL` is what training and a graph a compiler traces need; `IN_PLACE` is
    `prefill`'s and `consume`'s, which never track gradients. `forward` called without one
    picks for itself (`untracked`): a user decoding through the library gets the fast path
    without knowing this class."""

    in_place: bool = False
    parts: Mapping[str, Callable] = dataclasses.field(default_factory=dict)
    readied: Mapping[str, Readied] = dataclasses.field(default_factory=dict)
    last_logits: bool = False

    def logit_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The positions of x [B, T, ...] whose logits this forward returns: all, or the last."""
        return x[:, -1:] if self.last_logits else x


FUNCTIONAL = Execution()
IN_PLACE = Execution(in_place=True)
# a forward as a step: tokens [B, T] and a state -> logits and the next state
Step = Callable[[torch.Tensor, State], tuple[torch.Tensor, State]]


class LanguageModel(nn.Module):
    family: ClassVar[str]
    config_class: ClassVar[type]
    # the state tensors that are serialised; the others are caches `rebuild_state` recomputes
    persistent: ClassVar[tuple[str, ...]]
    # config fields a server may set at load time (`with_options`): they change how the
    # weights are served (a span, a chunk size), never the weights
    serving_options: ClassVar[tuple[str, ...]] = ()
    # the most tokens a stream may have consumed: positions stay exact in float64 (RoPE's
    # angles) and n_tokens plus any chunk stays far from int64's overflow. A family whose
    # positions are bounded tighter says so here.
    max_stream_tokens: ClassVar[int] = 2**53
    # the precisions a family keeps its caches at, rounding each row as it is appended
    # (`set_state_dtype`): those whose state is a cache of keys and values say so
    cache_precisions: ClassVar[tuple[str, ...]] = ("float32",)

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.tokenizer: Tokenizer | None = None
        self.fingerprint = "unset"
        # "bf16": autocast on the model's device (CUDA, or CPU when asked); weights and states stay fp32
        self.precision = "fp32"
        self.generation_config = GenerationConfig()  # the checkpoint's recommended sampling (`load`)
        # the precision of the states it makes and steps (`set_state_dtype`)
        self.state_precision = "float32"
        self.register_state_dict_post_hook(_contiguous_state)

    @classmethod
    def without_init(cls, config: Any) -> LanguageModel:
        """The model with its weights uninitialised, for a reader to load them into: built on
        the meta device and given memory, which skips the random init (for a pretrained LLM,
        seconds of random numbers about to be overwritten). Non-persistent buffers are made
        again by each module's `reset_buffers`."""
        with torch.device("meta"):
            lm = cls(config)
        return _given_memory(lm)

    # -- to implement -------------------------------------------------------------------
    def time_axes(self) -> dict[str, TimeAxis]:
        """The state's time-axis tensors, by name (their time axis is dim 2)."""
        raise NotImplementedError

    def fixed_shapes(self) -> dict[str, tuple[int, ...]]:
        """The state's fixed-size float tensors, by name: their shape after the batch dim."""
        raise NotImplementedError

    @property
    def context_window(self) -> int | None:
        """Tokens a position attends over directly, itself included (Transformer-XL: mem_len
        + 1; RLT: its span C; None for Mamba, which attends over none). Older context lives
        on only through the recurrent state, so a stream itself has no length limit."""
        return max((axis.bound for axis in self.time_axes().values()), default=0) + 1

    def forward(
        self, tokens: torch.Tensor, state: State | None = None, how: Execution | None = None
    ) -> tuple[torch.Tensor, State]:
        """Consume `tokens` [B, T] into `state` (None: a fresh one), as `how` says: the family's
        `advance`. Without `how`: in place where nothing tracks a gradient and no graph is
        being compiled (`untracked`), else functionally; the results are the same either way."""
        state = self.new_state(tokens.shape[0]) if state is None else state
        if how is None and untracked(self, state):
            with torch.no_grad():  # (nothing requires a gradient: the same results, no graph)
                return self.advance(tokens, state, IN_PLACE)
        return self.advance(tokens, state, how or FUNCTIONAL)

    def advance(self, tokens: torch.Tensor, state: State, how: Execution) -> tuple[torch.Tensor, State]:
        raise NotImplementedError

    def next_logits(self, state: State) -> torch.Tensor:
        """Logits [B, V] for the token after everything `state` has consumed."""
        raise NotImplementedError

    def rebuild_state(self, tensors: dict[str, torch.Tensor]) -> State:
        """Turn verified persistent tensors into a live state (recomputing any caches)."""
        raise NotImplementedError

    # -- the state, from the family's layout ----------------------------------------------
    def _state(self, tensors: dict[str, torch.Tensor], arenas: dict[str, Arena] | None = None) -> State:
        axes = self.time_axes()
        seq_dims = dict.fromkeys(axes, 2)
        fills = tuple(name for name, axis in axes.items() if axis.fills)
        args = (self.persistent, arenas or {}, fills, self.state_precision)
        return State(self.family, self.fingerprint, tensors, seq_dims, *args)

    def set_state_dtype(self, dtype: str) -> str:
        """Serve states at `dtype` (`recur serve --state-dtype`; `model.state.precision.choose`
        says what each kind of family does). Returns the dtype a commit rounds them to."""
        self.state_precision, commit = grid.choose(dtype, self.cache_precisions, self.family)
        return commit

    def new_state(self, batch_size: int = 1) -> State:
        """A state for `batch_size` streams that have consumed nothing: empty time axes,
        zero fixed-size tensors (a family overrides this where its start is learned)."""
        return self._state(self.layout.fresh(batch_size, self.device, self.param_dtype))

    @property
    def layout(self) -> StateLayout:
        """This model's state as data (`model/state/layout.py`): what every check of a
        state, and the largest one's size, read."""
        return StateLayout(
            self.family, self.fingerprint, self.persistent, self.time_axes(), self.fixed_shapes(),
            self.max_stream_tokens,
        )  # fmt: skip

    def state_lengths(self, state: State) -> dict[str, torch.Tensor]:
        """Per-row valid lengths of the tensors in `state.seq_dims` (for `split_state`)."""
        return self.layout.lengths(state.n_tokens)

    def check_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Raise StateError unless these persistent tensors fit this model's shapes. These
        are the checks every family needs (`StateLayout.check`); a family extends them."""
        self.layout.check(tensors)

    def check_declared(self, declared: Declared) -> None:
        """Raise StateError unless a blob's declared tensors could be this model's state."""
        self.layout.check_declared(declared)

    def max_state_bytes(self) -> int:
        """The size of the largest snapshot of one stream this model can produce (float32,
        every time axis at its bound, its headers included): what a state import is sized by."""
        return self.layout.max_bytes()

    # -- shared behaviour -----------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def param_dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def segment_len(self) -> int:
        """Chunk size for consuming long inputs. For families whose results do not depend
        on chunking this only bounds activation memory."""
        return int(getattr(self.config, "tgt_len", 512))

    def config_dict(self) -> dict:
        return dataclasses.asdict(self.config)

    def with_options(self, options: dict[str, Any]) -> None:
        """Set serving options (`serving_options`; a string value is parsed as its field's
        type). The config is checked again; the caller refreshes the fingerprint, which
        covers the config, so a state made under other options is refused. Raises ValueError."""
        unknown = sorted(set(options) - set(self.serving_options))
        if unknown:
            known = ", ".join(self.serving_options) or "none"
            raise ValueError(f"{self.family} has no serving option {', '.join(unknown)} (it has: {known})")
        types = {f.name: type(getattr(self.config, f.name)) for f in dataclasses.fields(self.config)}
        parsed = {name: _parse_option(name, value, types[name]) for name, value in options.items()}
        self.config = dataclasses.replace(self.config, **parsed)

    def train(self, mode: bool = True) -> LanguageModel:
        super().train(mode)
        if not mode and self.device.type == "cpu":
            lay_out_weights(self)
        return self

    def quantize(self, precision: str = "int8") -> None:
        """Serve with packed weights (`precision` "int8": `model/int8.py`; "int4":
        `model/int4.py`) where the family has such a path, on CPU. Raises ValueError where
        it has none."""
        raise ValueError(f"the {self.family} family has no {precision} path: serve it in fp32 or bf16")

    def logit_rtol(self) -> float:
        """How far two evaluations of this model's step may lie apart when they differ only
        in how they round (the order of their sums, as a compiler fuses them; a last-bit
        difference crossing a rounding to a narrower type), relative to the largest |logit|.
        0, the default: no allowance beyond an absolute one, which a caller sets (the
        engine's compile check, app/engine/compiler.py, holds such a family to 1e-4)."""
        return 0.0

    def parts(self) -> dict[str, Callable]:
        """Pure tensor functions a forward runs many times over with inputs of one shape (a
        family's per-token loop), by name: a caller may compile them and run forwards with
        the compiled ones (`Execution.parts`). None by default."""
        return {}

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def load_state(self, blob: bytes, deltas: Iterable[bytes] = ()) -> State:
        """`read_state`, then the live state (its caches rebuilt: `rebuild_state`)."""
        return self.rebuild_state(self.read_state(blob, deltas))

    def read_state(self, blob: bytes, deltas: Iterable[bytes] = ()) -> dict[str, torch.Tensor]:
        """Bytes (a snapshot, then any deltas in order) -> this model's verified persistent
        tensors on its device. No module runs, so any thread may parse while another runs the
        model. Raises StateError, clearly, for a state of another model, or truncated,
        corrupted or malformed bytes. A state of another precision than this model's is
        converted: its caches rounded onto this model's grid (docs/CONFIGURATION.md)."""
        header, tensors = merge(blob, deltas, expect=self.check_declared)  # (family and fingerprint too)
        self.check_state_tensors(tensors)
        convert = precision_of(header) != self.state_precision
        snap_to = self.state_precision if convert else None
        return self.layout.moved(tensors, self.device, self.param_dtype, snap_to)

    def stack_states(self, states: list[State]) -> State:
        return State.stack(states, self.batch_layouts())

    def batch_layouts(self) -> dict[str, bool]:
        """The time axes a decode step grows in place, each with whether its arena is
        time-major (`model.state.Arena`): a stacked batch starts in such arenas (`State.stack`)."""
        return {}

    def readied_layouts(self) -> dict[str, bool]:
        """The time axes whose growth takes a readied arena (`Execution.readied`), with their
        layouts: those a compiled step appends to in place (`compiled_in_place`). None by
        default: a compiled step grows its state functionally."""
        return {}

    def split_state(self, state: State) -> list[State]:
        return state.split(self.state_lengths(state))

    @torch.no_grad()
    def prefill(
        self, ids: torch.Tensor, state: State, logprobs: bool = False, how: Execution = IN_PLACE
    ) -> tuple[torch.Tensor | None, State]:
        """Teacher-force one chunk `ids` [B, T] (T <= `segment_len`) into `state`: the one
        prefill step, shared by `consume` and the server's scheduler (without gradients:
        training runs `forward`).

        Returns (logprobs [B, T] or None, state'). logprobs[:, i] is log p(ids[:, i] |
        everything before it); for i = 0 it comes from `next_logits(state)`, and is NaN for
        a stream that has consumed nothing (no context, no distribution).
        """
        out = None
        if logprobs:
            out = torch.empty(ids.shape, device=ids.device)
            first = F.log_softmax(self.next_logits(state).float(), -1).gather(1, ids[:, :1])[:, 0]
            out[:, 0] = torch.where(state.n_tokens > 0, first, torch.full_like(first, float("nan")))
        logits, state = self(ids, state, how if logprobs else dataclasses.replace(how, last_logits=True))
        if out is not None:
            # logits at position i predict token i+1
            lp = F.log_softmax(logits[:, :-1].float(), -1)
            out[:, 1:] = lp.gather(2, ids[:, 1:, None])[..., 0]
        return out, state

    @torch.no_grad()
    def consume(
        self, tokens: list[int] | torch.Tensor, state: State, how: Execution = IN_PLACE
    ) -> tuple[torch.Tensor, State]:
        """Teacher-force `tokens` into a single- or multi-stream state, `segment_len` tokens
        at a time (`prefill`). Returns (logprobs [B, T], state'), as `prefill` defines them."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        if ids.dim() == 1:
            ids = ids[None]
        parts = []
        for start in range(0, ids.shape[1], self.segment_len):
            lp, state = self.prefill(ids[:, start : start + self.segment_len], state, True, how)
            assert lp is not None
            parts.append(lp)
        out = torch.cat(parts, 1) if parts else torch.empty(ids.shape, device=self.device)
        return out, state


def untracked(lm: nn.Module, state: State) -> bool:
    """Whether a forward of `lm` on `state` would build no autograd graph and is not being
    compiled, so that it may grow the state in place: gradients off (`torch.no_grad`,
    `torch.inference_mode`), or no parameter and no state tensor that requires one."""
    if torch.compiler.is_compiling():
        return False
    if not torch.is_grad_enabled():
        return True
    return not any(p.requires_grad for p in lm.parameters()) and not any(
        t.requires_grad for t in state.tensors.values()
    )


def compiled_in_place(lm: LanguageModel, forward: Callable[..., tuple[torch.Tensor, State]]) -> Step:
    """`forward` (`lm.forward` compiled) as a step that appends to one stream's arenas in
    place, for the axes the family names (`readied_layouts`): before each call, each axis's
    arena is readied outside the graph (room made, the step's rows claimed,
    `model.state.Window.readied`), the graph appends its rows to the arena's layers, and the
    state it returns is given its arenas back, so that the next step appends after it (an
    eager step, or the graph again). The other axes grow functionally inside the graph.

    Several rows, or a family that names no axis, get `forward` as it is, given a plain state
    (one memory layout, whatever grew it: a state in arenas would make the graph compile
    again). Not several rows in place: torch 2.13's AOTAutograd gives the base of a view
    input (the arena behind the layers) symbols of its own, which dynamo's guards cannot name
    once the batch is symbolic (`sources must not be empty for symbol`, on every compile
    that misses inductor's cache; one row's batch is a constant and names none)."""
    layouts = lm.readied_layouts()
    bounds = {name: axis.bound for name, axis in lm.time_axes().items()}

    def step(tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        T = tokens.shape[1]
        if not layouts or tokens.shape[0] != 1:
            return forward(tokens, state.plain() if state.arenas else state)
        readied: dict[str, Readied] = {}
        arenas: dict[str, Arena] = {}
        with torch.no_grad():  # (a state grows in place only without autograd)
            for name, time_major in layouts.items():
                window = state.window(name)
                keep = min(bounds[name], window.rows.shape[2] + T)
                readied[name], arenas[name] = window.readied(T, keep, time_major)
            # (the state goes in without its arenas: the graph sees tensors, not their bookkeeping)
            logits, new = forward(tokens, state.with_arenas({}), Execution(readied=readied))
        return logits, new.with_arenas(arenas)

    return step


def _given_memory(lm: LanguageModel) -> LanguageModel:
    """A model built on the meta device, given memory on the CPU (uninitialised): its tied
    weights tied again (giving a weight memory unties it) and its non-persistent buffers made
    again by each module's `reset_buffers` (`LanguageModel.without_init`)."""
    first: dict[int, str] = {}  # a tied weight's first name
    ties = [(name, first.setdefault(id(p), name)) for name, p in lm.named_parameters(remove_duplicate=False)]
    lm = lm.to_empty(device="cpu")
    for name, owner in ties:
        if name != owner:
            path, _, attr = name.rpartition(".")
            setattr(lm.get_submodule(path), attr, lm.get_parameter(owner))
    for m in lm.modules():
        reset = getattr(m, "reset_buffers", None)
        if callable(reset):
            reset()
    return lm


def init_weights(m: nn.Module) -> None:
    """GPT-2's init, for a family's `self.apply`: weights N(0, 0.02), biases zero."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, 0.0, 0.02)
        bias = getattr(m, "bias", None)
        if isinstance(bias, torch.Tensor):
            nn.init.zeros_(bias)


def lay_out_weights(module: nn.Module) -> None:
    """Lay out each (untied) linear layer's weight with its longer side contiguous in
    memory: a tall one is stored transposed, the same tensor. One token's step multiplies
    a vector by every weight, and a CPU's BLAS streams a long contiguous side faster than a
    short one. `state_dict` hands out contiguous copies of these (`_contiguous_state`), so
    checkpoints and fingerprints are unchanged."""
    uses = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    for m in module.modules():
        if isinstance(m, nn.Linear):
            w = m.weight
            n_out, n_in = w.shape
            if n_out > n_in and w.is_contiguous() and uses[id(w)] == 1:
                w.data = w.data.t().contiguous().t()


def _parse_option(name: str, value: Any, typ: type) -> Any:
    """A serving option's value as its config field's type (`LanguageModel.with_options`)."""
    if not isinstance(value, str):
        return value
    try:
        if typ is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(value)
            return value.lower() in ("true", "1")
        return typ(value)
    except ValueError:
        raise ValueError(f"serving option {name} must be a {typ.__name__}, not {value!r}") from None


def _contiguous_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """A state_dict's tensors in the standard layout (see `lay_out_weights`):
    safetensors saves only contiguous tensors."""
    for name, t in state_dict.items():
        if not t.is_contiguous():
            state_dict[name] = t.contiguous()
