"""Streaming models: the contract, the default architecture and loading from disk.

``load_model()`` returns the embedded default English model; ``load_model(path)`` one from a directory
holding ``config.json``, ``vocabulary.json`` and ``model.safetensors``.
"""

from cosystream.models.contract import FRAME_SAMPLES, CacheSpec, StreamingModel, output_delay_frames
from cosystream.models.loading import DEFAULT_MODEL_DIR, load_model, save_model

__all__ = [
    "DEFAULT_MODEL_DIR",
    "FRAME_SAMPLES",
    "CacheSpec",
    "StreamingModel",
    "load_model",
    "output_delay_frames",
    "save_model",
]
