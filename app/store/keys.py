"""The Redis key schema, in one place (`P` is `Settings.key_prefix`).

A session's keys share its id as their hash tag (`{ID}`, 32 lowercase hex digits, 128
random bits), so all of them live in one Redis Cluster slot and every session script
touches one slot:

    P session:{ID}     hash, the session itself; Redis TTL = its `ttl` field (sliding)
        version        int, +1 per committed change (0 at creation)
        n_tokens       int, tokens the state has consumed
        model          name of the model the session was created with
        fingerprint    `lm.fingerprint` of that model; a state never runs on another model
        created_at     unix seconds (Redis server clock)
        expires_at     unix seconds; moved forward by every use
        ttl            seconds of idleness after which the session expires
        state          the state snapshot (`State.to_bytes`: safetensors + JSON; never pickled)
        delta_bytes    total size of the deltas below
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
    P deltas:{ID}      list, the state deltas committed since the snapshot, oldest first
    P lock:{ID}        string, the writer lock: a random token, with a short lease (PX)
    P history:{ID}     hash, the session's past versions (the last `keep` stay readable):
        n:V, t:V, b:V, h:V   per kept version V: n_tokens, commit time, the version of the
                             snapshot it is built on, its tokens' hash
        s:V, d:V             the snapshot and the delta a replaced chain committed as V
    P transcript:{ID}  list, one packed segment per commit, oldest first (app/transcript.py)

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

A stored response's keys share its id as their tag (`{resp_HEX}`), a conversation's its
own (`{conv_HEX}`); never a session's or a tenant's: each script (app/store/responses.py)
touches one object's keys. Both expire `response_retention` seconds after their last write.

    P response:{R}       hash, a response of the Responses API (its fields are `ResponseRecord`'s,
                         app/store/records.py; `owner` and `op` the scripts' own)
        owner            the tenant, as a session's; another owner's response is missing
        status           queued | in_progress | completed | incomplete | failed | cancelled:
                         what the body says, or a script's later word (a cancel, a sweep)
        body             the Response object as the API returns it (JSON, Python's: a script
                         never re-encodes it; the reader lays `status` and `error` over it)
        error            the OpenAI error object a script failed it with (JSON), if any
        context          the conversation it ends, its own reply included, as the chat
                         template reads it (JSON messages; the instructions are not kept)
        input            its own input items, as input_items lists them (JSON)
        session, version, n_tokens, tokens   the session holding the state the response
                         committed (its chain's, or a fork of its own), that version, its
                         tokens' count and hash (app/prefixes.py)
        own              '1' when the response holds that session (deleting it lets go)
        background       '1' for a background response; lease: its worker's lease end (unix s)
        run              the session a background response's run made ('' in a conversation's):
                         the sweep deletes it when the run died and the response keeps no state
        events_bytes     the bytes of its events (counted in the key's quota with the record)
    P events:{R}         stream, a background response's events: entry id 0-(sequence_number+1),
                         fields t (the event's type) and e (its JSON); expires with the hash
    P conversation:{C}   hash (`ConversationRecord`): owner, session, version, n_tokens (the
                         conversation's session and what it has consumed), metadata (JSON),
                         created_at
    P items:{C}          list, the conversation's items (JSON), oldest first
    P responses:leases   sorted set, the background responses in progress by lease end
                         (one key, its own slot: the replicas' sweep of dead workers)
"""

from __future__ import annotations

import re

SESSION_ID = re.compile(r"[0-9a-f]{32}")


class Keys:
    def __init__(self, prefix: str):
        self.prefix = prefix

    def of_session(self, session_id: str) -> list[str]:
        """A session's keys, as every session script takes them: session, deltas, lock,
        history, transcript (one hash slot)."""
        return [f(session_id) for f in (self.session, self.deltas, self.lock, self.history, self.transcript)]

    def session(self, session_id: str) -> str:
        return f"{self.prefix}session:{{{session_id}}}"

    def deltas(self, session_id: str) -> str:
        return f"{self.prefix}deltas:{{{session_id}}}"

    def lock(self, session_id: str) -> str:
        return f"{self.prefix}lock:{{{session_id}}}"

    def history(self, session_id: str) -> str:
        return f"{self.prefix}history:{{{session_id}}}"

    def transcript(self, session_id: str) -> str:
        return f"{self.prefix}transcript:{{{session_id}}}"

    def response(self, response_id: str) -> list[str]:
        """A response's keys: its hash and its events (one slot)."""
        return [f"{self.prefix}response:{{{response_id}}}", f"{self.prefix}events:{{{response_id}}}"]

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
