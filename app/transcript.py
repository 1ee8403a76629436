"""A session's transcript: what its state consumed, commit by commit, packed for Redis.

Every commit appends one `Segment` in the same atomic step as the new state (the store's
commit script takes it with the state bytes): the consumed token ids, which of them the
model sampled (the action mask), the behaviour log-prob of each sampled token, and the
request's sampling parameters and seed. A segment is stored as safetensors (three packed
arrays, 9 bytes per token) with its small fields in the safetensors JSON metadata, so a
transcript is never JSON per token, and nothing in it is ever unpickled.

Versions only move forward, but a rollback makes a version whose state is an older
one's. So the tokens a state holds are not simply every segment in order: they are its
*lineage*, found by walking back from the current version (a `rollback` segment jumps to
the version it restored). A fork starts with its parent's lineage up to the fork point,
copied as the parent stored it (those segments keep the parent's session id).

A chat's messages are read back from a lineage (`conversation`): each commit's prompt is
one turn as the chat template rendered it, its sampled tokens the assistant's answer.

This module knows neither Redis nor HTTP; the sessions service builds segments, the store
keeps their bytes, the API renders them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load, save

from model.chat_template import ChatTemplate

Kind = Literal["create", "generate", "score", "keep", "rollback", "import", "fork"]


@dataclass(frozen=True)
class Segment:
    session_id: str
    version: int  # the version this commit made
    kind: Kind
    start: int  # the token position where the segment's ids begin
    ids: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)  # the action mask
    logprobs: list[float | None] = field(default_factory=list)  # behaviour log-probs of sampled tokens
    sampling: dict[str, Any] | None = None  # the request's `SamplingParams`, as a dict
    seed: int | None = None
    finish_reason: str | None = None
    committed_at: float = 0.0
    restores: int | None = None  # a rollback: the version whose state it made current again

    def to_bytes(self) -> bytes:
        n = len(self.ids)
        sampled = self.sampled or [False] * n
        logprobs = self.logprobs or [None] * n
        arrays: dict[str, np.ndarray] = {
            "ids": np.asarray(self.ids, dtype=np.int32).reshape(n),
            "sampled": np.asarray(sampled, dtype=np.uint8).reshape(n),
            "logprobs": np.asarray(
                [np.nan if lp is None else lp for lp in logprobs], dtype=np.float32
            ).reshape(n),
        }
        small = {
            "session_id": self.session_id,
            "version": self.version,
            "kind": self.kind,
            "start": self.start,
            "sampling": self.sampling,
            "seed": self.seed,
            "finish_reason": self.finish_reason,
            "committed_at": self.committed_at,
            "restores": self.restores,
        }
        return save(arrays, metadata={"segment": json.dumps(small)})

    @classmethod
    def from_bytes(cls, blob: bytes) -> Segment:
        try:
            arrays = load(blob)
            small = json.loads(_metadata(blob)["segment"])
        except (SafetensorError, KeyError, ValueError) as exc:
            raise ValueError(f"a damaged transcript segment: {exc}") from None
        sampled = arrays["sampled"].astype(bool).tolist()
        logprobs = [
            lp if s else None
            for lp, s in zip(arrays["logprobs"].astype(float).tolist(), sampled, strict=True)
        ]
        return cls(ids=arrays["ids"].tolist(), sampled=sampled, logprobs=logprobs, **small)

    @property
    def end(self) -> int:
        return self.start + len(self.ids)

    def to_json(self, decoder: Any) -> dict[str, Any]:
        """The segment as the transcript route shows it; `decoder` is a fresh stream
        decoder of the model's tokenizer (`feed(id)`, `flush()`)."""
        texts = [decoder.feed(i) for i in self.ids]
        if texts:
            texts[-1] += decoder.flush()
        return {
            "session_id": self.session_id,
            "version": self.version,
            "kind": self.kind,
            "start": self.start,
            "ids": self.ids,
            "text": "".join(texts),
            "texts": texts,
            "sampled": self.sampled,
            "logprobs": self.logprobs,
            "sampling": self.sampling,
            "seed": self.seed,
            "finish_reason": self.finish_reason,
            "committed_at": self.committed_at,
            "restores": self.restores,
        }


def _metadata(blob: bytes) -> dict[str, str]:
    """The safetensors header's `__metadata__` (the numpy loader drops it)."""
    size = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + size]).get("__metadata__") or {}


def lineage(segments: list[Segment], session_id: str, version: int) -> tuple[list[Segment], bool]:
    """The segments whose tokens the state of `session_id` at `version` consumed, in
    order, and whether that history is complete (nothing trimmed, nothing imported).

    `segments` is the stored transcript in commit order: first the inherited segments
    of a fork (other session ids, already a lineage), then the session's own."""
    inherited = [s for s in segments if s.session_id != session_id]
    own = {s.version: s for s in segments if s.session_id == session_id}
    walk: list[Segment] = []
    at: int | None = version
    while at is not None:
        seg = own.get(at)
        if seg is None:  # trimmed by the size bound
            return walk[::-1], False
        walk.append(seg)
        if seg.kind == "rollback":
            at = seg.restores
        elif seg.version == 0:
            at = None
        else:
            at = seg.version - 1
    complete = walk[-1].kind != "import" if walk else True
    if walk and walk[-1].kind == "fork":
        return inherited + walk[::-1], complete and _complete(inherited)
    return walk[::-1], complete


def _complete(inherited: list[Segment]) -> bool:
    """An inherited lineage is complete when it starts at position 0 from a create."""
    return not inherited or (inherited[0].start == 0 and inherited[0].kind == "create")


@dataclass(frozen=True)
class Message:
    """One message of the chat a session holds, and the version whose commit consumed it."""

    role: str
    content: str
    version: int


def conversation(
    segments: list[Segment], decode: Callable[[list[int]], str], template: ChatTemplate, bos: int | None
) -> tuple[list[Message], bool]:
    """The chat a lineage holds, read back from what its state consumed: each segment's
    prompt (the ids it did not sample) as `template` renders one turn, its sampled ids as
    the assistant's answer, less the turn stop that ended it. Also whether every segment
    read as a turn (a raw continuation or a score does not: the transcript shows those)."""
    said: list[Message] = []
    whole = True
    for seg in segments:
        skip = 1 if seg.start == 0 and bos is not None and seg.ids[:1] == [bos] else 0
        marks = seg.sampled or [False] * len(seg.ids)
        prompt = [i for i, s in zip(seg.ids[skip:], marks[skip:], strict=True) if not s]
        reply = [i for i, s in zip(seg.ids[skip:], marks[skip:], strict=True) if s]
        if not prompt and not reply:
            continue
        turn = template.read_turn(decode(prompt))
        if turn is None:
            whole = False
            continue
        said += [Message(m["role"], m["content"], seg.version) for m in turn]
        if reply:
            text = decode(reply)
            end = next((s for s in template.stop if text.endswith(s)), "")
            said.append(Message("assistant", text[: len(text) - len(end)], seg.version))
    return said, whole
