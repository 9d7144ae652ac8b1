"""CUDA-graph capture and replay: the only module in cosystream that captures graphs.

The key table is the only source of truth: a key captured at start-up is replayed, anything else runs
eager (the caller asks ``key in graphs`` first; ``replay`` of an unknown key raises ``KeyError``). Graphs are captured largest first into one memory pool so that the smaller ones reuse its blocks;
after ``freeze()`` any new capture raises, so no capture (and no allocation) can happen while serving.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any

import torch

log = logging.getLogger(__name__)


class CudaGraphs:
    def __init__(self, device: torch.device, warmup_iterations: int = 2):
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.device = device
        # Capture and replay use the current device: make it this one (``cuda:1`` must not capture on 0).
        # (set_device refuses a device without an index: plain ``cuda`` is the current one.)
        if device.index is not None:
            torch.cuda.set_device(device.index)
        self.warmup_iterations = warmup_iterations
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[Hashable, Any] = {}
        self._frozen = False

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs

    def keys(self) -> list[Hashable]:
        return list(self._graphs)

    def capture(self, key: Hashable, fn: Callable[[], Any]) -> None:
        """Warm ``fn`` up on a side stream, then capture it. ``fn`` reads and writes only static buffers."""
        if self._frozen:
            raise RuntimeError(f"graph capture after start-up (key {key!r}): every key is captured at start-up")
        if key in self._graphs:
            raise ValueError(f"graph {key!r} already captured")
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(self.warmup_iterations):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a model loaded while serving is captured in a loader thread while the engine's loop
        # goes on stepping (and syncing) in its own; "global" would make the loop's calls fail the capture.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            output = fn()
        self._graphs[key] = graph
        self._outputs[key] = output

    def freeze(self) -> None:
        torch.cuda.synchronize(self.device)
        self._frozen = True
        log.info("captured %d CUDA graphs", len(self._graphs))

    def replay(self, key: Hashable) -> Any:
        """Replay the graph of ``key``; returns the output tensors captured with it (overwritten in place)."""
        self._graphs[key].replay()
        return self._outputs[key]
