"""A model's recurrent state: the protocol every family shares (protocol.py), its byte
format (blob.py), appending without copying (arena.py), and how a commit stores it
(persist.py). This package must never unpickle anything, and knows nothing of HTTP or
Redis.
"""

from .arena import ARENA_SLACK, Arena, Growth, Readied, Window, kv_appender, unzip
from .blob import (
    FORMAT_VERSION,
    MAX_HEADER_BYTES,
    MAX_JSON_DEPTH,
    MAX_TENSORS,
    STORAGE_DTYPES,
    Declared,
    StateError,
    checksum_of,
    merge,
    peek,
    read_blob,
    serialise,
)
from .persist import Encoded, Persist, encode
from .protocol import State

__all__ = [
    "ARENA_SLACK",
    "FORMAT_VERSION",
    "MAX_HEADER_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_TENSORS",
    "STORAGE_DTYPES",
    "Arena",
    "Declared",
    "Encoded",
    "Growth",
    "Persist",
    "Readied",
    "State",
    "StateError",
    "Window",
    "checksum_of",
    "encode",
    "kv_appender",
    "merge",
    "peek",
    "read_blob",
    "serialise",
    "unzip",
]
