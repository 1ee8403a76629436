"""The service's settings: one pydantic-settings class (`Settings`; its fields but for the
keys and quotas are declared in its base, `ServiceSettings`, to keep each class a size a
reader holds), the single source of truth.

Every field can be set from the environment (prefix `RECUR_`, e.g. `RECUR_REDIS_URL`) or
from the matching `recur serve` flag (`--redis-url`), which `app/cli.py` generates from
this class. Nothing else in `app/` reads `os.environ`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.logs import LogFormat


class ServiceSettings(BaseSettings):
    """The service's settings but for the keys and the tenants' quotas (`Settings` adds them)."""

    model_config = SettingsConfigDict(env_prefix="RECUR_", extra="forbid", protected_namespaces=())

    model: str = Field(
        "shakespeare",
        description="shipped model name (shakespeare, shakespeare-rlt; smollm2, an assistant), checkpoint "
        "directory or GGUF file",
    )
    model_options: str | None = Field(
        None,
        description="the model's serving options, name=value[,name=value] (a LLaMA-architecture LLM's: "
        "sinks, window, tgt_len); each family lists its own",
    )
    host: str = Field("127.0.0.1", description="address to listen on")
    allowed_hosts: str = Field(
        "localhost,127.0.0.1,::1",
        description="comma-separated host names this server answers to (the Host header, port aside); "
        "others get 403, so a web page cannot reach it through DNS rebinding. * answers to any: for a "
        "server behind a proxy or a load balancer that checks the name itself",
    )
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    max_connections: int = Field(
        4096, ge=1, description="HTTP connections this replica holds at once (kept under the open-file limit)"
    )
    max_connections_per_address: int = Field(
        512,
        ge=0,
        description="HTTP connections one client address may hold at once; past either limit a new one "
        "gets 429 queue_full and is closed (0 = none: behind a proxy, set 0 and limit clients there)",
    )
    header_timeout: float = Field(
        10.0,
        gt=0,
        description="seconds a connection has, from its opening or its last response, to send a whole "
        "request head; past it the connection is closed, however the head trickles in (slowloris)",
    )
    keep_alive_timeout: int = Field(5, ge=1, description="seconds an idle keep-alive connection stays open")
    redis_url: str | None = Field(
        None,
        description="Redis to keep sessions in: redis://host:port/db (one server), "
        "redis+cluster://host:port[,host:port...] (a Redis Cluster), or "
        "redis+sentinel://host:port[,host:port...]/service[/db] (the primary these Sentinels name); "
        "unset: start an embedded redis-server under data_dir",
    )
    data_dir: Path = Field(Path("data"), description="where the embedded Redis keeps its data")
    data_max_mb: int = Field(
        2048,
        ge=16,
        description="the embedded Redis's maxmemory in MiB (noeviction): past storage_guard of it, new sessions "
        "and growing commits get 507 storage_full, so data_dir stays bounded (its append-only file is "
        "rewritten at twice the data, so about 2 to 3 times this on disk). A Redis of your own is yours to size",
    )
    key_prefix: str = Field("recur:", description="prefix of every Redis key this service writes")
    session_ttl: int = Field(86400, ge=1, description="seconds a session lives after its last use (sliding)")
    max_session_ttl: int = Field(30 * 86400, ge=1, description="largest ttl_seconds a client may ask for")
    prefix_reuse: bool = Field(
        True,
        description="index every committed state by its tokens, so that an OpenAI request without a session "
        "forks the longest committed prefix of its own tokens (its key's only) and prefills just the rest",
    )
    stateless_session_ttl: int = Field(
        900,
        ge=1,
        description="seconds (sliding) that a session made only to serve a request without a session lives: "
        "long enough for the next turn of a chat to find it, short enough to leave no orphans",
    )
    response_retention: int = Field(
        30 * 86400,
        ge=1,
        description="seconds a stored response (and its state) or a conversation lives after its last write "
        "(OpenAI keeps responses 30 days)",
    )
    response_lease_seconds: float = Field(
        10.0,
        gt=0,
        description="a background response's worker renews its lease this often (a third of it); another replica "
        "marks a response whose lease lapsed failed within 1.5 times this (its replica died)",
    )
    max_tokens: int = Field(1024, ge=1, description="cap on max_tokens of one generate request")
    max_prompt_tokens: int = Field(8192, ge=1, description="longest prompt one request may send (else 413)")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    precision: Literal["auto", "fp32", "bf16", "int8", "int4"] = Field(
        "auto",
        description="compute precision: auto (bf16 on CUDA; on CPU int4 for a GGUF file of Q4 blocks, such as "
        "the shipped smollm2, where recur's int4 kernel is built, else fp32), fp32, bf16 (autocast, on CPU too), "
        "int8 (bfloat16 activations) or int4 (packed weights on CPU, for the families that have the path: "
        "LLaMA-architecture LLMs; a GGUF's Q4 blocks are packed as they are, with fp32 products)",
    )
    state_dtype: Literal["float32", "bfloat16", "float16", "int8"] = Field(
        "float32",
        description="precision of a session's state. For a model whose state is a cache of keys and values "
        "(LLaMA-architecture LLMs, Transformer-XL, RLT) the state itself keeps it: each position rounded as the "
        "model appends it, so a text gives the same answer in one request or many, and its stored bytes are "
        "x0.5 (bfloat16, float16) or about x0.26 (int8) of float32's. Any other model (Mamba, Mamba-2, the "
        "hybrids) keeps float32 states and rounds them when stored (not int8): not exact across requests",
    )
    cpu_threads: int = Field(
        0,
        ge=0,
        description="torch intra-op threads on CPU (0 = torch's default); 1 is fastest on a busy machine",
    )
    max_batch_size: int = Field(32, ge=1, description="most sessions decoded together in one forward pass")
    prefill_tokens_per_step: int = Field(
        32,
        ge=1,
        description="prompt tokens one engine step consumes while other sessions decode (chunked "
        "prefill): a long prompt is consumed over many steps and the decoding streams advance every "
        "step; larger gives a long prompt its first token sooner, smaller keeps others' token gaps "
        "shorter. While more rows wait on their prompts than decode, a step consumes this many for "
        "each waiting row per decoding row (rounded up, up to one segment), in equal chunks: a "
        "burst of requests reaches its first tokens together (with nothing decoding, a prompt is "
        "consumed a whole segment per step)",
    )
    max_queued_requests: int = Field(
        256, ge=1, description="requests waiting for the scheduler beyond which new ones get 429"
    )
    max_queued_tokens: int = Field(
        262_144, ge=1, description="prompt tokens waiting for the scheduler beyond which new requests get 429"
    )
    max_streams_per_key: int = Field(
        64,
        ge=1,
        description="generations one client (an API key; without keys, a client address) runs at once on "
        "one replica; more get 429 quota_exceeded at once, before any work",
    )
    max_replays_per_key: int = Field(
        8,
        ge=1,
        description="replays of background responses' events (GET /v1/responses/{id}?stream=true) one "
        "client (as max_streams_per_key counts them) runs at once on one replica; more get 429 "
        "quota_exceeded at once, before any read",
    )
    replay_mb_per_second: float = Field(
        1.0,
        ge=0,
        description="MiB a second one client's replays of background responses' events send together "
        "from one replica (a replay costs the replica per byte: past this, it is paced, not refused; "
        "0 = no limit)",
    )
    key_batch_share: float = Field(
        0.0625,
        gt=0,
        le=1,
        description="most of the batch one client holds while a client with less work is active: past "
        "it, its newest rows wait (their states kept) so the other's steps stay short; alone, a client "
        "may fill the batch, and clients that all have much work split it evenly. The default keeps a "
        "flooded CPU replica's other clients within 2x of their latency alone (bench/hostile.py); on a "
        "GPU, where a larger batch costs little more, raise it",
    )
    key_queue_share: float = Field(
        0.75,
        gt=0,
        le=1,
        description="most of the queue (max_queued_requests, max_queued_tokens) one client's requests "
        "may fill; past it that client gets 429 queue_full while others still get in",
    )
    stream_buffer_tokens: int = Field(
        256,
        ge=0,
        description="tokens a stream may leave unread by its client before its generation pauses (out of "
        "the batch, its state kept) until the client reads; 0 = never pause",
    )
    stream_send_timeout: float = Field(
        60.0,
        ge=0,
        description="seconds a stream waits to write to a client that does not read before it is dropped "
        "(as a disconnect: on_disconnect applies); 0 = never",
    )
    hot_cache_mb: float = Field(
        256.0, ge=0, description="device memory for recently used session states (0 = no hot cache)"
    )
    malloc_trim_interval: float = Field(
        5.0,
        ge=0,
        description="seconds between handing freed host memory back to the OS (glibc malloc_trim; "
        "0 = never): without it a replica stays at the size of its largest batch ever",
    )
    delta_persistence: bool = Field(
        True, description="commit only what changed in a state (a delta) instead of the whole state"
    )
    history_versions: int = Field(
        8,
        ge=1,
        description="versions of a session that stay readable (fork or roll back to them; the current one "
        "included); a session may ask for another number at creation, up to max_history_versions",
    )
    max_history_versions: int = Field(64, ge=1, description="most versions a session may ask to keep")
    transcript_max_kb: float = Field(
        1024.0,
        gt=0,
        description="most transcript one session keeps, in KiB (about 9 bytes per token plus a few hundred "
        "per commit); past it the oldest commits' segments are dropped",
    )
    compile: bool = Field(
        False,
        description="torch.compile the decode step in the background while the eager one serves "
        "(CUDA graphs via mode reduce-overhead on CUDA), and use it for the batch sizes where "
        "a probe measured it faster and equal within 1e-4 (recur_decode_compiled in /metrics); off by "
        "default: on a small CPU host the compile costs more than it earns in a server's first 10 minutes "
        "(docs/BENCHMARKS.md, Background compile)",
    )
    engine_step_deadline: float = Field(
        60.0,
        gt=0,
        description="seconds one engine step (a prompt chunk, or one token for every decoding stream) may "
        "take: past it the requests in the step fail with 503 engine_stalled, nothing of them committed, and "
        "the replica answers /readyz and new requests with 503 until the step ends",
    )
    lock_lease_seconds: float = Field(
        10.0, gt=0, description="lease of a session's writer lock; the holder renews it while working"
    )
    redis_timeout: float = Field(
        2.0, gt=0, description="socket timeout for Redis, so a dead Redis fails fast"
    )
    redis_max_connections: int = Field(
        64,
        ge=1,
        description="most connections this replica opens to Redis; a request waits (up to the Redis timeout) "
        "for a free one rather than opening more, so a burst never floods Redis with clients",
    )
    log_level: str = Field("info", description="uvicorn log level")
    max_body_bytes: int = Field(
        1 << 20,
        ge=1,
        description="largest request body accepted; a larger one gets 413 before it is read in full",
    )
    max_import_mb: float = Field(
        0.0,
        ge=0,
        description="largest state a client may import (POST /v1/sessions/import), in MiB; 0: twice the "
        "largest state the served model can produce (a real export always fits; anything larger is 413 "
        "before it is read)",
    )
    max_concurrent_imports: int = Field(
        2,
        ge=1,
        description="state imports one replica reads and parses at once, one client at most half of them (at "
        "least 1); more get 429 queue_full at once, before their bodies are read (imports bound their memory)",
    )
    import_mb_per_second: float = Field(
        16.0,
        ge=0,
        description="MiB a second one client's state imports may bring to one replica, after a burst of "
        "4 seconds' worth (a full state at once): past it they are paced, not refused (0 = no limit)",
    )
    log_format: LogFormat = Field(
        "auto",
        description="auto: text when stderr is a terminal, else json; json: one JSON object per line; "
        "text: plain lines (both carry request_id and session_id)",
    )
    storage_guard: float = Field(
        0.9,
        gt=0,
        le=1,
        description="fraction of Redis's maxmemory past which new sessions and growing commits get "
        "507 storage_full, before Redis itself refuses writes (Redis without maxmemory: never)",
    )


class Settings(ServiceSettings):
    """Every setting of the service: the keys and the tenants' quotas, after the rest."""

    api_keys: SecretStr | None = Field(
        None,
        description="comma-separated API keys; when any key is set, every /v1 route needs "
        "`Authorization: Bearer KEY`, and each key is a tenant that sees only its own sessions",
    )
    api_keys_file: Path | None = Field(
        None,
        description="file of API keys, one per line, each optionally followed by its quotas "
        "(KEY sessions=N state_mb=X requests_per_second=X tokens_per_second=X); blank lines and # "
        "comments skipped; adds to api_keys",
    )
    metrics_access: Literal["open", "api_key", "off"] = Field(
        "open", description="/metrics: open to all, api_key (any valid key), or off (404)"
    )
    quota_sessions: int = Field(
        10_000,
        ge=1,
        description="most live sessions one tenant may hold (a tenant is an API key; with no keys, all "
        "clients together); a key in the keys file may override it (sessions=N)",
    )
    quota_state_mb: float = Field(
        2048.0, gt=0, description="most stored state one tenant may hold, in MiB (override: state_mb=X)"
    )
    quota_requests_per_second: float = Field(
        0.0,
        ge=0,
        description="requests per second one tenant may send, shared by all replicas (a token bucket "
        "holding one second's worth; 0 = no limit; override: requests_per_second=X)",
    )
    quota_tokens_per_second: float = Field(
        0.0,
        ge=0,
        description="generated tokens per second one tenant may draw, shared by all replicas (a "
        "generation may overdraw; the next waits the debt out; 0 = no limit; override: tokens_per_second=X)",
    )

    def load_api_keys(self) -> list[str]:
        """Every configured key (the file is read now). Raises ValueError with a clear message."""
        return list(self.load_tenants())

    def quota(self) -> Quota:
        """The quota of a tenant whose key sets none of its own (and of all clients, without keys)."""
        return Quota(
            sessions=self.quota_sessions,
            state_bytes=int(self.quota_state_mb * 2**20),
            requests_per_second=self.quota_requests_per_second,
            tokens_per_second=self.quota_tokens_per_second,
        )

    def load_tenants(self) -> dict[str, Quota]:
        """Every configured key with its quota (the file is read now). Raises ValueError with
        a clear message."""
        default = self.quota()
        keys = [k.strip() for k in (self.api_keys.get_secret_value() if self.api_keys else "").split(",")]
        tenants = {k: default for k in keys if k}
        if self.api_keys_file is not None:
            tenants.update(_read_key_file(self.api_keys_file, default))
        return tenants


