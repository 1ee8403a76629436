"""Session ids carry 128 bits from the OS's CSPRNG: an id is the only thing between a
tenant-less session and whoever guesses it."""

from __future__ import annotations

import re
import secrets

from app import store

ID = re.compile(r"[0-9a-f]{32}")


def test_the_generator_draws_16_bytes_from_secrets(monkeypatch):
    """The id is exactly the hex of 16 bytes from `secrets` (os.urandom), nothing less."""
    asked: list[int] = []

    def token_bytes(n: int) -> bytes:
        asked.append(n)
        return bytes(range(n))

    monkeypatch.setattr(secrets, "token_bytes", token_bytes)
    sid = store.new_session_id()
    assert asked == [16]
    assert sid == bytes(range(16)).hex()


def test_ids_look_uniformly_random():
    """2,000 ids: all distinct, and every one of the 128 bit positions set about half the
    time (5 standard deviations: a fixed or biased bit fails, chance never does)."""
    ids = [store.new_session_id() for _ in range(2000)]
    assert all(ID.fullmatch(i) for i in ids)
    assert len(set(ids)) == len(ids)
    n = len(ids)
    values = [int(i, 16) for i in ids]
    tolerance = 5 * (0.25 / n) ** 0.5
    for bit in range(128):
        share = sum((v >> bit) & 1 for v in values) / n
        assert abs(share - 0.5) < tolerance, (bit, share)


def test_ids_given_out_over_http_have_the_format(http):
    got = {http.post("/v1/sessions").json()["id"] for _ in range(20)}
    assert len(got) == 20 and all(ID.fullmatch(i) for i in got)
