"""Many generations of one request, as a sessions-service operation: OpenAI's `n` choices
and prompts, and requests that name no session.

`start_generations` starts `n` generations per prompt, together so that the engine batches them:
choice j of prompt i runs in session `sid`, or (none named) a session of its own that
starts from the longest committed prefix of the prompt's tokens (prefix reuse); the other
n - 1 in forks of that session taken before any starts. All start, or none does: those
started are closed and the sessions this request made deleted. The places of the sessions
it makes are held in the tenant's quota first, all or none (`Tenants.places`), so that
requests racing for a tenant's last places cannot each take some and all fail. The OpenAI routes frame
the result (app/api/openai/framing.py); they never make or clean up a session.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from app import metrics, prefixes
from app.store import CommitConflict, SessionNotFound, VersionGone, VersionMismatch

from .run import Run
from .service import Generation, SessionService

log = logging.getLogger("recur.sessions")
T = TypeVar("T")


@dataclass
class Started:
    """The runs of one request, choices i*n .. i*n+n-1 for prompt i (OpenAI's order), and
    per prompt the tokens its session already held (prefix reuse: not prefilled)."""

    runs: list[Run]
    cached: list[int]


async def start_generations(
    service: SessionService,
    owner: str,
    sid: str | None,
    prompts: list[list[int]],
    gen: Generation,
    n: int = 1,
) -> Started:
    """`n` generations per prompt (see the module). With a seed s, choice j of a prompt
    samples with seed s + j."""
    made: list[str] = []  # every session this request creates, deleted if it fails to start
    try:
        async with service.tenants.starting(owner, n * len(prompts), gen.max_tokens) as admitted:
            new = len(prompts) * (n - 1 + (sid is None))  # the sessions it makes, held all or none
            async with service.tenants.places(owner, new):
                groups = await _gather(
                    *(_sessions_of(service, owner, sid, ids, n, gen, made) for ids in prompts)
                )
            runs = await _gather(
                *(
                    service.generate(s, ids, _nth(gen, j), expected=v, owner=owner)
                    for ids, targets in groups
                    for j, (s, v) in enumerate(targets)
                )
            )
        for r in runs:
            admitted(r)
    except BaseException as exc:
        await asyncio.gather(*(_forget(service, owner, s) for s in made))
        if isinstance(exc, VersionMismatch):  # only n > 1 expects a version: a commit came between
            raise CommitConflict(str(sid), exc.expected, exc.actual) from exc
        raise
    return Started(runs, [len(prompt) - len(ids) for prompt, (ids, _) in zip(prompts, groups, strict=True)])


async def stateless(
    service: SessionService, ids: list[int], owner: str, reuse: bool = True, ttl: int | None = None
) -> tuple[str, list[int]]:
    """A session for a request that names none, and the ids it has yet to consume: a fork
    of the owner's longest committed state whose tokens are a prefix of BOS+`ids` (the
    matched session itself is never touched), or a new session holding BOS. Either lives
    `stateless_ttl` (or `ttl`), so stateless traffic leaves no long-lived sessions behind.
    `reuse=False`: always the new session (the request must consume its whole prompt)."""
    tokens = service.with_bos(ids)
    ttl = ttl or service.stateless_ttl
    if service.prefix_reuse and reuse:
        hashes = prefixes.prefixes(prefixes.root(service.engine.fingerprint), tokens)
        # (longest first; a prefix of BOS alone saves nothing a create would not do)
        found = await service.tenants.find_prefix(owner, hashes[::-1][: max(0, len(tokens) - 1)])
        if found is not None:
            i, match, version = found
            held = len(tokens) - i
            try:
                meta = await service.fork(
                    match,
                    None,
                    owner,
                    version,
                    ttl=ttl,
                    tokens_hash=hashes[held - 1],
                    ephemeral=True,
                )
            except (SessionNotFound, VersionGone):  # expired, or a stale entry: prefill it all
                pass
            else:
                metrics.PREFIX_REUSE_HITS.inc()
                metrics.PREFIX_TOKENS_SAVED.inc(held)
                return meta.id, tokens[held:]
        metrics.PREFIX_REUSE_MISSES.inc()
    return (await service.create([], ttl, owner, ephemeral=True)).id, ids


def needs_whole_prompt(gen: Generation) -> bool:
    """Whether a generation must consume its whole prompt itself, not start from a reused
    prefix (which leaves it only the rest): the repetition penalty counts the request's
    prompt, and echo reports the prompt's log-probs."""
    return gen.params.repetition_penalty != 1 or gen.logprobs.prompt


async def _sessions_of(
    service: SessionService,
    owner: str,
    sid: str | None,
    ids: list[int],
    n: int,
    gen: Generation,
    made: list[str],
) -> tuple[list[int], list[tuple[str, int | None]]]:
    """The ids one prompt's generations consume, and the n (session, expected version) they
    run in: session `sid`, or (None) one of its own (`stateless`); then n-1 forks of it,
    each at that version."""
    own = sid is None
    if sid is None:
        sid, ids = await stateless(service, ids, owner, reuse=not needs_whole_prompt(gen))
        made.append(sid)
    if n == 1:
        return ids, [(sid, None)]
    meta = await service.get(sid, owner)
    ttl = service.stateless_ttl if own else meta.ttl
    source = sid

    async def fork() -> tuple[str, int | None]:
        f = await service.fork(source, meta.version, owner, ttl=ttl, ephemeral=True)
        made.append(f.id)
        return f.id, f.version

    return ids, [(source, meta.version), *await _gather(*(fork() for _ in range(n - 1)))]


async def _gather(*aws: Awaitable[T]) -> list[T]:
    """Every awaitable's result, or (once all have ended) the first failure, after closing
    the runs that did start."""
    done = await asyncio.gather(*aws, return_exceptions=True)
    failed = next((r for r in done if isinstance(r, BaseException)), None)
    if failed is None:
        return list(done)  # type: ignore[arg-type]  # no exception among them
    await asyncio.gather(*(r.close() for r in done if isinstance(r, Run)))
    raise failed


def _nth(gen: Generation, j: int) -> Generation:
    """Choice j's generation: seed s + j, when a seed s is given."""
    return gen if gen.seed is None or j == 0 else dataclasses.replace(gen, seed=gen.seed + j)


async def _forget(service: SessionService, owner: str, session_id: str) -> None:
    """Delete a session a failed request made (best effort: it expires anyway)."""
    try:
        await service.delete(session_id, None, owner)
    except Exception:
        log.warning("could not delete session %s, made for a request that failed", session_id)
