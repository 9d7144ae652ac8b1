"""What a model directory holds and what the server calls its models, without loading one.

No import beyond the standard library: a frontend process and ``serve``'s supervisor (neither loads torch)
name models, check their files and a precision and find a phoneme model's lexicon with these;
``cosystream.models.loading`` reads the weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).parent / "models" / "default"
LEXICON_FILE = "lexicon.tsv.gz"  # a phoneme model's pronunciations (cosystream.decoding reads it)
RESERVED_NAMES = ("", "default")  # what a StreamingConfig sends for the default model
# The precisions a model can be served at (``--precision``); the first is the default, the weights' own.
PRECISIONS = ("float32", "bfloat16", "float16", "int8")
# Each architecture's name for a model whose config.json names none (its config class's default name).
ARCHITECTURE_NAMES = {"conv_ctc": "conv-ctc"}
# The models that come with the package, by the name ``--model embedded:NAME`` gives them: the default, and a
# smaller student of it (``--adaptive``'s LIGHT model; its MODEL_CARD.md says what it costs in accuracy).
EMBEDDED_MODELS = {"default": DEFAULT_MODEL_DIR, "light": DEFAULT_MODEL_DIR.parent / "light"}
CONFIG_FILE = "config.json"
VOCABULARY_FILE = "vocabulary.json"
WEIGHTS_FILE = "model.safetensors"
VERSIONED_FILES = (CONFIG_FILE, VOCABULARY_FILE, WEIGHTS_FILE)
_WHY = {WEIGHTS_FILE: "no weights: a model directory needs its trained weights"}


class ModelFileError(ValueError):
    """A model directory that cannot be served as it is: a file missing, or weights that do not fit its
    config. One line, naming the file (the admin service answers it as FAILED_PRECONDITION, ``serve`` exits
    with it)."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """One model a server runs: the name sessions ask for, and its directory (None: the embedded default)."""

    name: str
    path: str | None = None
    precision: str = PRECISIONS[0]  # one of PRECISIONS

    @property
    def directory(self) -> Path:
        return Path(self.path) if self.path is not None else DEFAULT_MODEL_DIR


def user_cache_dir(name: str) -> Path:
    """``$XDG_CACHE_HOME/cosystream/NAME`` (``~/.cache`` without it); with no home at all, a folder of this
    user's own under the temporary directory (a shared ``/tmp/cosystream`` would let another local user plant
    files in it)."""
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except RuntimeError:  # no $HOME and no passwd entry (a container's arbitrary user)
            return Path(tempfile.gettempdir()) / f"cosystream-{os.getuid()}" / name
    return Path(base) / "cosystream" / name


def embedded_model(name: str) -> str | None:
    """``--model embedded:NAME``'s directory (None for the default: the embedded model, as with no
    ``--model``); ValueError for a name that comes with none."""
    directory = EMBEDDED_MODELS.get(name)
    if directory is None or not (directory / CONFIG_FILE).is_file():
        known = ", ".join(f"embedded:{n}" for n, d in EMBEDDED_MODELS.items() if (d / CONFIG_FILE).is_file())
        raise ValueError(f"--model embedded:{name}: no such embedded model (there are {known})")
    return None if directory == DEFAULT_MODEL_DIR else str(directory)


def model_name(path: str | Path | None) -> str:
    """The model's own name: ``config.json``'s ``"name"``, else its architecture's default name."""
    directory = Path(path) if path is not None else DEFAULT_MODEL_DIR
    config = json.loads((directory / CONFIG_FILE).read_text())
    name = config.get("name")
    if name:
        return str(name)
    return ARCHITECTURE_NAMES.get(config.get("architecture", "conv_ctc"), ARCHITECTURE_NAMES["conv_ctc"])


def model_sources(entries: Iterable[tuple[str | None, str | None]]) -> tuple[ModelSource, ...]:
    """``(name or None, directory or None)`` pairs -> the served models, the first the default. A missing name
    is the model's own (:func:`model_name`); no entry at all serves the embedded model. Raises ``ValueError``
    (one line) for a reserved name or two models of one name, :class:`ModelFileError` for a directory that
    lacks one of its files (before any engine starts to load it)."""
    sources: list[ModelSource] = []
    for name, path in entries:
        if path is not None:
            check_files(path)
        if name is None:
            name = model_name(path)
        if name in RESERVED_NAMES:
            raise ValueError(f"{name!r} cannot name a model: it asks for the default one")
        if any(source.name == name for source in sources):
            raise ValueError(f"two models are named {name!r}: name them with NAME=DIR")
        sources.append(ModelSource(name, path))
    return tuple(sources) or (ModelSource(model_name(None), None),)


def check_files(path: str | Path) -> None:
    """:class:`ModelFileError` unless the directory holds every file a model is made of (what ``load_model``
    then checks of the weights needs them loaded)."""
    for name in VERSIONED_FILES:
        required_file(Path(path), name)


def required_file(directory: Path, name: str) -> Path:
    """``directory / name``, or :class:`ModelFileError` naming it."""
    file = directory / name
    if not file.is_file():
        why = _WHY.get(name, "a model directory needs it")
        raise ModelFileError(f"{file}: missing ({why}; docs/MODELS.md)")
    return file


def content_version(path: str | Path | None) -> str:
    """A hash of the model's config, vocabulary and weights (12 hex digits): equal models, equal versions."""
    directory = Path(path) if path is not None else DEFAULT_MODEL_DIR
    digest = hashlib.sha256()
    for name in VERSIONED_FILES:
        file = directory / name
        if file.is_file():
            digest.update(name.encode() + b"\0")
            with file.open("rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
    return digest.hexdigest()[:12]


def vocabulary_kind(path: str | Path | None) -> str:
    """``phonemes`` when the model ships a pronunciation lexicon, else ``letters``."""
    directory = Path(path) if path is not None else DEFAULT_MODEL_DIR
    return "phonemes" if (directory / LEXICON_FILE).is_file() else "letters"


def check_precision(precision: str, device: object) -> None:
    """Raise ``ValueError`` (one line) unless a model can run at ``precision`` on ``device`` (a device name,
    ``cpu`` or ``cuda[:N]``, or a ``torch.device``)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: one of {', '.join(PRECISIONS)}")
    kind = str(device).partition(":")[0]
    if precision == "float16" and kind != "cuda":
        raise ValueError("float16 needs a CUDA device (CPUs have no fast float16 matmul: use bfloat16 or int8)")
    if precision == "int8" and kind != "cpu":
        raise ValueError("int8 runs on the CPU only (dynamic quantization); on CUDA use bfloat16 or float16")


def check_served_precision(source: ModelSource, device: object) -> None:
    """:func:`check_precision` for a served model: the error names its ``--precision`` and the model."""
    try:
        check_precision(source.precision, device)
    except ValueError as err:
        raise ValueError(f"--precision {source.precision} (model {source.name}): {err}") from None
