"""The batched channel between frontend processes and the engine process.

One message per tick in each direction and per frontend, not one per audio chunk: a frontend coalesces
every op and frame its sessions produced during one event-loop iteration; the engine sends each frontend
the results of its steps since the last message in one message. Each op (frontend -> engine) and event
(engine -> frontend) is a typed, frozen message class; ``ToEngine.pack()`` / ``ToEngine.unpack()`` and
``ToFrontend.pack()`` / ``ToFrontend.unpack()`` alone know the bytes that cross the
``multiprocessing.connection`` Unix socket (``send_bytes`` / ``recv_bytes``): msgpack by msgspec, each
message ``[class name, *fields]``, each array its dtype, shape and raw bytes. ``benchmarks/ipc.py`` measures
it against pickle and a hand-written layout, and against one message per chunk (docs/PERFORMANCE.md).

Frontend -> engine, ``ToEngine``: ops first (in order), then frames.
Engine -> frontend, ``ToFrontend``: events first, then results.
Sessions are named by a key the frontend chooses, so a frontend can send a session's first frames in the
same message as its ``Open``, without waiting for a round trip.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from cosystream.engine.headroom import LoadReport
from cosystream.frames import FRAME_SAMPLES

LOAD_FAILED, UNDECODABLE, BUSY = "load_failed", "undecodable", "busy"  # Loaded's failures


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
    id: int = 0  # the engine's index of this version (Open names it); never reused for another


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the engine tells each frontend in its ``Hello``: the models it serves (the first is the default;
    ``Open`` names one by its ``id``; a ``Models`` event replaces the tuple when a model is loaded or
    unloaded) and device (GetServerInfo shows them), its capacity, shared by every model, and ``top_k``, the
    token candidates it sends per frame (a text decoder reads at most that many). Nothing about text
    decoding: the frontends choose that."""

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


# --- ops, frontend -> engine ------------------------------------------------------------------------


