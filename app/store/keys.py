"""The Redis key schema, in one place (`P` is `Settings.key_prefix`).

A session's id is 32 lowercase hex digits (128 random bits), or for a fork, its source's
first 32, a dot and 16 more (64 random bits). Those first 32 are its *family* `F`, the hash
tag its keys share with every fork made from it, down the line (`R` is the rest of its id:
'' or the fork's '.HEX'). So a session, its forks and the pages they share live in one
Redis Cluster slot, and every session script (a fork's too) touches one slot:

    P session:{F}R     hash, the session itself; Redis TTL = its `ttl` field (sliding)
        version        int, +1 per committed change (0 at creation)
        n_tokens       int, tokens the state has consumed
        model          name of the model the session was created with
        fingerprint    `lm.fingerprint` of that model; a state never runs on another model
        created_at     unix seconds (Redis server clock)
        expires_at     unix seconds; moved forward by every use
        ttl            seconds of idleness after which the session expires
        state          the id of its snapshot's page (below)
        snapshot_bytes, delta_bytes   the size of that page, and the deltas' below
        paged          '1': the state is in pages (a session stored before pages, its
                       bytes in these fields, moves them into pages at its next use)
        commit         random id of the commit that wrote the current state (never reused)
        owner          the tenant: a hash of the API key that created it (never the key);
                       absent = '' (no keys). Every script treats another owner's session as missing
        keep           how many versions stay readable (the current one included)
        tokens         the hash of the tokens the state consumed (app/prefixes.py)
        history_bytes  bytes of the blobs in `history`
        meta_lo, blob_lo   the lowest version whose metadata, and whose blobs, `history` may hold
        transcript_bytes, transcript_trimmed
        holders, r:RESP    the stored responses whose states it holds (a chain continued in
                           place), by name, and their count: deleting one lets go, and the
                           last one deletes the session
    P deltas:{F}R      list, the ids of the delta pages committed since the snapshot, oldest first
    P lock:{F}R        string, the writer lock: a random token, with a short lease (PX)
    P history:{F}R     hash, the session's past versions (the last `keep` stay readable):
        n:V, t:V, b:V, h:V   per kept version V: n_tokens, commit time, the version of the
                             snapshot it is built on, its tokens' hash
        s:V, d:V             the pages of the snapshot and the delta a replaced chain
                             committed as V
    P transcript:{F}R  list, one packed segment per commit, oldest first (app/transcript.py)
    P pages:{F}        hash, the family's pages: page id -> how many names it has (the
                       sessions' `state`, deltas and history fields above); at zero the
                       page is deleted. A fork names its source's pages: it copies none
    P pages:{F}:ID     string, one page: a snapshot or a delta as written (`State.to_bytes`,
                       `State.delta_bytes`: safetensors + JSON; never pickled), immutable;
                       its id is the commit id of the write that made it (and `.N` for a
                       create's Nth delta). Its TTL is at least that of every session
                       naming it, re-armed by each use of one: a page whose sessions
                       expired (rather than being deleted) goes by time

A tenant's keys share its own tag (`{T}`: `tenant_of` its owner), never a session's; no
script touches both:

    P tenant:{T}:live    sorted set, the tenant's live sessions by expiry (the ledger)
    P tenant:{T}:bytes   hash, their stored bytes, and `_total`
    P tenant:{T}:made    sorted set, 's:ID' (or 'e:ID', an ephemeral session: a stateless
                         request's, an `n` fork's) by when it entered the ledger, in
                         microseconds (the listing, newest first)
    P tenant:{T}:rate    hash, its request and token buckets
    P prefix:{T}:HASH    string, "session_id:version" of a committed state whose tokens hash
                         to HASH (the prefix index; lives as the session would)

A stored response's keys share its chain's tag (`{resp_HEX}`: the first response's id, of
32 hex digits; a response that continues one by `previous_response_id` has the same 32 and
16 more, `response_id`), a conversation's its own (`{conv_HEX}`); never a session's or a
tenant's: each script (app/store/responses.py) touches one chain's or one conversation's
keys. Both expire `response_retention` seconds after their last write.

    P response:{R}       hash, a response of the Responses API (its fields are `ResponseRecord`'s,
                         app/store/records.py; `owner` and `op` the scripts' own)
        owner            the tenant, as a session's; another owner's response is missing
        status           queued | in_progress | completed | incomplete | failed | cancelled:
                         what the body says, or a script's later word (a cancel, a sweep)
        body             the Response object as the API returns it (JSON, Python's: a script
                         never re-encodes it; the reader lays `status` and `error` over it)
        error            the OpenAI error object a script failed it with (JSON), if any
        context          (a response stored before chains) the conversation it ends, its own
                         reply included, as the chat template reads it (JSON messages)
        parent           the response it continues ('' none; 'conv_…': the conversation whose
                         items it followed); its own turn is in the chain's hash
        frame, closed    what its conversation was rendered under (instructions, tools,
                         template: a digest) and whether its state ends at its reply's turn
                         stop, tokenized as the template writes it: the next turn then renders
                         and tokenizes only its new input (app/sessions/responses.py)
        input            its own input items, as input_items lists them (JSON)
        session, version, n_tokens, tokens, digest   the session holding the state the
                         response committed (its chain's, or a fork of its own), that version,
                         its tokens' count, chained hash and one-pass digest (app/prefixes.py)
        own              '1' when the response holds that session (deleting it lets go)
        background       '1' for a background response; lease: its worker's lease end (unix s)
        run              the session a background response's run made ('' in a conversation's):
                         the sweep deletes it when the run died and the response keeps no state
        events_bytes     the bytes of its events (counted in the key's quota with the record)
    P chain:{R}          hash, the chain's turns: `s:ID` a response's own turn (its input and
                         its reply, JSON messages), `p:ID` its parent, `n:ID` its references
                         (itself while it lives, and each child's turn): a deleted response's
                         turn stays while a later one's context needs it; the hash lives as
                         long as the chain's newest response
    P events:{R}         stream, a background response's events: entry id 0-(sequence_number+1),
                         fields t (the event's type) and e (its JSON); expires with the hash
    P conversation:{C}   hash (`ConversationRecord`): owner, session, version, n_tokens,
                         tokens, digest, frame, closed (the conversation's session and what it
                         has consumed, as a response's), consumed (how many of its items that
                         state consumed: the next turn reads only those after; '' once an item
                         is deleted), metadata (JSON), created_at
    P items:{C}          list, the conversation's items (JSON), oldest first
    P responses:leases   sorted set, the background responses in progress by lease end
                         (one key, its own slot: the replicas' sweep of dead workers)
"""

