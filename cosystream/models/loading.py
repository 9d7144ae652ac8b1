"""Model directories on disk: ``config.json`` + ``vocabulary.json`` + ``model.safetensors``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cosystream.models.conv_ctc import ConvCtcConfig, ConvCtcModel

log = logging.getLogger(__name__)

DEFAULT_MODEL_DIR = Path(__file__).parent / "default"
CONFIG_FILE = "config.json"
VOCABULARY_FILE = "vocabulary.json"
WEIGHTS_FILE = "model.safetensors"
UNTRAINED_SEED = 0

_ARCHITECTURES = {"conv_ctc": (ConvCtcConfig, ConvCtcModel)}


def load_model(path: str | Path | None = None, device: str | torch.device = "cpu") -> ConvCtcModel:
    """Load a model directory (the embedded default when ``path`` is None), in eval mode on ``device``.

    A directory without weights yields the architecture with seeded random weights (logged as a warning):
    useful for engine tests and benchmarks, useless for recognition.
    """
    directory = Path(path) if path is not None else DEFAULT_MODEL_DIR
    config_data = json.loads((directory / CONFIG_FILE).read_text())
    config_data["vocabulary"] = json.loads((directory / VOCABULARY_FILE).read_text())
    architecture = config_data.get("architecture", "conv_ctc")
    if architecture not in _ARCHITECTURES:
        raise ValueError(f"{directory}: unknown architecture {architecture!r}; known: {sorted(_ARCHITECTURES)}")
    config_cls, model_cls = _ARCHITECTURES[architecture]
    config = config_cls.from_dict(config_data)
    weights = directory / WEIGHTS_FILE
    if weights.exists():
        model = model_cls(config)
        model.load_state_dict(load_file(weights), strict=True)
    else:
        log.warning("%s has no %s: using untrained weights (seed %d)", directory, WEIGHTS_FILE, UNTRAINED_SEED)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(UNTRAINED_SEED)
            model = model_cls(config)
    return model.to(device).eval().requires_grad_(False)


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
