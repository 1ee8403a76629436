"""Every Prometheus metric the service exports, defined once, with vLLM-style names.

Other modules import these objects and update them; nothing else creates a metric, so
this module is the list of what `/metrics` shows. The names follow Prometheus
conventions (`_total` counters, `_seconds` and `_bytes` units) and vLLM's where one
exists (`time_to_first_token_seconds`, `inter_token_latency_seconds`,
`num_requests_running`, ...). Who updates what:

* app/api/http/middleware.py  HTTP_REQUESTS, HTTP_REQUEST_DURATION
* app/sessions/         TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, E2E_REQUEST_LATENCY,
                         GENERATION_TOKENS, PROMPT_TOKENS, REQUESTS_FINISHED,
                         HOT_CACHE_HITS, HOT_CACHE_MISSES, PREFIX_REUSE_* (prefix reuse)
* app/store/            STATE_BYTES_READ, STATE_BYTES_WRITTEN, REDIS_ERRORS
* app/tenants.py         TENANT_*, QUOTA_REFUSALS (quotas)
* the gauges, and the engine's own counters (decode steps and tokens, prefill tokens,
  seconds loading and encoding states, malloc_trim calls and their seconds), are read
  from the live engine and hot cache when scraped (`bind_engine`): the engine imports
  nothing of this module

This module never imports the engine, the store or FastAPI.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# vLLM's buckets: token latencies span milliseconds (GPU decode) to seconds (a long prefill)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)

# -- HTTP --------------------------------------------------------------------------------------
HTTP_REQUESTS = Counter(
    "recur_http_requests",
    "HTTP requests answered, by method, route template and status code",
    ["method", "route", "status"],
)
HTTP_REQUEST_DURATION = Histogram(
    "recur_http_request_duration_seconds",
    "Seconds from a request's arrival to the end of its response (streams included)",
    ["method", "route"],
)

# -- generation --------------------------------------------------------------------------------
TIME_TO_FIRST_TOKEN = Histogram(
    "recur_time_to_first_token_seconds",
    "Seconds from a generate request's arrival to its first token",
    buckets=_TTFT_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "recur_inter_token_latency_seconds",
    "Seconds between consecutive tokens of one generation",
    buckets=_ITL_BUCKETS,
)
E2E_REQUEST_LATENCY = Histogram(
    "recur_e2e_request_latency_seconds",
    "Seconds from a generate request's arrival to its commit",
    buckets=_E2E_BUCKETS,
)
GENERATION_TOKENS = Counter("recur_generation_tokens", "Tokens generated (sampled and consumed)")
PROMPT_TOKENS = Counter("recur_prompt_tokens", "Prompt tokens consumed by generate requests")
REQUESTS_FINISHED = Counter(
    "recur_request_success",
    "Generations committed, by finish reason (length, stop, eos)",
    ["finished_reason"],
)

# -- tenants (by key id: 96 bits of the key's hash, never the key; `open` without keys) --------
TENANT_REQUESTS = Counter("recur_tenant_requests", "Requests to /v1 routes, by tenant", ["tenant"])
TENANT_GENERATED_TOKENS = Counter("recur_tenant_generated_tokens", "Tokens generated, by tenant", ["tenant"])
TENANT_SESSIONS = Gauge("recur_tenant_sessions", "Live sessions a tenant holds (as last seen)", ["tenant"])
TENANT_STATE_BYTES = Gauge(
    "recur_tenant_state_bytes", "Stored state bytes a tenant holds (as last seen)", ["tenant"]
)
QUOTA_REFUSALS = Counter(
    "recur_quota_refusals",
    "Requests refused at a tenant's limit (sessions, bytes, requests, tokens)",
    ["tenant", "limit"],
)

# -- scheduler (read when scraped) ----------------------------------------------------------
NUM_REQUESTS_RUNNING = Gauge(
    "recur_num_requests_running", "Sessions in the running batch (decoding or consuming their prompt)"
)
NUM_REQUESTS_WAITING = Gauge("recur_num_requests_waiting", "Generations queued, waiting for a batch slot")
HOT_CACHE_BYTES = Gauge("recur_hot_cache_bytes", "Bytes of session states held in the hot cache")
HOT_CACHE_SESSIONS = Gauge("recur_hot_cache_sessions", "Sessions whose state the hot cache holds")

# -- state storage -----------------------------------------------------------------------------
STATE_BYTES_READ = Counter("recur_state_bytes_read", "State bytes read from Redis")
STATE_BYTES_WRITTEN = Counter("recur_state_bytes_written", "State bytes written to Redis")
HOT_CACHE_HITS = Counter("recur_hot_cache_hits", "Session states served from the in-memory hot cache")
HOT_CACHE_MISSES = Counter("recur_hot_cache_misses", "Session states that had to be read from Redis")
PREFIX_REUSE_HITS = Counter(
    "recur_prefix_reuse_hits",
    "Stateless requests that forked a committed state holding a prefix of their tokens",
)
PREFIX_REUSE_MISSES = Counter(
    "recur_prefix_reuse_misses", "Stateless requests that found no committed prefix and prefilled everything"
)
PREFIX_TOKENS_SAVED = Counter(
    "recur_prefix_reuse_tokens_saved",
    "Prompt tokens that stateless requests did not prefill, thanks to reuse",
)
RESPONSES = Counter(
    "recur_responses", "Responses of the Responses API, by the status they ended with", ["status"]
)
RESPONSES_BACKGROUND_QUEUED = Gauge(
    "recur_responses_background_in_progress",
    "Background responses queued or in progress on every replica (the lease register, as this replica last read it)",
)
RESPONSE_REUSE = Counter(
    "recur_response_reuse",
    "Responses continued by previous_response_id or conversation: `hit` prefilled only the new input, `miss` "
    "prefilled it all (the stored state was gone, or the conversation changed)",
    ["result"],
)
RESPONSE_TOKENS_REUSED = Counter(
    "recur_response_tokens_reused", "Input tokens of continued responses that their stored state already held"
)
REDIS_ERRORS = Counter("recur_redis_errors", "Redis commands that failed (unreachable, timed out)")


# -- the engine's counters (read when scraped) -------------------------------------------------
# name, help, the field of the engine's counters it reads
_ENGINE_COUNTERS = (
    ("recur_decode_steps", "Decode steps run (one forward pass for the whole batch)", "decode_steps"),
    ("recur_decode_tokens", "Tokens sampled by decode steps, all rows together", "decode_tokens"),
    ("recur_prefill_tokens", "Prompt tokens consumed by prefill steps", "prefill_tokens"),
    (
        "recur_state_parse_seconds",
        "Seconds the loader thread spent parsing and verifying stored state bytes",
        "parse_seconds",
    ),
    (
        "recur_state_load_seconds",
        "Seconds the engine thread spent turning parsed states into live ones",
        "load_seconds",
    ),
    ("recur_state_encode_seconds", "Seconds spent turning states into commit bytes", "encode_seconds"),
)


class _EngineCollector(Collector):
    """The engine's counters, read from the live engine at each scrape."""

    def __init__(self) -> None:
        self.engine: Any = None  # app.engine.Engine, once bound

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        engine = self.engine
        if engine is None:
            return
        counters = engine.counters
        for name, doc, field in _ENGINE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(counters, field))
        yield GaugeMetricFamily(
            "recur_decode_batch_max", "Most rows one decode step has run", value=counters.max_batch
        )
        yield from _compile_metrics(engine.decode_step)
        trimmer = engine.trimmer
        yield CounterMetricFamily(
            "recur_malloc_trims",
            "Times the engine handed freed host memory back (malloc_trim)",
            value=trimmer.releases,
        )
        yield CounterMetricFamily(
            "recur_malloc_trim_seconds",
            "Seconds the engine thread spent in malloc_trim",
            value=trimmer.seconds,
        )


