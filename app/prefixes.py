"""What identifies a token sequence: a hash chained token by token, for durable prefix reuse.

A session's state is a pure function of the model and the tokens it consumed. So every
committed state can be indexed by a hash of (the model's fingerprint, its token ids), and a
stateless request (one that names no session and resends the whole conversation) can find
the longest committed prefix of its own tokens, fork that state, and prefill only the rest.

The hash is chained per token, h_i = H(h_{i-1}, t_i), starting from the fingerprint: the
hashes of every prefix of a request come out of one pass over its tokens, and a commit
extends its session's hash over just the tokens it added. 128-bit BLAKE2b: a collision
between two different token sequences is not a practical concern.

This module only hashes; the store keeps the index, the sessions service decides.
"""

from __future__ import annotations

import hashlib
from array import array

UNKNOWN = ""  # the tokens of an imported state are not known: such a state is never indexed


def root(fingerprint: str) -> str:
    """The hash of no tokens at all, for one model."""
    return hashlib.blake2b(fingerprint.encode(), digest_size=16).hexdigest()


def extend(tokens_hash: str, ids: list[int]) -> str:
    """The hash of a sequence `tokens_hash` stands for, followed by `ids`."""
    if tokens_hash == UNKNOWN:
        return UNKNOWN
    return prefixes(tokens_hash, ids)[-1] if ids else tokens_hash


def digest(ids: list[int]) -> str:
    """A one-pass digest of a whole token sequence (not chained, so not extendable): for
    checking that two sequences are the same in one C call over their bytes, where the
    chained hash would take a Python step per token. A stored response keeps the digest of
    what its state consumed beside the chained hash, so its next turn checks a rendering of
    a long conversation against it without hashing the conversation token by token."""
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).hexdigest()


def prefixes(tokens_hash: str, ids: list[int]) -> list[str]:
    """The hashes of the sequence followed by ids[:1], ids[:2], … ids[:len(ids)]."""
    out = []
    h = bytes.fromhex(tokens_hash)
    for i in ids:
        h = hashlib.blake2b(h + i.to_bytes(4, "little"), digest_size=16).digest()
        out.append(h.hex())
    return out
