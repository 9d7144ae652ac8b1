"""Model directories on disk: ``config.json`` + ``vocabulary.json`` + ``model.safetensors``, loaded and saved.

What a server needs to tell its models apart without loading them (each one's name, content version and
vocabulary's kind; :class:`~cosystream.model_files.ModelSource`) is in ``cosystream.model_files``, which
imports no torch.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cosystream.model_files import (
    CONFIG_FILE,
    DEFAULT_MODEL_DIR,
    PRECISIONS,
    VOCABULARY_FILE,
    WEIGHTS_FILE,
    ModelFileError,
    check_precision,
    required_file,
)
from cosystream.models.conv_ctc import ConvCtcConfig, ConvCtcModel, quantize_linear

log = logging.getLogger(__name__)

_ARCHITECTURES = {"conv_ctc": (ConvCtcConfig, ConvCtcModel)}


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
    config_data = json.loads(required_file(directory, CONFIG_FILE).read_text())
    config_data["vocabulary"] = json.loads(required_file(directory, VOCABULARY_FILE).read_text())
    architecture = config_data.get("architecture", "conv_ctc")
    if architecture not in _ARCHITECTURES:
        raise ValueError(f"{directory}: unknown architecture {architecture!r}; known: {sorted(_ARCHITECTURES)}")
    config_cls, model_cls = _ARCHITECTURES[architecture]
    config = config_cls.from_dict(config_data)
    weights = required_file(directory, WEIGHTS_FILE)
    tensors = load_file(weights)
    model = model_cls(config)
    _check_weights(weights, tensors, model.state_dict())
    model.load_state_dict(tensors, strict=True)
    model = model.eval().requires_grad_(False)
    return set_precision(model.to(device), precision)


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
