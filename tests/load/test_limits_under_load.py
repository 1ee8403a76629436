"""The default settings under load, at their limits (issue 38, item 4), in `make test`.

One server of the tiny model with every setting at its default but the limits, lowered so
that twelve clients reach each of them (`clients.LIMITS`): a batch of 4 rows, a queue of 4
requests (3 per key), 3 streams per key, and one of the two API keys holding at most 3
sessions. Six clients per key do job after job (`tests/load/clients.py`): a session made
with one of six prompts, then a greedy generate (streamed or not), a seeded sampled one or
a committing score on it, then the session deleted.

Asserted: every outcome of every request counted, session creation included; no error (a
refusal is a 429 or 503, counted apart); every answer, greedy and seeded, exactly the
same request's answer alone on the quiet server (scored log-probs within 1e-4), and every
acknowledged commit what the session then holds; and every limit reached: a decode step of
4 rows, queue_full, the per-key streams and the per-key sessions refused. The load runs
until all of them were reached and enough answers came. The shipped model on two replicas:
`test_defaults_under_load.py`, in `make test-slow`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ServerProcess

from .clients import LIMITS, PROMPTS, answers_alone, drive, jobs, keys_file, reached

MIN_ANSWERS = {"generate": 48, "score": 12}
GUARD = 120.0  # seconds: a load that never reaches its limits fails here, not in CI's timeout


@pytest.fixture(scope="module")
def limited(
    tiny_model_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("limits-under-load")
    keys = keys_file(workdir)
    with ServerProcess(tiny_model_dir, workdir, redis_url, api_keys_file=keys, cpu_threads=1, **LIMITS) as s:
        yield s


def test_the_limits_refuse_and_every_answer_is_the_answer_alone(limited):
    todo = jobs(PROMPTS)
    answers = answers_alone(limited, todo)
    assert limited.metric("recur_decode_batch_max") == 1  # (alone: no batch was filled yet)
    tally = drive([limited], todo, answers, lambda t: all(reached([limited], t, MIN_ANSWERS).values()), GUARD)
    assert not tally.errors, tally.errors[:10]
    status = reached([limited], tally, MIN_ANSWERS)
    assert all(status.values()), (status, dict(tally.answers), dict(tally.refusals))
