"""`recur serve` (and `python -m app`): load the model, start Redis if needed, run uvicorn.

The command's flags are generated from `Settings`, so every setting has exactly one
definition: `--max-tokens 256` and `RECUR_MAX_TOKENS=256` are the same thing (a flag wins).
"""

from __future__ import annotations

import argparse
import logging
import sys
import typing
from pathlib import Path

from pydantic import SecretStr

from app.config import Settings

log = logging.getLogger("recur.serve")


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    for name, field in Settings.model_fields.items():
        ann = field.annotation
        kwargs: dict[str, typing.Any] = {"dest": name, "default": argparse.SUPPRESS}
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if typing.get_origin(ann) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(ann))
        elif ann is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif ann in (int, float):
            kwargs["type"] = ann
        elif ann is Path or ann is str or args in ([str], [Path], [SecretStr]):
            kwargs["type"] = str
        else:  # a new settings type must say how it is parsed
            raise TypeError(f"no command-line parser for setting {name}: {ann}")
        env = f"RECUR_{name.upper()}"
        default = str(field.default) if isinstance(field.default, Path) else repr(field.default)
        kwargs["help"] = f"{field.description} (env {env}; default {default})"
        parser.add_argument("--" + name.replace("_", "-"), **kwargs)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over HTTP, with sessions in Redis")
    add_settings_flags(p)
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    given = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    return run(Settings(**given))


def run(settings: Settings) -> int:
    import uvicorn

    import model
    from app import connections, logs
    from app.api import create_app
    from app.embedded_redis import EmbeddedRedis

    logs.configure(settings.log_level, settings.log_format)
    try:
        keys = settings.load_api_keys()
    except ValueError as exc:
        print(f"recur serve: {exc}", file=sys.stderr)
        return 2
    if not keys:
        log.warning(
            "no API keys are set (RECUR_API_KEYS, RECUR_API_KEYS_FILE): every /v1 route is open to "
            "anyone who can reach %s:%d, and all clients share one quota",
            settings.host,
            settings.port,
        )
    try:
        lm = model.load(
            settings.model,
            device=settings.device,
            precision=settings.precision,
            options=settings.model_options,
        )
    except FileNotFoundError as exc:
        print(
            f"recur serve: {exc}.\n  Pass --model DIR (a checkpoint directory, e.g. one written by "
            "`recur init DIR`) or set RECUR_MODEL.",
            file=sys.stderr,
        )
        return 2
    except ValueError as exc:  # a model option or precision the checkpoint cannot take
        print(f"recur serve: {exc}", file=sys.stderr)
        return 2
    embedded = None
    if not settings.redis_url:
        embedded = EmbeddedRedis(settings.data_dir)
        url = embedded.start()
        log.info("embedded redis-server at %s, data in %s", url, embedded.data_dir)
        settings = settings.model_copy(update={"redis_url": url})
    try:
        uvicorn.run(
            create_app(settings, lm),
            host=settings.host,
            port=settings.port,
            http=connections.protocol(settings),
            timeout_keep_alive=settings.keep_alive_timeout,
            log_level=settings.log_level,
            log_config=None,  # keep the handlers of app.logs
            access_log=False,  # app.api.middleware logs each request, with its ids
        )
    finally:
        if embedded is not None:
            embedded.stop()
    return 0
