"""``cosystream transcribe FILE``: one file through a running server, or an in-process one."""

from __future__ import annotations

import argparse
import sys

from cosystream.app.commands.common import second_pass_model
from cosystream.v1.client import add_connection_args, connection_from_args


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "transcribe", help="transcribe an audio file (WAV, FLAC, OGG or MP3)", parents=parents
    )
    parser.add_argument("file")
    parser.add_argument("--server", default=None, help="host:port of a running server (default: in-process)")
    parser.add_argument("--realtime", action="store_true", help="pace the audio at real time (REALTIME)")
    parser.add_argument("--interim", action="store_true", help="print interim results too")
    parser.add_argument("--words", action="store_true", help="print word time offsets")
    parser.add_argument(
        "--final-model",
        default=None,
        help="in-process: finals from this second pass, as serve --final-model (default: embedded:whisper-tiny-en "
        "when the whisper extra is installed, else off)",
    )
    add_connection_args(parser)


def run(args: argparse.Namespace) -> int:
    from cosystream.app.transcribe import transcribe_command

    try:
        connection = connection_from_args(args)
    except ValueError as err:
        sys.exit(f"cosystream transcribe: {err}")
    flags = (args.tls, args.ca_cert, args.client_cert, args.client_key, args.token)
    if args.server is None and any(flag for flag in flags):  # ($COSYSTREAM_TOKEN alone is fine in-process)
        sys.exit("cosystream transcribe: --tls, --ca-cert, --client-cert, --client-key and --token need --server")
    if args.server is not None and args.final_model is not None:
        sys.exit("cosystream transcribe: --final-model is for the in-process server: a server has its own")
    try:
        final_model = None if args.server is not None else second_pass_model(args.final_model)
    except ValueError as err:
        sys.exit(f"cosystream transcribe: {err}")
    return transcribe_command(
        args.file, args.server, args.realtime, args.interim, args.words, connection, final_model
    )
