"""Model directories on disk: ``config.json`` + ``vocabulary.json`` + ``model.safetensors``.

Also what a server needs to tell its models apart without loading them: each one's name (``config.json``'s
``"name"``), a content version (a hash of its files) and its vocabulary's kind (``lexicon.tsv.gz`` beside the
weights: phonemes; else letters). :class:`ModelSource` names one served model.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cosystream.model_files import DEFAULT_MODEL_DIR, LEXICON_FILE, PRECISIONS, RESERVED_NAMES
from cosystream.models.conv_ctc import ConvCtcConfig, ConvCtcModel, quantize_linear

log = logging.getLogger(__name__)

# The models that come with the package, by the name ``--model embedded:NAME`` gives them: the default, and a
# smaller student of it (``--adaptive``'s LIGHT model; its MODEL_CARD.md says what it costs in accuracy).
EMBEDDED_MODELS = {"default": DEFAULT_MODEL_DIR, "light": DEFAULT_MODEL_DIR.parent / "light"}
CONFIG_FILE = "config.json"
VOCABULARY_FILE = "vocabulary.json"
WEIGHTS_FILE = "model.safetensors"
VERSIONED_FILES = (CONFIG_FILE, VOCABULARY_FILE, WEIGHTS_FILE)

_ARCHITECTURES = {"conv_ctc": (ConvCtcConfig, ConvCtcModel)}


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
    config_cls, _ = _ARCHITECTURES.get(config.get("architecture", "conv_ctc"), _ARCHITECTURES["conv_ctc"])
    return config_cls.__dataclass_fields__["name"].default


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
        _required(Path(path), name, _WHY.get(name, ""))


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


def check_precision(precision: str, device: str | torch.device) -> None:
    """Raise ``ValueError`` (one line) unless a model can run at ``precision`` on ``device``."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: one of {', '.join(PRECISIONS)}")
    kind = torch.device(device).type
    if precision == "float16" and kind != "cuda":
        raise ValueError("float16 needs a CUDA device (CPUs have no fast float16 matmul: use bfloat16 or int8)")
    if precision == "int8" and kind != "cpu":
        raise ValueError("int8 runs on the CPU only (dynamic quantization); on CUDA use bfloat16 or float16")


def set_precision(model: ConvCtcModel, precision: str) -> ConvCtcModel:
    """``model`` (float32) at ``precision``, in place. bfloat16 / float16: the matmuls' weights (every
    convolution and the output layer) are cast, and the convolutions' rings take that dtype; the features, the
    layer norms and the residual sum stay float32 (a residual sum in bfloat16 costs accuracy: docs/MODELS.md).
    int8: the same matmuls are quantized dynamically (weights per output channel, activations per step)."""
    if precision == "int8":
        for conv in model._convs():
            conv.quantize_int8()
        model.head = quantize_linear(model.head)
    elif precision != "float32":
        dtype = getattr(torch, precision)
        for layer in (*model._convs(), model.head):
            layer.to(dtype)
    return model


def load_model(
    path: str | Path | None = None, device: str | torch.device = "cpu", precision: str = PRECISIONS[0]
) -> ConvCtcModel:
    """Load a model directory (the embedded default when ``path`` is None), in eval mode on ``device``, at
    ``precision`` (one of ``PRECISIONS``; ``ValueError`` for one the device cannot run: ``check_precision``).

    Every file is required: a directory without ``model.safetensors``, or whose tensors do not cover the
    architecture's parameters exactly (a missing or unexpected name, a wrong shape), raises
    :class:`ModelFileError`. (It once served seeded random weights instead: a model that answered every
    session with garbage, and could replace the default model through the admin service.)
    """
    check_precision(precision, device)
    directory = Path(path) if path is not None else DEFAULT_MODEL_DIR
    config_data = json.loads(_required(directory, CONFIG_FILE).read_text())
    config_data["vocabulary"] = json.loads(_required(directory, VOCABULARY_FILE).read_text())
    architecture = config_data.get("architecture", "conv_ctc")
    if architecture not in _ARCHITECTURES:
        raise ValueError(f"{directory}: unknown architecture {architecture!r}; known: {sorted(_ARCHITECTURES)}")
    config_cls, model_cls = _ARCHITECTURES[architecture]
    config = config_cls.from_dict(config_data)
    weights = _required(directory, WEIGHTS_FILE, _WHY[WEIGHTS_FILE])
    tensors = load_file(weights)
    model = model_cls(config)
    _check_weights(weights, tensors, model.state_dict())
    model.load_state_dict(tensors, strict=True)
    model = model.eval().requires_grad_(False)
    return set_precision(model.to(device), precision)


_WHY = {WEIGHTS_FILE: "no weights: a model directory needs its trained weights"}


def _required(directory: Path, name: str, why: str = "") -> Path:
    """``directory / name``, or :class:`ModelFileError` naming it."""
    file = directory / name
    if not file.is_file():
        raise ModelFileError(f"{file}: missing ({why or 'a model directory needs it'}; docs/MODELS.md)")
    return file


def _check_weights(weights: Path, tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """:class:`ModelFileError` (one line) unless ``tensors`` are exactly the names and shapes of ``expected``."""
    problems = [f"missing {name}" for name in expected if name not in tensors]
    problems += [f"unexpected {name}" for name in tensors if name not in expected]
    problems += [
        f"{name} has shape {tuple(tensors[name].shape)}, the config needs {tuple(tensor.shape)}"
        for name, tensor in expected.items()
        if name in tensors and tensors[name].shape != tensor.shape
    ]
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise ModelFileError(f"{weights}: the weights do not fit the model's config: {shown}")


def save_model(model: ConvCtcModel, directory: str | Path) -> None:
    """Write ``model`` as a model directory that ``load_model`` reads."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads(model.config.to_json())
    vocabulary = config.pop("vocabulary")
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    (directory / VOCABULARY_FILE).write_text(json.dumps(vocabulary) + "\n")
    state = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, directory / WEIGHTS_FILE)
