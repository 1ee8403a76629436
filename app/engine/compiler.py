"""The decode step, compiled in the background while the eager one serves.

`torch.compile` cuts a step's per-op overhead (inductor fuses the small element-wise ops
around the matrix products into a few generated kernels; on CUDA, mode reduce-overhead
replays the step as a CUDA graph), but compiling takes tens of seconds on a CPU, and a
shape the compiled code has not met compiles again on the spot. So nobody waits for it:

- `DecodeStep` runs the model's eager forward from the first request on.
- A background thread builds probe states, compiles the step (dynamic shapes: one graph for
  one row, one for several, per fill regime), checks it against the eager step of the same
  model (`agrees`: every logit within the model's bound, and the same greedy token in every
  row) and times both on the same state for each batch class (1, 4, 16 and 64 rows, up to
  the engine's largest batch).
- The engine thread then uses the compiled step for the batch classes where it was faster
  by `MARGIN`, and only there: a step is never slower, and never different beyond the
  tolerance, for having been compiled. Whether it pays depends on the family and the
  machine (docs/BENCHMARKS.md), which is why it is measured here and not assumed.
- Under the stance `eager_on_recompile`, an input the compiled code's guards refuse (rows of
  unequal length, say) runs eagerly for that step instead of compiling on the engine thread.

The eager step grows the state in place (`IN_PLACE`, `model.Execution`). A compiled step
appends to the time axes its family names in place too (`model.compiled_in_place`: each
arena readied outside the graph, its layers handed in as tensors of their own, which
inductor writes a slice of in place), and grows the others functionally.

Serving never depends on the compile:
- torch.fx's tracer (AOTAutograd's make_fx, inductor's symbolic_trace) patches
  `nn.Module.__call__` for the whole process while it traces, so a forward on another
  thread would run through the tracer's wrapper and fail (`NameError: module is not
  installed as a submodule`). Every trace in the process therefore takes `MODEL_LOCK`,
  which the engine thread holds for each of its steps (`serialise_tracing`): a trace waits
  for the step, a step for the trace. The traces are short (shipped `shakespeare`: 13 of
  them, 10.6 s of a 150 s compile, the longest 3.8 s); the rest of the compile (dynamo,
  inductor's lowering, the C++ compiler) runs beside the engine.
- The compile thread runs at a lower CPU priority (`NICE`), so that it takes the cores
  the serving threads leave idle; the C++ compilers it starts inherit it.
- Processes on one host share inductor's on-disk cache (`TORCHINDUCTOR_CACHE_DIR`): one
  compiles at a time (`_host_lock`), so replicas started together never build the same
  kernel at once; the next finds the cache warm.
- Dynamo checks a graph's guards before every call; the step's on the model's own modules
  (each parameter, buffer and config value) are dropped (`guards_kept`): the engine never
  changes a model it serves, and the step's graphs are its own (`isolate_recompiles`), never
  looked up for another model's forward. The guards on the step's inputs (the tokens, the
  state's tensors and layout) all stay, and the parts keep every guard.
- A compiled step or part that raises at serve time is dropped, and the step runs eagerly
  from the same input (neither grows its input state in place): no request fails for it.

A family may also name parts of its forward that run many times with inputs of one shape
(`LanguageModel.parts`: RLT's recurrence, one token at a time, in a prefill). They are
compiled, checked (log-probs within `TOLERANCE`) and timed on a prompt the same way, and a
prefill runs them (`DecodeStep.prefill`) only if they were faster.

The bound. A compiled step computes the same function with its sums in another order (inductor
fuses a norm's or a softmax's reduction its own way), so its logits may differ by rounding
and by nothing else: each call's bound is `max(TOLERANCE, rtol * max|eager logit|)`, where
`rtol` is the model's own (`LanguageModel.logit_rtol`): how far two evaluations that only
round differently may lie apart at its precision, relative to its logits' scale. It is 0
for Transformer-XL and RLT (so held to `TOLERANCE`, 1e-4, as before: their compiled steps
measure within 5e-6, docs/BENCHMARKS.md section 2); for LLaMA in fp32 it is fp32's bound for its longest reduction (smollm2:
2.7e-3 at logits near 30, where the compiled step measures 2.7e-4), and on its packed paths,
whose activations are rounded to bfloat16, one bfloat16 step of the largest logit. The
packed paths are compared with their own eager step, never with fp32's: the compile is to
change how a path computes, not which path it is. The greedy token must agree too, exactly.

This module imports only `model/`.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from model import IN_PLACE, Execution, LanguageModel, State, Step, compiled_in_place

log = logging.getLogger("recur.engine")

T = TypeVar("T")

TOLERANCE = 1e-4  # |logit difference| always allowed between the compiled and eager step (`bound`)
MARGIN = 0.9  # the compiled step is adopted when its fastest step is under 0.9 x eager's
RECOMPILE_LIMIT = 32  # graphs of one compiled step (dynamo: 8 a function): batch classes x fill regimes
PROBE_TOKENS = 512  # most tokens the probe state consumes (the state's bound, if smaller)
PROBE_STEPS = 20  # timed steps per variant, alternating; the fastest of each counts (noise only adds)
PROBE_ROWS = (1, 4, 16, 64)  # the batch classes: a batch runs as the smallest class that holds it
# on CPU, the compiled graph's wrapper in C++, not Python: a small model's step is mostly the
# calls between its kernels (shipped `shakespeare-rlt`: 0.5 ms a step against 0.65), at the
# price of a compile several times as long, in the background
CPU_OPTIONS: dict[str, Any] = {"cpp_wrapper": True}
CUDA_STEP_OPTIONS: dict[str, Any] = {"triton.cudagraphs": True}  # mode reduce-overhead's options
NICE = 10  # the compile thread's niceness: below the serving threads' share of the CPU

# held by the engine thread for each step, and by every torch.fx trace (`serialise_tracing`)
MODEL_LOCK = threading.RLock()


def serialise_tracing() -> None:
    """Make every torch.fx trace in this process hold MODEL_LOCK (once per process): while
    it traces, fx patches `nn.Module.__call__` process-wide, and no forward may run."""
    trace = torch.fx.Tracer.trace
    if getattr(trace, "_recur_serialised", False):
        return

    @functools.wraps(trace)
    def locked(self: torch.fx.Tracer, *args: Any, **kwargs: Any) -> Any:
        with MODEL_LOCK:
            return trace(self, *args, **kwargs)

    locked._recur_serialised = True  # type: ignore[attr-defined]
    torch.fx.Tracer.trace = locked  # type: ignore[method-assign]


@contextlib.contextmanager
def _host_lock() -> Iterator[None]:
    """One compile at a time on this host, per inductor cache directory (an flock, freed
    with the process however it ends)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    path = os.path.join(cache_dir(), "recur-compile.lock")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def lower_priority() -> None:
    """This thread (and what it starts) yields the CPU to the serving threads, at nice
    `NICE` (Linux: a thread's niceness is its own; elsewhere, or where it is refused, it
    does not change). The compile thread's, and the engine's loader and encoder threads'."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)


def guards_kept(entries: list[Any]) -> list[bool]:
    """Which of a compiled graph's guards dynamo checks before every call: those on its
    inputs (the tokens, the state's tensors, their shapes and strides, which time axes are
    full), not those on the model's modules (each parameter's and buffer's identity, shape
    and stride, each attribute and config value read). The engine never changes a model it
    serves: it is built once, and `DecodeStep` compiles that one. The model's guards were
    most of them: smollm2's int4 step checked 3,991 guards, 1.0-1.2 ms a step, and 208 without
    them, 1.07-1.10x faster (docs/BENCHMARKS.md, section "A compiled step's guards")."""
    return torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)


def _options(lm: LanguageModel, step: bool = False) -> dict[str, Any]:
    """torch.compile's options for this model's device: inductor's, and for the step (whose
    graphs are its own, `isolate_recompiles`) on CUDA the step replayed as a CUDA graph (mode
    reduce-overhead's option) and only its inputs' guards (`guards_kept`). The parts keep
    every guard: their graphs are looked up by their function's code, which another model
    of the family shares."""
    own = CPU_OPTIONS if lm.device.type == "cpu" else CUDA_STEP_OPTIONS if step else {}
    return {**own, "guard_filter_fn": guards_kept} if step else dict(own)


def batch_class(rows: int, classes: tuple[int, ...] = PROBE_ROWS) -> int:
    """The probed batch size whose verdict covers a batch of `rows` rows: the smallest one
    that holds it (the largest for a larger batch). Whether compiling pays changes with the
    batch: fewer ops per step matter less as each op does more work."""
    return next((c for c in classes if c >= rows), classes[-1])


def bound(lm: LanguageModel, eager: torch.Tensor) -> float:
    """The largest |logit difference| a compiled step may show against `eager`, this
    model's eager logits (the module's docstring: the bound)."""
    return max(TOLERANCE, lm.logit_rtol() * float(eager.abs().max()))


def agrees(lm: LanguageModel, eager: torch.Tensor, compiled: torch.Tensor) -> tuple[float, float, bool]:
    """(max |difference|, the bound, whether `compiled` agrees): every logit within the
    bound, and every row's greedy token the same."""
    diff, limit = float((compiled - eager).abs().max()), bound(lm, eager)
    return diff, limit, diff <= limit and torch.equal(compiled.argmax(-1), eager.argmax(-1))


