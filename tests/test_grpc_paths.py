"""``benchmarks/grpc_paths.py`` measures real servers: each kind serves the streams whole (every response
arrives) and its CPU is counted."""

from __future__ import annotations

import pytest

from benchmarks._harness import free_port
from benchmarks.grpc_paths import measure


@pytest.mark.parametrize("kind", ["aio", "aio-read", "aio-raw", "sync"])
def test_each_server_kind_answers_every_stream(kind):
    result = measure(kind, streams=3, duration_s=0.5, chunk_ms=10, every=10, port=free_port())
    assert result["responses"] == 3 * 50 // 10  # (one per ten requests of each stream)
    assert result["server_cpu_ms_per_audio_s"] > 0