from __future__ import annotations

import re
import secrets
from typing import Literal

# a session's id: 32 hex digits (a new session's, 128 random bits), and for a fork, a dot and
# 16 more (64 random bits): the first 32 are its family, its keys' hash tag
SESSION_ID = re.compile(r"[0-9a-f]{32}(?:\.[0-9a-f]{16})?")


def family(session_id: str) -> str:
    """The hash tag a session's keys share with its family: the id of the session it was
    forked from, down to the first (its own id, for a session that is no fork)."""
    return session_id[:32]


def fork_id(source: str) -> str:
    """A new id for a fork of `source`, in `source`'s family."""
    return f"{family(source)}.{secrets.token_hex(8)}"


# a response's id: `resp_`, its chain's 32 hex digits, and for a continuation 16 more
RESPONSE_ID = re.compile(r"(resp_[0-9a-f]{32})([0-9a-f]{16})?")


def response_id(previous: str | None = None) -> str:
    """A new response's id: in `previous`'s chain (its keys' hash tag) when it continues
    one whose id has the chain's form, else a chain's first."""
    m = RESPONSE_ID.fullmatch(previous or "")
    return f"{m.group(1)}{secrets.token_hex(8)}" if m else f"resp_{secrets.token_hex(16)}"


def chain_of(response_id: str) -> str:
    """The hash tag of a response's keys: its chain's (`resp_` and 32 hex digits), or for an
    id of another form, the id itself."""
    m = RESPONSE_ID.fullmatch(response_id)
    return m.group(1) if m else response_id


def entry_kind(entry: str) -> Literal["session", "response", "conversation"]:
    """What a tenant's ledger entry stands for, by its id: a stored response (`resp_…`), a
    conversation (`conv_…`), else a session (its own id, a fork's, or a place held for one)."""
    if entry.startswith("resp_"):
        return "response"
    if entry.startswith("conv_"):
        return "conversation"
    return "session"


class Keys:
    def __init__(self, prefix: str):
        self.prefix = prefix

    def _tagged(self, kind: str, session_id: str) -> str:
        return f"{self.prefix}{kind}:{{{family(session_id)}}}{session_id[32:]}"

    def of_session(self, session_id: str) -> list[str]:
        """A session's keys, as every session script takes them: session, deltas, lock,
        history, transcript, and its family's pages (one hash slot)."""
        return [
            *(f(session_id) for f in (self.session, self.deltas, self.lock, self.history, self.transcript)),
            self.pages(session_id),
        ]

    def session(self, session_id: str) -> str:
        return self._tagged("session", session_id)

    def deltas(self, session_id: str) -> str:
        return self._tagged("deltas", session_id)

    def lock(self, session_id: str) -> str:
        return self._tagged("lock", session_id)

    def history(self, session_id: str) -> str:
        return self._tagged("history", session_id)

    def transcript(self, session_id: str) -> str:
        return self._tagged("transcript", session_id)

    def pages(self, session_id: str) -> str:
        """The family's pages: a hash of page id -> references; each page at `NAME:ID`."""
        return f"{self.prefix}pages:{{{family(session_id)}}}"

    def response(self, response_id: str) -> list[str]:
        """A response's keys: its hash, its events and its chain's turns (one slot)."""
        tag = chain_of(response_id)
        rest = response_id[len(tag) :]
        return [
            f"{self.prefix}response:{{{tag}}}{rest}",
            f"{self.prefix}events:{{{tag}}}{rest}",
            f"{self.prefix}chain:{{{tag}}}",
        ]

    def conversation(self, conversation_id: str) -> list[str]:
        """A conversation's keys: its hash and its items (one slot)."""
        return [
            f"{self.prefix}conversation:{{{conversation_id}}}",
            f"{self.prefix}items:{{{conversation_id}}}",
        ]

    def leases(self) -> str:
        return f"{self.prefix}responses:leases"

    def ledger(self, tenant: str) -> list[str]:
        """A tenant's ledger: its live sessions by expiry (sorted set), their bytes (hash),
        and when each entered it (sorted set, the listing)."""
        return [f"{self.prefix}tenant:{{{tenant}}}:{name}" for name in ("live", "bytes", "made")]

    def rate(self, tenant: str) -> str:
        """A tenant's request and token buckets (hash)."""
        return f"{self.prefix}tenant:{{{tenant}}}:rate"

    def prefix_entry(self, tenant: str, tokens_hash: str) -> str:
        """A committed token sequence of the tenant's (string: "session_id:version"), by hash."""
        return f"{self.prefix}prefix:{{{tenant}}}:{tokens_hash}"
