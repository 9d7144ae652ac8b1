"""What the HTTP adapters share: model and language names as OpenAI's clients send them, and results as
seconds and text."""

from __future__ import annotations

from cosystream.server.http.errors import ApiError
from cosystream.server.servicer import CosyStreamServicer

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