@dataclass
class Verdict:
    """What the probe found for one batch class."""

    rows: int
    eager_ms: float
    compiled_ms: float
    max_diff: float
    adopted: bool
    bound: float = TOLERANCE  # the tightest of its calls' bounds (`bound`)
    agreed: bool = True  # every call within its bound, with the same greedy tokens


@dataclass
class CompileStatus:
    """Where the background compile stands (read from other threads)."""

    state: str = "off"  # off | compiling | ready | failed
    seconds: float = 0.0
    error: str = ""
    verdicts: dict[int, Verdict] = field(default_factory=dict)
    prefill: Verdict | None = None  # the model's compiled parts (`LanguageModel.parts`), if any


class DecodeStep:
    """The one-token forward the runner calls: eager, or compiled where that was measured
    to be faster."""

    def __init__(
        self, lm: LanguageModel, compile: bool, margin: float = MARGIN, max_rows: int = PROBE_ROWS[-1]
    ):
        self.lm = lm
        self.margin = margin
        # the classes a batch of at most max_rows rows can fall in
        classes = [c for c in PROBE_ROWS if c < max_rows] + [min(max_rows, PROBE_ROWS[-1])]
        self.classes = tuple(dict.fromkeys(classes))
        self.status = CompileStatus()
        self.compiled_steps = 0  # steps handed to the compiled step (read by the metrics)
        self._compiled: Step | None = None
        self._use: frozenset[int] = frozenset()  # batch classes that run compiled
        self._parts: dict[str, Callable] = {}  # compiled parts prefills run (`prefill`)
        self._thread: threading.Thread | None = None
        if compile:
            self.status.state = "compiling"
            self._thread = threading.Thread(target=self._build, name="recur-compile", daemon=True)

    def start(self) -> None:
        if self._thread is not None:
            self._thread.start()

    def serves_compiled(self, rows: int) -> bool:
        """Whether a batch of `rows` rows runs the compiled step."""
        return self._compiled is not None and batch_class(rows, self.classes) in self._use

    @property
    def prefill_compiled(self) -> bool:
        """Whether prefills run the model's compiled parts."""
        return bool(self._parts)

    @torch.no_grad()  # (serving never tracks gradients, and the eager step grows in place)
    def __call__(self, tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        compiled = self._compiled
        if compiled is not None and self.serves_compiled(tokens.shape[0]):
            self.compiled_steps += 1
            try:
                with torch.compiler.set_stance("eager_on_recompile"):
                    return compiled(tokens, state)
            except Exception as exc:  # (it grew nothing in place: the same input serves eagerly)
                self._drop(exc)
        return self.lm.forward(tokens, state, IN_PLACE)

    @torch.no_grad()
    def prefill(self, run: Callable[[Execution], T]) -> T:
        """`run` a prefill, given how: in place, with the model's compiled parts (its
        per-token loop, say) where the probe adopted them; an input their guards refuse runs
        eagerly, and if they raise, `run` runs again eagerly (a forward never changes the
        rows of the state it is given)."""
        parts = self._parts
        if not parts:
            return run(IN_PLACE)
        try:
            with torch.compiler.set_stance("eager_on_recompile"):
                return run(Execution(in_place=True, parts=parts))
        except Exception as exc:
            self._drop(exc)
        return run(IN_PLACE)

    def _drop(self, exc: Exception) -> None:
        """A compiled step or part failed at serve time: the eager ones serve from now on."""
        log.error("the compiled decode step failed; the eager one serves from now on", exc_info=exc)
        self._use, self._parts = frozenset(), {}
        self.status.state, self.status.error = "failed", f"{type(exc).__name__}: {exc}"

    # -- the background thread ----------------------------------------------------------
    def _build(self) -> None:
        lower_priority()
        t0 = time.perf_counter()
        try:
            with torch.no_grad(), _host_lock():
                compiled = _compile(self.lm)
                states = _probe_states(self.lm)
                verdicts = {
                    rows: _probe(self.lm, compiled, states, rows, self.margin) for rows in self.classes
                }
                parts, prefill = _probe_parts(self.lm, self.margin)
        except Exception as exc:  # no compiler on this machine, say: the eager step serves on
            self.status.error = f"{type(exc).__name__}: {exc}"
            self.status.state = "failed"
            log.warning("compiling the decode step failed, the eager step serves: %s", self.status.error)
            return
        finally:
            self.status.seconds = time.perf_counter() - t0
        self.status.verdicts, self.status.prefill = verdicts, prefill
        # the engine thread reads these without a lock: the classes first, then the step
        self._use = frozenset(rows for rows, v in verdicts.items() if v.adopted)
        self._compiled = compiled
        self._parts = parts if prefill is not None and prefill.adopted else {}
        self.status.state = "ready"
        if prefill is not None:
            log.info(
                "prefill: eager %.1f ms, with compiled parts %.1f ms (max |dlogprob| %.1e): %s",
                prefill.eager_ms,
                prefill.compiled_ms,
                prefill.max_diff,
                "compiled" if prefill.adopted else "eager",
            )
        for v in verdicts.values():
            log.info(
                "decode step, %s: eager %.3f ms, compiled %.3f ms (max |dlogit| %.1e, bound %.1e%s): %s",
                "1 row" if v.rows == 1 else f"{v.rows} rows",
                v.eager_ms,
                v.compiled_ms,
                v.max_diff,
                v.bound,
                "" if v.agreed else ", refused",
                "compiled" if v.adopted else "eager",
            )


def _compile(lm: LanguageModel) -> Step:
    # Shapes change with the batch and the state's fill level: dynamic, so that they do not
    # each compile again; on CUDA, reduce-overhead replays the step as a CUDA graph. A graph
    # per batch class and fill regime (`_probe_states`) is more than dynamo's default limit
    # of 8 a function, and every model's `forward` is one function to dynamo: this step's
    # graphs are its own (`isolate_recompiles`), under a limit of their own. Not through
    # dynamo's config: torch keeps each thread's settings to that thread, and a limit raised
    # here, on the compile thread, was not the serving thread's, where other graphs of
    # `forward` past 8 sent the step to eager while it was counted compiled
    # (tests/app/test_compiler_llama.py::test_other_graphs_of_forward_leave_the_compiled_step_its_own).
    how: dict[str, Any] = {"dynamic": True, "recompile_limit": RECOMPILE_LIMIT, "isolate_recompiles": True}
    step = torch.compile(lm.forward, options=_options(lm, step=True), **how)
    return compiled_in_place(lm, step)


def _probe_states(lm: LanguageModel) -> list[State]:
    """One stream's states the compiled code must serve, the one the timing uses first: one
    whose time axes are all full (up to PROBE_TOKENS tokens), then one per regime of a state
    still filling them (a graph guards on which of its axes are full: each regime needs a
    graph of its own, or the eager step serves it)."""
    bounds = sorted({axis.bound for axis in lm.time_axes().values()})
    lengths = [min(PROBE_TOKENS, b) for b in bounds[:-1] if b > 2]  # the shorter axes full, the longest not
    full = min(PROBE_TOKENS, (bounds[-1] if bounds else 0) + 1)
    gen = torch.Generator().manual_seed(0)
    vocab = lm.tokenizer.vocab_size if lm.tokenizer is not None else 256
    ids = torch.randint(0, vocab, (max(2, full),), generator=gen)
    return [lm.consume(ids[:n], lm.new_state(1))[1] for n in dict.fromkeys([full, 2, *lengths])]


def _probe(lm: LanguageModel, compiled: Step, states: list[State], rows: int, margin: float) -> Verdict:
    """Compile for `rows` rows (every probe state), check against eager, and time both on
    the first (full) state."""
    tok = torch.zeros(rows, 1, dtype=torch.long, device=lm.device)
    diff, limit, agreed = 0.0, float("inf"), True
    for one in states:
        state = lm.stack_states([one] * rows)
        for _ in range(3):  # the first calls compile; each is checked
            le, _ = lm.forward(tok, state, IN_PLACE)
            lc, state = compiled(tok, state)
            d, b, ok = agrees(lm, le, lc)
            diff, limit, agreed = max(diff, d), min(limit, b), agreed and ok
    eager: list[float] = []
    comp: list[float] = []
    s_eager = s_comp = lm.stack_states([states[0]] * rows)
    for _ in range(PROBE_STEPS if rows <= 4 else PROBE_STEPS // 2):  # a large batch's steps are long
        t0 = _clock(lm)
        _, s_eager = lm.forward(tok, s_eager, IN_PLACE)
        eager.append(_clock(lm) - t0)
        t0 = _clock(lm)
        _, s_comp = compiled(tok, s_comp)
        comp.append(_clock(lm) - t0)
    e, c = min(eager), min(comp)
    return Verdict(rows, e * 1e3, c * 1e3, diff, agreed and c < margin * e, limit, agreed)


def _probe_parts(lm: LanguageModel, margin: float) -> tuple[dict[str, Callable], Verdict | None]:
    """The model's parts (`LanguageModel.parts`: a per-token loop's body) compiled, checked
    and timed the way the step is: a prompt of a few chunks, alone and as two rows (a graph
    for one row, one for several), with and without them."""
    own = lm.parts()
    if not own:
        return {}, None
    # a part's shapes are fixed but for the rows: compiled for one row first (kernels of
    # known sizes), then once more with the rows symbolic when a second count is seen
    parts = {name: torch.compile(fn, dynamic=None, options=_options(lm)) for name, fn in own.items()}
    n = 2 * lm.segment_len + lm.segment_len // 2 + 1  # a chunk from empty, a full one, a short one
    vocab = lm.tokenizer.vocab_size if lm.tokenizer is not None else 256
    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1), device=lm.device)
    diff = 0.0
    for rows in (1, 2):
        x = ids.expand(rows, n)
        le, _ = lm.consume(x, lm.new_state(rows))
        lc, _ = lm.consume(x, lm.new_state(rows), Execution(in_place=True, parts=parts))
        diff = max(diff, float((lc - le).abs().nan_to_num().max()))
    eager: list[float] = []
    comp: list[float] = []
    for _ in range(3):
        t0 = _clock(lm)
        lm.consume(ids, lm.new_state(1))
        eager.append(_clock(lm) - t0)
        t0 = _clock(lm)
        lm.consume(ids, lm.new_state(1), Execution(in_place=True, parts=parts))
        comp.append(_clock(lm) - t0)
    e, c = min(eager), min(comp)
    return parts, Verdict(1, e * 1e3, c * 1e3, diff, diff <= TOLERANCE and c < margin * e)


def _clock(lm: LanguageModel) -> float:
    if lm.device.type == "cuda":  # the step's kernels run asynchronously: wait for them
        torch.cuda.synchronize(lm.device)
    return time.perf_counter()
