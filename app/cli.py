"""`recur`: the one command-line entry point.

Model subcommands (init, train, eval, ...) are registered by `model.cli`; the service
subcommands (serve, chat, replay: replay reads a server's transcripts) by `app`. This
module only assembles the parser.
"""

from __future__ import annotations

import argparse
import sys

import model.cli
from app import chat, replay_client, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recur", description="Streaming inference for recurrent-memory LMs")
    sub = parser.add_subparsers(dest="command", required=True)
    model.cli.register(sub)
    serve.register(sub)
    chat.register(sub)
    replay_client.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
