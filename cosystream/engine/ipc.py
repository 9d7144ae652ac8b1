"""The batched channel between frontend processes and the engine process.

One message per tick in each direction and per frontend, not one per audio chunk: a frontend coalesces
every op and frame its sessions produced during one event-loop iteration; the engine sends each frontend
the results of one step in one message. ``pack()`` and ``unpack()`` are the only places that know the wire
layout; the messages are tuples of plain values and numpy arrays over a
``multiprocessing.connection`` Unix socket (pickle protocol 5); ``benchmarks/ipc.py`` measures it against
pyzmq and against one message per chunk.

Frontend -> engine, ``ToEngine``: ops first (in order), then frames.
Engine -> frontend, ``ToFrontend``: events first, then results.
Sessions are named by a key the frontend chooses, so a frontend can send a session's first frames in the
same message as its OPEN, without waiting for a round trip.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from cosystream.models.contract import FRAME_SAMPLES


class Op(IntEnum):
    """Control ops, frontend -> engine: ``(op, key, ...)`` tuples in ``ToEngine.ops``."""

    OPEN = 0  # (OPEN, key, priority, model): model, an index into EngineInfo.models (absent: 0, the default)
    RESET = 1  # (RESET, key): zero the session's model state; sent only when none of its frames is in flight
    CLOSE = 2  # (CLOSE, key): free the session's slot; frames still queued for it are dropped
    LISTENING = 3  # (LISTENING, 0): this frontend's gRPC port is open (the server is SERVING once all are)


class Event(IntEnum):
    """Events, engine -> frontend: ``(event, ...)`` tuples in ``ToFrontend.events``."""

    HELLO = 10  # (HELLO, info: EngineInfo): the engine is warm; sent once per frontend
    OPENED = 11  # (OPENED, key)
    REJECTED = 12  # (REJECTED, key, message): no room, the session never had a slot
    SHED = 13  # (SHED, key, message): a BATCH session ended to make room for REALTIME ones
    # (ACTIVE, sessions, listening): slots held on the engine, all frontends, and how many frontends are
    # connected and listening; sent to every frontend when either changes
    ACTIVE = 14


OPEN, RESET, CLOSE, LISTENING = Op
HELLO, OPENED, REJECTED, SHED, ACTIVE = Event


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """One model the engine runs, as the frontends (and GetServerInfo) see it. ``path`` is its directory
    (None: the embedded default), where a frontend finds its lexicon and language model."""

    name: str
    version: str  # a hash of its files (cosystream.models.content_version)
    path: str | None
    language: str
    vocabulary: list[str]
    vocabulary_kind: str  # letters | phonemes
    parameters: int
    output_delay_frames: int
    precision: str  # the weights' dtype, e.g. "float32"


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the engine tells each frontend in its HELLO: its models (the first is the default; OPEN names
    one by its index here) and device (GetServerInfo shows them), its capacity, shared by every model, and
    ``top_k``, the token candidates it sends per frame (a text decoder reads at most that many). Nothing
    about text decoding: the frontends choose that."""

    device: str
    models: tuple[ModelInfo, ...]
    max_sessions: int
    graph_mode: str
    top_k: int

    # The default model's fields, for the code that serves only the default.
    @property
    def model_name(self) -> str:
        return self.models[0].name

    @property
    def language(self) -> str:
        return self.models[0].language

    @property
    def vocabulary(self) -> list[str]:
        return self.models[0].vocabulary

    @property
    def parameters(self) -> int:
        return self.models[0].parameters

    @property
    def output_delay_frames(self) -> int:
        return self.models[0].output_delay_frames

    def model_index(self, name: str) -> int | None:
        """The index of the model named ``name`` ("" or "default": 0), or None when none is."""
        if name in ("", "default"):
            return 0
        for index, model in enumerate(self.models):
            if model.name == name:
                return index
        return None


@dataclass(slots=True)
class ToEngine:
    """What one frontend tick sends: control ops, and runs of frames per session key."""

    ops: list[tuple] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    frames: list[np.ndarray] = field(default_factory=list)

    def add_frames(self, key: int, frames: np.ndarray) -> None:
        self.keys.append(key)
        self.counts.append(len(frames))
        self.frames.append(frames)

    def __bool__(self) -> bool:
        return bool(self.ops or self.keys)

    def pack(self) -> tuple:
        frames = np.concatenate(self.frames) if self.frames else np.zeros((0, FRAME_SAMPLES), dtype=np.float32)
        return (self.ops, self.keys, self.counts, frames)

    @classmethod
    def unpack(cls, message: tuple) -> ToEngine:
        """The inverse of :meth:`pack`: the frames arrive as one array, split by ``counts`` in :meth:`runs`."""
        ops, keys, counts, frames = message
        return cls(ops, keys, counts, [frames])

    def runs(self) -> Iterator[tuple[int, np.ndarray]]:
        """``(key, frames [n, 160])`` per run, in order, as built or as unpacked."""
        if len(self.frames) == len(self.keys):  # as built: one array per run
            yield from zip(self.keys, self.frames, strict=True)
            return
        (frames,) = self.frames  # as unpacked: one array
        start = 0
        for key, count in zip(self.keys, self.counts, strict=True):
            yield key, frames[start : start + count]
            start += count


@dataclass(slots=True)
class ToFrontend:
    """What one engine step sends a frontend: events, and per session key a run of per-frame results."""

    events: list[tuple] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    ids: list[np.ndarray] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    queue_s: list[float] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.events or self.keys)

    def pack(self) -> tuple:
        return (self.events, self.keys, self.ids, self.logprobs, self.queue_s, self.compute_s)

    @classmethod
    def unpack(cls, message: tuple) -> ToFrontend:
        """The inverse of :meth:`pack`."""
        return cls(*message)