class Op(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """A control op, frontend -> engine, in ``ToEngine.ops``; on the wire ``[class name, *fields]``."""


class Open(Op):
    """Give session ``key`` a slot; answered ``Opened`` or ``Rejected`` (and maybe ``Shed`` later)."""

    key: int
    priority: int  # cosystream.priority.Priority's value
    model: int = 0  # a ModelInfo.id of EngineInfo.models (0: the default)


class Reset(Op):
    """Zero the session's model state; sent only when none of its frames is in flight. A session of a model
    replaced since its last utterance moves to the new version here (``Moved`` says so)."""

    key: int


class End(Op):
    """The session's utterance has ended: its frames sent so far (this message's among them, the
    end-of-utterance silence) are all its final waits for: step them now (``Scheduler.end_utterance``)."""

    key: int


class Close(Op):
    """Free the session's slot; frames still queued for it are dropped."""

    key: int


class Listening(Op):
    """This frontend's gRPC port is open (the server is SERVING once all are)."""


class Load(Op):
    """Load the model directory ``path`` and serve it as ``name`` (a new version of a model served, or a new
    one) at ``precision`` ("": as ``name`` is served; a new name: float32); answered ``Loaded``."""

    request: int  # a number the frontend chooses; the answer carries it
    name: str
    path: str
    precision: str = ""


class Unload(Op):
    """Stop serving ``name``; answered ``Unloaded``."""

    request: int
    name: str


class Prepared(Op):
    """The answer to ``Prepare``: this frontend can decode the model (``error`` "") or why not."""

    request: int
    error: str


# --- events, engine -> frontend ---------------------------------------------------------------------


class Event(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """An event, engine -> frontend, in ``ToFrontend.events``; on the wire ``[class name, *fields]``."""


class Hello(Event):
    """The engine is warm; sent once per frontend, first."""

    info: EngineInfo


class Opened(Event):
    """Session ``key`` has a slot, on model id ``model`` (the current version of the one ``Open`` named)."""

    key: int
    model: int


class Rejected(Event):
    """No room: session ``key`` never had a slot. A refusal for load (``reason`` "overloaded",
    engine/headroom.py) says when to retry."""

    key: int
    message: str
    retry_after_s: float | None = None
    reason: str = ""


class Shed(Event):
    """BATCH session ``key`` ended to make room for REALTIME ones."""

    key: int
    message: str


class Active(Event):
    """Slots held on the engine (all frontends), how many frontends are connected and listening, and its load
    (once per load window; None before the first); sent to every frontend when any changes."""

    sessions: int
    listening: int
    report: LoadReport | None


class Models(Event):
    """The models served changed (``EngineInfo.models``' new value), or ``held``, how many model versions the
    engine holds (served, or still run by a live session); sent to every frontend, before any ``Opened`` or
    ``Moved`` that names a new model id."""

    models: tuple[ModelInfo, ...]
    held: int


class Moved(Event):
    """Session ``key`` runs on model id ``model`` from its new utterance on."""

    key: int
    model: int


class Loaded(Event):
    """The answer to ``Load``, once the model serves (``failure`` ""), or why not: ``failure`` is
    LOAD_FAILED, UNDECODABLE or BUSY and ``error`` says why in a line."""

    request: int
    model: ModelInfo | None
    failure: str
    error: str
    install_s: float  # installing it in the loop
    load_s: float  # loading and warming it


class Unloaded(Event):
    """The answer to ``Unload`` (``error`` "" once done)."""

    request: int
    error: str


class Prepare(Event):
    """A model is loaded and warm, not yet served: every frontend makes ready to decode it and answers
    ``Prepared``. It is installed once all can."""

    request: int
    model: ModelInfo


# Every op and every event class, as the decoders read them (tagged by class name).
AnyOp = Open | Reset | End | Close | Listening | Load | Unload | Prepared
AnyEvent = Hello | Opened | Rejected | Shed | Active | Models | Moved | Loaded | Unloaded | Prepare


# --- messages -----------------------------------------------------------------------------------------


class Step(msgspec.Struct, frozen=True, array_like=True):
    """The results of one step for one frontend's rows, as the step made them: the rows' session keys, their
    ids and log-probabilities as one array each (``[rows, T, top_k]``), each row's queue wait, the step's
    compute time. Two arrays per step whatever its rows: per-row arrays cost a header and a hook call each,
    per row and step."""

    keys: list[int]
    ids: np.ndarray
    logprobs: np.ndarray
    queue_s: list[float]
    compute_s: float


@dataclass(slots=True)
class ToEngine:
    """What one frontend tick sends: control ops, and runs of frames per session key."""

    ops: list[Op] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    frames: list[np.ndarray] = field(default_factory=list)

    def add_frames(self, key: int, frames: np.ndarray) -> None:
        self.keys.append(key)
        self.counts.append(len(frames))
        self.frames.append(frames)

    def __bool__(self) -> bool:
        return bool(self.ops or self.keys)

    def pack(self) -> bytes:
        """The message's bytes: its frames as one array."""
        frames = np.concatenate(self.frames) if self.frames else np.zeros((0, FRAME_SAMPLES), dtype=np.float32)
        return _ENCODER.encode(_ToEngineWire(self.ops, self.keys, self.counts, frames))

    @classmethod
    def unpack(cls, message: bytes) -> ToEngine:
        """The inverse of :meth:`pack`: the frames arrive as one read-only array (the engine copies them into
        its queue), split by ``counts`` in :meth:`runs`."""
        wire = _TO_ENGINE.decode(message)
        return cls(wire.ops, wire.keys, wire.counts, [wire.frames])

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


class ToFrontend(msgspec.Struct, array_like=True):
    """What the engine sends a frontend: events, and the results of the steps since its last message, one
    :class:`Step` per step."""

    events: list[AnyEvent] = msgspec.field(default_factory=list)
    steps: list[Step] = msgspec.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.events or self.steps)

    def add_step(
        self, keys: list[int], ids: np.ndarray, logprobs: np.ndarray, queue_s: list[float], compute_s: float
    ) -> None:
        self.steps.append(Step(keys, ids, logprobs, queue_s, compute_s))

    def rows(self) -> Iterator[tuple[int, np.ndarray, np.ndarray, float, float]]:
        """``(key, ids [T, top_k], logprobs [T, top_k], queue_s, compute_s)`` per row, in step order."""
        for step in self.steps:
            for row, key in enumerate(step.keys):
                yield key, step.ids[row], step.logprobs[row], step.queue_s[row], step.compute_s

    @property
    def keys(self) -> list[int]:
        """Every row's session key, in step order."""
        return [key for step in self.steps for key in step.keys]

    def pack(self) -> bytes:
        """The message's bytes."""
        return _ENCODER.encode(self)

    @classmethod
    def unpack(cls, message: bytes) -> ToFrontend:
        """The inverse of :meth:`pack`; its arrays are read-only (the decoders only read them)."""
        return _TO_FRONTEND.decode(message)


# --- the wire ---------------------------------------------------------------------------------------


class _ToEngineWire(msgspec.Struct, array_like=True):
    ops: list[AnyOp]
    keys: list[int]
    counts: list[int]
    frames: np.ndarray  # every run's frames, in order: [sum(counts), 160] float32


def _encode_array(value: Any) -> Any:
    if isinstance(value, np.ndarray):  # [dtype, shape, raw bytes], copied once, into the message
        return (value.dtype.str, value.shape, memoryview(np.ascontiguousarray(value)))
    raise NotImplementedError(f"no wire form for {type(value).__name__}")


def _decode_array(kind: type, value: Any) -> Any:
    if kind is np.ndarray:
        dtype, shape, data = value
        return np.frombuffer(data, dtype).reshape(shape)
    raise NotImplementedError(f"no wire form for {kind.__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_encode_array)
_TO_ENGINE = msgspec.msgpack.Decoder(_ToEngineWire, dec_hook=_decode_array)
_TO_FRONTEND = msgspec.msgpack.Decoder(ToFrontend, dec_hook=_decode_array)
