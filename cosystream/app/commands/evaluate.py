"""``cosystream eval TEST_SET``: WER, CER and real-time factor of a model on a test set."""

from __future__ import annotations

import argparse
import sys

from cosystream.app.commands.common import add_decoder_args, decoder_config


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser("eval", help="WER, CER and real-time factor on a test set", parents=parents)
    parser.add_argument("test_set", help="a directory of NAME.wav + NAME.txt, or a JSONL manifest")
    parser.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    parser.add_argument("--telephone", action="store_true", help="through an 8 kHz mu-law round trip first")
    parser.add_argument(
        "--tilt",
        type=float,
        default=0.0,
        metavar="DB",
        help="through a spectral tilt of DB dB per octave around 1 kHz first (a bright or muffled microphone)",
    )
    parser.add_argument("--json", default=None, help="write the scores and every hypothesis here")
    parser.add_argument("--show", type=int, default=5, help="print this many reference/hypothesis pairs")
    parser.add_argument(
        "--precision",
        default="float32",
        choices=("float32", "bfloat16", "int8"),
        help="run the model at this precision on the CPU (see serve --precision)",
    )
    parser.add_argument(
        "--final-model",
        default=None,
        help="finals from this second pass too, as serve --final-model (embedded:whisper-tiny-en, "
        "embedded:whisper-base or a CTranslate2 Whisper directory): WER/CER of the finals beside the streaming "
        "model's alone; off (the default): the streaming model's alone",
    )
    add_decoder_args(parser)


def run(args: argparse.Namespace) -> int:
    from cosystream.app.evaluate import eval_command

    try:
        decoder = decoder_config(args)
    except (OSError, EOFError, ValueError) as err:
        sys.exit(f"cosystream eval: {err}")
    return eval_command(
        args.model,
        args.test_set,
        decoder,
        args.telephone,
        args.tilt,
        args.json,
        args.show,
        args.precision,
        None if args.final_model == "off" else args.final_model,
    )
