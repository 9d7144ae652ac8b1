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

from cosystream.frames import FRAME_SAMPLES


class Op(IntEnum):
    """Control ops, frontend -> engine: ``(op, key, ...)`` tuples in ``ToEngine.ops``."""

    # (OPEN, key, priority, model): model, a ModelInfo.id of EngineInfo.models (absent: 0, the default)
    OPEN = 0
    # (RESET, key): zero the session's model state; sent only when none of its frames is in flight. A session
    # of a model replaced since its last utterance moves to the new version here (MOVED says so).
    RESET = 1
    CLOSE = 2  # (CLOSE, key): free the session's slot; frames still queued for it are dropped
    LISTENING = 3  # (LISTENING, 0): this frontend's gRPC port is open (the server is SERVING once all are)
    # (LOAD, request, name, path, precision): load the model directory ``path`` and serve it as ``name`` (a
    # new version of a model served, or a new one) at ``precision`` ("": as ``name`` is served; a new name:
    # float32); answered LOADED. ``request``: a number the frontend chooses.
    LOAD = 4
    UNLOAD = 5  # (UNLOAD, request, name): stop serving ``name``; answered UNLOADED
    # (PREPARED, request, error): the answer to PREPARE: this frontend can decode the model ("") or why not
    PREPARED = 6
    # (END, key): the session's utterance has ended; its frames sent so far (this message's among them, the
    # end-of-utterance silence) are all its final waits for: step them now (Scheduler.end_utterance)
    END = 7


class Event(IntEnum):
    """Events, engine -> frontend: ``(event, ...)`` tuples in ``ToFrontend.events``."""

    HELLO = 10  # (HELLO, info: EngineInfo): the engine is warm; sent once per frontend
    OPENED = 11  # (OPENED, key, model): the model id it runs on (the current version of the one OPEN named)
    # (REJECTED, key, message[, retry_after_s, reason]): no room, the session never had a slot; a refusal for
    # load (reason "overloaded", engine/headroom.py) says when to retry
    REJECTED = 12
    SHED = 13  # (SHED, key, message): a BATCH session ended to make room for REALTIME ones
    # (ACTIVE, sessions, listening, report): slots held on the engine, all frontends, how many frontends are
    # connected and listening, and its load (headroom.LoadReport, once per load window; None before the first);
    # sent to every frontend when any changes
    ACTIVE = 14
    # (MODELS, models, held): the models served changed (EngineInfo.models' new value), or ``held``, how many
    # model versions the engine holds (served, or still run by a live session); sent to every frontend, before
    # any OPENED or MOVED that names a new model id
    MODELS = 15
    MOVED = 16  # (MOVED, key, model): the session runs on model id ``model`` from its new utterance on
    # (LOADED, request, model: ModelInfo | None, failure, error, install_s, load_s): the answer to LOAD, once
    # the model serves (``failure`` ""), or why not: ``failure`` is LOAD_FAILED, UNDECODABLE or BUSY and
    # ``error`` says why in a line. ``load_s``: loading and warming it; ``install_s``: installing it in the loop
    LOADED = 17
    UNLOADED = 18  # (UNLOADED, request, error): the answer to UNLOAD ("" once done)
    # (PREPARE, request, model: ModelInfo): a model is loaded and warm, not yet served; every frontend makes
    # ready to decode it and answers PREPARED. It is installed once all can.
    PREPARE = 19


OPEN, RESET, CLOSE, LISTENING, LOAD, UNLOAD, PREPARED, END = Op
HELLO, OPENED, REJECTED, SHED, ACTIVE, MODELS, MOVED, LOADED, UNLOADED, PREPARE = Event
LOAD_FAILED, UNDECODABLE, BUSY = "load_failed", "undecodable", "busy"  # LOADED's failures


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
    id: int = 0  # the engine's index of this version (OPEN names it); never reused for another


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the engine tells each frontend in its HELLO: the models it serves (the first is the default; OPEN
    names one by its ``id``; a MODELS event replaces the tuple when a model is loaded or unloaded) and device (GetServerInfo shows them), its capacity, shared by every model, and
    ``top_k``, the token candidates it sends per frame (a text decoder reads at most that many). Nothing
    about text decoding: the frontends choose that."""

    device: str
    models: tuple[ModelInfo, ...]
    max_sessions: int
    graph_mode: str
    top_k: int
    held_models: int = 0  # model versions the engine holds: those served, and older ones live sessions run

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
        """The position in ``models`` of the model named ``name`` ("" or "default": 0), or None when none is."""
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
    """What the engine sends a frontend: events, and the results of the steps since its last message, one
    block per step, as the step made them: its rows' session keys, their ids and log-probabilities as one
    array each (``[rows, T, top_k]``, the rows of this frontend's sessions), each row's queue wait, the
    step's compute time. A block pickles as two arrays whatever its rows: per-row arrays cost the engine and
    the frontend a pickle header and a reduce call each, per row and step."""

    events: list[tuple] = field(default_factory=list)
    steps: list[tuple[list[int], np.ndarray, np.ndarray, list[float], float]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.events or self.steps)

    def add_step(
        self, keys: list[int], ids: np.ndarray, logprobs: np.ndarray, queue_s: list[float], compute_s: float
    ) -> None:
        self.steps.append((keys, ids, logprobs, queue_s, compute_s))

    def rows(self) -> Iterator[tuple[int, np.ndarray, np.ndarray, float, float]]:
        """``(key, ids [T, top_k], logprobs [T, top_k], queue_s, compute_s)`` per row, in step order."""
        for keys, ids, logprobs, queue_s, compute_s in self.steps:
            for row, key in enumerate(keys):
                yield key, ids[row], logprobs[row], queue_s[row], compute_s

    @property
    def keys(self) -> list[int]:
        """Every row's session key, in step order."""
        return [key for keys, *_ in self.steps for key in keys]

    def pack(self) -> tuple:
        return (self.events, self.steps)

    @classmethod
    def unpack(cls, message: tuple) -> ToFrontend:
        """The inverse of :meth:`pack`."""
        return cls(*message)