def _read_key_file(path: Path, default: Quota) -> dict[str, Quota]:
    """A key file's keys with their quotas: a line is `KEY [sessions=N] [state_mb=X]
    [requests_per_second=X] [tokens_per_second=X]`; blank lines and # comments are skipped."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read the API key file {path}: {exc.strerror}") from None
    from_file = [ln.split() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    if not from_file:  # never let an empty file silently leave /v1 open
        raise ValueError(f"the API key file {path} holds no keys")
    return {key: _override(default, overrides, path) for key, *overrides in from_file}


@dataclass(frozen=True)
class Quota:
    """One tenant's quota."""

    sessions: int
    state_bytes: int
    requests_per_second: float  # 0 = no limit
    tokens_per_second: float  # 0 = no limit


_OVERRIDES = {"sessions": int, "state_mb": float, "requests_per_second": float, "tokens_per_second": float}


def _override(limits: Quota, overrides: list[str], source: Path) -> Quota:
    """`limits` with a key file line's `name=value` overrides applied."""
    changes: dict[str, Any] = {}
    for item in overrides:
        name, _, value = item.partition("=")
        if name not in _OVERRIDES:
            raise ValueError(f"{source}: unknown quota {name!r} (known: {', '.join(_OVERRIDES)})")
        try:
            number = _OVERRIDES[name](value)
        except ValueError:
            raise ValueError(f"{source}: quota {name} must be a number, not {value!r}") from None
        if number < 0 or (name in ("sessions", "state_mb") and number <= 0):
            raise ValueError(f"{source}: quota {name}={value} is out of range")
        if name == "state_mb":
            changes["state_bytes"] = int(number * 2**20)
        else:
            changes[name] = number
    return dataclasses.replace(limits, **changes)
