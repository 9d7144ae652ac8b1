"""The ``cosystream`` command: ``serve``, ``transcribe``, ``admin`` and ``eval``.

Each command is a module of :mod:`cosystream.app.commands` with an ``add_parser(commands, parents)`` that
adds its flags and a ``run(args)`` that carries it out. Command-line flags and environment variables are
read there and here, nowhere else; everything below receives frozen config objects. Importing a command
imports no torch (``cosystream --help`` stays quick): each ``run`` imports what it needs.
"""

from __future__ import annotations

import argparse
import os
import sys

from cosystream import __version__
from cosystream.app.commands import admin, evaluate, serve, transcribe
from cosystream.logs import LEVELS as LOG_LEVELS
from cosystream.logs import configure as configure_logs
from cosystream.v1.client import HelpFormatter

COMMANDS = {"serve": serve, "transcribe": transcribe, "admin": admin, "eval": evaluate}
"""Each command's module, in the order ``cosystream --help`` lists them."""


def add_log_args(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=default,
        help="default: $COSYSTREAM_LOG_LEVEL, else INFO for serve and WARNING for transcribe and eval (their "
        "output is their results)",
    )
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=default,
        help="default: $COSYSTREAM_LOG_FORMAT, else text",
    )


def log_settings(args: argparse.Namespace) -> tuple[str, str]:
    """The log level and format: the flags, else the environment, else the command's default."""
    level = (
        args.log_level
        or os.environ.get("COSYSTREAM_LOG_LEVEL")
        or ("INFO" if args.command == "serve" else "WARNING")
    )
    fmt = args.log_format or os.environ.get("COSYSTREAM_LOG_FORMAT") or "text"
    if level.upper() not in LOG_LEVELS:
        sys.exit(f"cosystream: COSYSTREAM_LOG_LEVEL={level}: use one of {', '.join(LOG_LEVELS)}")
    if fmt not in ("text", "json"):
        sys.exit(f"cosystream: COSYSTREAM_LOG_FORMAT={fmt}: use text or json")
    return level.upper(), fmt


class _Parser(argparse.ArgumentParser):
    """Every command's parser (the subcommands' too: argparse makes them of the top parser's class) shows the
    flags' defaults in its help."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cosystream", description="A real-time streaming speech engine.")
    parser.add_argument("--version", action="version", version=f"cosystream {__version__}")
    add_log_args(parser, default=None)
    # The same flags after the command name too (`cosystream transcribe FILE --log-level info`); given there,
    # they win over the ones before it.
    after_command = _Parser(add_help=False)
    add_log_args(after_command, default=argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(commands, parents=[after_command])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.log_level, args.log_format = log_settings(args)
    configure_logs(args.log_level, args.log_format)
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
