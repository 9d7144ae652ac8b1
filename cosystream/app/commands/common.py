"""What more than one command reads from its flags: the decoder, the second pass, and the rule that a flag
left out keeps its config's default."""

from __future__ import annotations

import argparse
import dataclasses
import logging

# The commands' own lines (a model's vocabulary read, the second pass off) log as "cosystream".
log = logging.getLogger("cosystream")


def given(**flags):
    """The flags that were given (not None), as config keyword arguments: the rest keep the config's default."""
    return {name: value for name, value in flags.items() if value is not None}


def add_decoder_args(parser: argparse.ArgumentParser) -> None:
    """``--decoder``, ``--lm``, ``--beam-size``, ``--lm-weight`` and ``--word-bonus``, their defaults read off
    :class:`~cosystream.decoding.config.DecoderConfig` (whose import loads no torch)."""
    from cosystream.decoding.config import DECODERS, DecoderConfig

    defaults = DecoderConfig()
    group = parser.add_argument_group("decoding")
    group.add_argument(
        "--decoder",
        choices=list(DECODERS),
        default=defaults.kind,
        help="auto: beam search when the model ships a language model (lm.arpa.gz) or --lm is given; greedy: "
        "the best token per frame (letter models; the default model's phonemes need beam search)",
    )
    group.add_argument("--lm", default=None, help="a word n-gram language model, ARPA (.arpa or .arpa.gz)")
    # None: BeamConfig's default, which the help states.
    group.add_argument(
        "--beam-size",
        type=int,
        default=None,
        help=f"hypotheses kept per frame (default {defaults.beam.beam_size})",
    )
    group.add_argument(
        "--lm-weight", type=float, default=None, help=f"language model weight (default {defaults.beam.alpha})"
    )
    group.add_argument(
        "--word-bonus", type=float, default=None, help=f"score added per word, nats (default {defaults.beam.beta})"
    )


def decoder_config(args: argparse.Namespace):
    """The decoder the arguments ask for, resolved against the model (ValueError if it cannot be had)."""
    return decoder_request(args).resolve(args.model)


def decoder_request(args: argparse.Namespace):
    """The decoder the arguments ask for, before it is resolved against a model (ValueError for bad flags)."""
    from cosystream.decoding.beam import BeamConfig
    from cosystream.decoding.config import DecoderConfig

    overrides = given(beam_size=args.beam_size, alpha=args.lm_weight, beta=args.word_bonus)
    beam = dataclasses.replace(BeamConfig(), **overrides)
    if beam.beam_size < 1:
        raise ValueError("--beam-size must be >= 1")
    return DecoderConfig(args.decoder, args.lm, beam)


def second_pass_model(flag: str | None) -> str | None:
    """``--final-model`` -> the second pass's model, or None for none: ``off``; not given, the packaged Whisper
    when the whisper extra is installed (said in the log either way)."""
    from cosystream.secondpass.whisper import EMBEDDED_WHISPER, packaged_model_installed

    if flag is not None:
        return None if flag == "off" else flag
    if packaged_model_installed():
        return EMBEDDED_WHISPER
    log.info(
        "second pass off: finals come from the streaming model (pip install 'cosystream[whisper]' turns it on)"
    )
    return None
