"""What the HTTP adapters share: model and language names as OpenAI's clients send them, and results as
seconds and text."""

from __future__ import annotations

import re

from cosystream.decoding.phrases import MAX_PHRASES
from cosystream.server.http.errors import ApiError
from cosystream.server.servicer import CosyStreamServicer
from cosystream.v1 import cosystream_pb2 as pb

PROMPT_BOOST = 4.0  # nats per word of a prompt: half a phrase's default (a prompt is text, not a word list)
PROMPT_MIN_LETTERS = 4  # shorter words of a prompt ("the", "and", "is") are not boosted
_PROMPT_WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")

OPENAI_MODELS = frozenset(
    {
        "whisper-1",
        "gpt-4o-transcribe",
        "gpt-4o-mini-transcribe",
        "gpt-4o-transcribe-latest",
        "gpt-4o-mini-transcribe-latest",
    }
)
"""OpenAI's transcription model names, taken for the server's default model, so that code written for
OpenAI runs with only its base URL changed."""


def prompt_phrases(servicer: CosyStreamServicer, model: str, prompt: str) -> list[pb.Phrase]:
    """OpenAI's ``prompt`` (free text: names, terms, the style of earlier text) as phrases for ``model``: each
    distinct word of at least :data:`PROMPT_MIN_LETTERS` letters, boosted by :data:`PROMPT_BOOST`; numbers
    and symbols are left out rather than refused, and a model decoded without the Python beam search gets
    none (a prompt is a hint: OpenAI's clients send it freely). The second pass is told the words too."""
    index = servicer.info.model_index(model)
    if not prompt or index is None or not servicer.models.decoder(servicer.info.models[index]).can_boost:
        return []
    words = dict.fromkeys(
        w for w in _PROMPT_WORD.findall(prompt) if sum(ch.isalpha() for ch in w) >= PROMPT_MIN_LETTERS
    )
    return [pb.Phrase(text=word, boost=PROMPT_BOOST) for word in list(words)[:MAX_PHRASES]]


def native_model(servicer: CosyStreamServicer, requested: str | None, param: str = "model") -> str:
    """The native ``StreamingConfig.model`` for a requested name: a served model's name, or "" (the default)
    for "", "default" and OpenAI's names. Raises :class:`ApiError` (400, ``model_not_found``) listing the
    names served."""
    name = (requested or "").strip()
    info = servicer.info
    if any(model.name == name for model in info.models):
        return name
    if name in ("", "default") or name in OPENAI_MODELS:
        return ""
    served = ", ".join(repr(model.name) for model in info.models)
    raise ApiError(
        400,
        f"unknown model {name!r}: this server runs {served} (the first also answering to 'default' and "
        f"OpenAI's {', '.join(sorted(OPENAI_MODELS))})",
        "model_not_found",
        param,
    )


def check_language(servicer: CosyStreamServicer, language: str | None, param: str = "language") -> str:
    """The model's language if ``language`` (ISO-639-1 like OpenAI's, or a BCP-47 tag) names it; raises
    :class:`ApiError` (400, ``unsupported_language``) otherwise."""
    spoken = servicer.info.language  # a BCP-47 tag, e.g. "en-US"
    if language and language.strip().lower().split("-")[0] != spoken.lower().split("-")[0]:
        raise ApiError(
            400,
            f"language {language!r} is not supported: the model transcribes {spoken}",
            "unsupported_language",
            param,
        )
    return spoken


def seconds(ms: int) -> float:
    return round(ms / 1000, 3)
