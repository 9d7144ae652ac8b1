"""Streaming models: the contract, the default architecture and loading from disk.

``load_model()`` returns the embedded default English model; ``load_model(path)`` one from a directory
holding ``config.json``, ``vocabulary.json`` and ``model.safetensors``.
"""

from cosystream.model_files import (
    DEFAULT_MODEL_DIR,
    ModelSource,
    content_version,
    model_name,
    model_sources,
    vocabulary_kind,
)
from cosystream.models.contract import FRAME_SAMPLES, CacheSpec, StreamingModel, output_delay_frames
from cosystream.models.loading import load_model, save_model

__all__ = [
    "DEFAULT_MODEL_DIR",
    "FRAME_SAMPLES",
    "CacheSpec",
    "ModelSource",
    "StreamingModel",
    "content_version",
    "load_model",
    "model_name",
    "model_sources",
    "output_delay_frames",
    "save_model",
    "vocabulary_kind",
]
