"""What the HTTP adapters share: model and language names as OpenAI's clients send them, and results as
seconds and text."""

from __future__ import annotations

import re

from cosystream.decoding.phrases import MAX_PHRASES
from cosystream.server.http.errors import ApiError
from cosystream.server.servicer import CosyStreamServicer
from cosystream.v1 import cosystream_pb2 as pb

PROMPT_BOOST = 4.0  # nats per word of a prompt's text: half a phrase's default (text, not a word list)
PROMPT_MIN_LETTERS = 4  # shorter words of a prompt's text ("the", "and", "is") are not boosted
PROMPT_TERM_WORDS = 3  # a comma-separated part of a prompt this short is a term: a phrase of its own
_PROMPT_PARTS = re.compile(r"[,;\n]+")
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
    """OpenAI's ``prompt`` (free text: names, terms, the style of earlier text) as phrases for ``model``. A
    part of it between commas, semicolons or line breaks of at most :data:`PROMPT_TERM_WORDS` words is a
    term ("Siobhan Nguyen, Kubernetes"), one phrase at the default boost; in a longer part, each word of at
    least :data:`PROMPT_MIN_LETTERS` letters is a phrase boosted by :data:`PROMPT_BOOST`. Numbers and symbols
    are left out rather than refused, and a model decoded greedily gets none (a
    prompt is a hint: OpenAI's clients send it freely). The second pass is told the phrases too."""
    index = servicer.info.model_index(model)
    if not prompt or index is None or not servicer.models.decoder(servicer.info.models[index]).can_boost:
        return []
    phrases: dict[str, float] = {}
    for part in _PROMPT_PARTS.split(prompt):
        words = _PROMPT_WORD.findall(part)
        if not words:
            continue
        if len(words) <= PROMPT_TERM_WORDS and len(words) == len(part.split()):
            phrases.setdefault(" ".join(words), 0.0)  # (0: the default boost)
        else:
            for word in words:
                if sum(ch.isalpha() for ch in word) >= PROMPT_MIN_LETTERS:
                    phrases.setdefault(word, PROMPT_BOOST)
    return [pb.Phrase(text=text, boost=boost) for text, boost in list(phrases.items())[:MAX_PHRASES]]


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
