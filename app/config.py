"""The service's settings: one pydantic-settings class, the single source of truth.

Every field can be set from the environment (prefix `RECUR_`, e.g. `RECUR_REDIS_URL`) or
from the matching `recur serve` flag (`--redis-url`), which `app/cli.py` generates from
this class. Nothing else in `app/` reads `os.environ`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RECUR_", extra="forbid", protected_namespaces=())

    model: str = Field("shakespeare", description="shipped model name or checkpoint directory")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    redis_url: str | None = Field(
        None, description="Redis to keep sessions in; unset: start an embedded redis-server under data_dir"
    )
    data_dir: Path = Field(Path("data"), description="where the embedded Redis keeps its data")
    key_prefix: str = Field("recur:", description="prefix of every Redis key this service writes")
    session_ttl: int = Field(86400, ge=1, description="seconds a session lives after its last use (sliding)")
    max_session_ttl: int = Field(30 * 86400, ge=1, description="largest ttl_seconds a client may ask for")
    max_tokens: int = Field(1024, ge=1, description="cap on max_tokens of one generate request")
    max_prompt_tokens: int = Field(8192, ge=1, description="longest prompt one request may send (else 413)")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="compute precision (bf16 on CUDA only)"
    )
    state_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of float tensors in stored states (float32 is exact)"
    )
    cpu_threads: int = Field(
        0,
        ge=0,
        description="torch intra-op threads on CPU (0 = torch's default); 1 is fastest on a busy machine",
    )
    max_batch_size: int = Field(32, ge=1, description="most sessions decoded together in one forward pass")
    lock_lease_seconds: float = Field(
        10.0, gt=0, description="lease of a session's writer lock; the holder renews it while working"
    )
    redis_timeout: float = Field(
        2.0, gt=0, description="socket timeout for Redis, so a dead Redis fails fast"
    )
    log_level: str = Field("info", description="uvicorn log level")
    max_body_bytes: int = Field(
        1 << 20, ge=1, description="largest request body accepted; a larger one gets 413 before it is read in full"
    )
    fault_pause_before_commit: float = Field(
        0.0,
        ge=0,
        description="FOR TESTS ONLY (fault injection): seconds every writer stalls, its lease renewal "
        "stopped, just before its commit; proves the version fence (tests/faults). Never set it in production",
    )
