"""`recur replay`: score what a policy sampled under a model's current weights (RL replay).

The input is a rollout or a transcript JSON file, or a running server's session: then the
session's transcript is fetched with `GET /v1/sessions/{id}/transcript` (over httpx, with
the API key as a Bearer token) and, for `--precision auto`, the server's compute precision
from `GET /v1/models`. The scoring itself is `model/replay.py`'s; this module only
fetches, loads the model and prints: the report as JSON on stdout, a one-line summary on
stderr.

The whole transcript is always fetched, `--since-version` or not: replay must rebuild the
states from the session's first token, and only the scoring is limited to the later
versions. Nothing here touches Redis or the server's internals: it speaks plain HTTP.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx


class ReplayClientError(Exception):
    """An error answer from the server, or no server at all."""


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _get(url: str, path: str, api_key: str | None, params: dict[str, Any] | None = None) -> Any:
    try:
        r = httpx.get(url.rstrip("/") + path, headers=_headers(api_key), params=params, timeout=120)
    except httpx.HTTPError as exc:
        raise ReplayClientError(f"cannot reach {url}: {exc}") from None
    if r.status_code != 200:
        try:
            err = r.json()["error"]
            why = f"{err['type']}: {err['message']}"
        except (ValueError, KeyError, TypeError):
            why = r.text[:200]
        raise ReplayClientError(f"GET {path} answered {r.status_code} {why}")
    return r.json()


def fetch_transcript(url: str, session_id: str, api_key: str | None = None) -> dict:
    """The session's whole transcript, as the server renders it."""
    return _get(url, f"/v1/sessions/{session_id}/transcript", api_key)


def server_precision(url: str, api_key: str | None = None) -> str | None:
    """The compute precision the server runs (fp32, bf16, int8 or int4), if its model card says."""
    cards = _get(url, "/v1/models", api_key).get("data") or [{}]
    precision = cards[0].get("precision")
    return precision if precision in ("fp32", "bf16", "int8", "int4") else None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="recompute sampled tokens' log-probs under a model and report the importance ratios",
        description="Replay a rollout or transcript FILE, or a server's session (--url and --session). "
        "A rollout is a JSON object (or a list of them) with prompt, response, behaviour_logprobs, "
        "optional action_mask and the sampling settings used; a transcript is what "
        "GET /v1/sessions/{id}/transcript returns. A transcript's report is JSON on stdout, with "
        "max_abs_ratio_minus_1, mean_ratio and the worst tokens; a summary goes to stderr.",
    )
    p.add_argument("model", help="shipped model name or checkpoint directory (the current weights)")
    p.add_argument("file", nargs="?", help="rollout or transcript JSON file ('-' for stdin)")
    p.add_argument("--url", help="a recur server, e.g. http://127.0.0.1:8000 (with --session)")
    p.add_argument("--session", help="the session whose transcript to replay (with --url)")
    p.add_argument("--api-key", help="the server's API key (or --api-key-file)")
    p.add_argument("--api-key-file", type=Path, help="file whose first line is the API key")
    p.add_argument(
        "--since-version",
        type=int,
        help="score only the tokens the session committed after this version (states are still rebuilt from the start)",
    )
    p.add_argument(
        "--precision",
        default="fp32",
        choices=("fp32", "bf16", "int8", "int4", "auto"),
        help="compute precision of the replay; auto: the server's (GET /v1/models), fp32 without a server "
        "(default %(default)s)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--top", type=int, default=10, help="worst tokens to list (default %(default)s)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from model import checkpoint
    from model.replay import replay_document

    try:
        data, precision = _input(args)
        lm = checkpoint.load(args.model, device=args.device, precision=precision)
        result = replay_document(lm, data, args.since_version, args.top)
    except (FileNotFoundError, ValueError, ReplayClientError) as exc:  # JSONDecodeError is a ValueError
        raise SystemExit(f"recur replay: {exc}") from None
    print(json.dumps(result))
    if isinstance(result, dict) and "n_actions" in result:
        print(summary(result), file=sys.stderr)
    return 0


def _input(args: argparse.Namespace) -> tuple[Any, str]:
    """The JSON document to replay and the precision to replay it in."""
    if (args.url is None) != (args.session is None):
        raise ValueError("--url and --session go together")
    if (args.url is None) == (args.file is None):
        raise ValueError("give a FILE, or --url and --session, not both")
    key = args.api_key
    if args.api_key_file is not None:
        key = args.api_key_file.read_text().splitlines()[0].strip()
    if args.url is None:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
        return json.loads(text), "fp32" if args.precision == "auto" else args.precision
    precision = args.precision
    if precision == "auto":
        precision = server_precision(args.url, key) or "fp32"
    return fetch_transcript(args.url, args.session, key), precision


def summary(report: dict) -> str:
    """One line for a person: how far the ratios are from 1, and the worst token."""
    if not report["n_actions"]:
        return f"no sampled tokens to replay among {report['n_tokens']}"
    line = (
        f"replayed {report['n_actions']} sampled tokens of {report['n_tokens']} ({report['precision']}): "
        f"max |ratio - 1| {report['max_abs_ratio_minus_1']:.3g}, mean ratio {report['mean_ratio']:.6f}"
    )
    if report["worst"]:
        w = report["worst"][0]
        line += f"; worst: position {w['position']} id {w['id']} {w['text']!r} ratio {w['ratio']:.9g}"
    return line
