"""What a model directory holds and what the server calls its models, without loading one.

No import beyond the standard library: a frontend process (which never loads torch) names models, checks a
precision and finds a phoneme model's lexicon with these; ``cosystream.models.loading`` reads the weights.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).parent / "models" / "default"
LEXICON_FILE = "lexicon.tsv.gz"  # a phoneme model's pronunciations (cosystream.decoding reads it)
RESERVED_NAMES = ("", "default")  # what a StreamingConfig sends for the default model
# The precisions a model can be served at (``--precision``); the first is the default, the weights' own.
PRECISIONS = ("float32", "bfloat16", "float16", "int8")