def _compile_metrics(step: Any) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """The background compile of the decode step (app/engine/compiler.py): how long it took
    (0 while it runs or when it is off), which batch classes run the compiled step, and how
    many steps it ran."""
    status = step.status
    yield CounterMetricFamily(
        "recur_decode_compiled_steps", "Decode steps handed to the compiled step", value=step.compiled_steps
    )
    yield GaugeMetricFamily(
        "recur_decode_compile_seconds",
        "Seconds the background compile and probe of the decode step took (0: off or still running)",
        value=status.seconds if status.state in ("ready", "failed") else 0.0,
    )
    compiled = GaugeMetricFamily(
        "recur_decode_compiled",
        "1 where the compiled decode step serves batches of this size class (up to this many rows, "
        "more than the class below), 0 where the eager one does",
        labels=["batch"],
    )
    for rows in sorted(status.verdicts):
        compiled.add_metric([str(rows)], 1.0 if step.serves_compiled(rows) else 0.0)
    yield compiled
    yield GaugeMetricFamily(
        "recur_prefill_compiled",
        "1 where prefills run the model's compiled per-token parts (RLT's recurrence), 0 where they run eagerly",
        value=1.0 if step.prefill_compiled else 0.0,
    )
    state = GaugeMetricFamily(
        "recur_decode_compile_state",
        "1 for the background compile's state: off, compiling, ready (the probe's verdicts serve) or failed "
        "(the eager step serves; the log says why)",
        labels=["state"],
    )
    for name in ("off", "compiling", "ready", "failed"):
        state.add_metric([name], 1.0 if status.state == name else 0.0)
    yield state


_ENGINE = _EngineCollector()
REGISTRY.register(_ENGINE)


def bind_engine(engine: Any, cache: Any) -> None:
    """Make the engine's gauges and counters read the live engine (`app.engine.Engine`) and
    hot cache (`app.sessions.HotCache`) at each scrape."""
    NUM_REQUESTS_RUNNING.set_function(lambda: engine.scheduler.num_running)
    NUM_REQUESTS_WAITING.set_function(lambda: engine.scheduler.num_waiting)
    HOT_CACHE_BYTES.set_function(lambda: cache.nbytes)
    HOT_CACHE_SESSIONS.set_function(lambda: len(cache))
    _ENGINE.engine = engine


def exposition() -> tuple[bytes, str]:
    """The text exposition of every metric (this module's and the process collector's)."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
