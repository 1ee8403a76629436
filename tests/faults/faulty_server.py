"""`python -m app`, with faults injected into the engine and the routes: for the tests
only, so no setting or flag of the real server exposes them.

    python -m tests.faults.faulty_server FAULT[,FAULT...] [recur serve flags...]

  raise     a prefill whose chunk holds the byte `~` raises (a forward that fails)
  hang=S    a prefill whose chunk holds the byte `^` sleeps S seconds first (a forward
            that hangs past the engine's step deadline)
  slow=S    likewise for the byte `` ` `` (a long step, within the deadline)
  compile   the background compile raises as it starts
  compiled  the compiled decode step is adopted for every batch class without a probe,
            and raises whenever it runs (a compiled step that fails at serve time)
  route     GET /v1/sessions/000...0 raises an error no handler knows (an unexpected 500)
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import model
from app import sessions
from app.cli import main
from app.engine import compiler
from model import LanguageModel

RAISE, HANG, SLOW = ord("~"), ord("^"), ord("`")
UNEXPECTED_ID = "0" * 32


def _prefill_faults(sleeps: dict[int, float], fail: bool) -> None:
    prefill = LanguageModel.prefill

    def faulty(self, ids, state, logprobs=False, how=model.IN_PLACE):  # type: ignore[no-untyped-def]
        if fail and bool((ids == RAISE).any()):
            raise RuntimeError("injected fault: the forward raised")
        for byte, seconds in sleeps.items():
            if bool((ids == byte).any()):
                time.sleep(seconds)
        return prefill(self, ids, state, logprobs, how)

    LanguageModel.prefill = faulty  # type: ignore[method-assign]


def _compile_fails() -> None:
    def failing(lm):  # type: ignore[no-untyped-def]
        raise RuntimeError("injected fault: the compile raised")

    compiler._compile = failing


def _compiled_step_fails() -> None:
    def step(tokens, state):  # type: ignore[no-untyped-def]
        raise RuntimeError("injected fault: the compiled step raised")

    compiler._compile = lambda lm: step
    compiler._probe_states = lambda lm: []
    compiler._probe = lambda lm, compiled, states, rows, margin: compiler.Verdict(rows, 1.0, 0.5, 0.0, True)


def _route_fails() -> None:
    get = sessions.SessionService.get

    async def faulty(self, session_id, owner):  # type: ignore[no-untyped-def]
        if session_id == UNEXPECTED_ID:
            raise KeyError("injected fault: an error no handler knows")
        return await get(self, session_id, owner)

    sessions.SessionService.get = faulty  # type: ignore[method-assign]


def install(spec: str) -> None:
    faults = dict(f.partition("=")[::2] for f in spec.split(","))
    sleeps = {byte: float(faults[name]) for name, byte in (("hang", HANG), ("slow", SLOW)) if name in faults}
    _prefill_faults(sleeps, "raise" in faults)
    if "compile" in faults or "compiled" in faults:
        # an inductor cache (and so a host compile lock, app/engine/compiler.py) of its own:
        # a compile in another process on this host must not hold the fault back
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="recur-faulty-inductor-")
    if "compile" in faults:
        _compile_fails()
    if "compiled" in faults:
        _compiled_step_fails()
    if "route" in faults:
        _route_fails()


if __name__ == "__main__":
    install(sys.argv[1])
    sys.exit(main(["serve", *sys.argv[2:]]))
