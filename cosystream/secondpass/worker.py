"""The second pass's worker process and the frontend's handle on it.

One worker process per frontend (``concurrent.futures.ProcessPoolExecutor(max_workers=1)``, spawned, so it
inherits neither the frontend's gRPC threads nor torch, and niced below the streaming processes, so that on
a busy CPU the streaming steps keep their cores and the second pass's finals fall back to the streaming ones
at their deadline instead of delaying every stream) reads one batch at a time: the job at the head of the
queue and up to ``max_batch - 1`` more of the same priority whose audio falls in the same length bucket
(:func:`length_bucket`: a short utterance is not padded to a long one's length), in one encoder call and one
batched decode. Utterances that end near each other (several sessions pausing together) so share a call; a
lone one goes alone, at once. Nothing more is sent while a batch runs: a job would only wait in the worker
instead of in the queue here, where it can still be reordered, joined to a batch, and dropped. The queue is
the frontend's: a heap of jobs, REALTIME before BATCH, then the oldest deadline; a job whose deadline passes
(queued or running) is answered with None at once and the streaming final stands (a batch still running
``stuck_after_s`` past a job's deadline has hung the worker, which is killed). A worker that dies answers
its jobs with None and is started again (at most :data:`MAX_RESTARTS` times in :data:`RESTART_WINDOW_S`; then the second pass turns
itself off and says so). All callbacks run on the frontend's asyncio loop.

Why an executor and not a hand-made pipe protocol: it already reports a dead worker (``BrokenProcessPool``)
on the job it was running, carries exceptions back with their messages, and its pickled calls need no
message classes of our own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import logging
import math
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cosystream.prctl import exit_with_parent, set_process_name
from cosystream.secondpass.whisper import SAMPLE_RATE_HZ, ModelError, SecondPassResult, resolve_model

log = logging.getLogger(__name__)

MAX_RESTARTS = 3
COST_WEIGHT = 0.3  # of the newest batch in the average cost per audio second
RESTART_WINDOW_S = 60.0
WARMUP_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class SecondPassConfig:
    """``serve --final-model`` and ``--final-deadline-ms``."""

    model: str  # a CTranslate2 Whisper directory, or "embedded:whisper-tiny-en" / "embedded:whisper-base"
    deadline_ms: int = 3000  # from an utterance's end to its final at the latest
    max_queued: int = 32  # jobs waiting; past it an utterance keeps its streaming final
    max_batch: int = 8  # utterances read in one call
    cpu_threads: int = 1
    device: str = "cpu"  # cpu, cuda, or auto (CUDA when CTranslate2 sees and loads on one)
    # The worker's CPU priority below the streaming processes': on a busy CPU the streaming steps keep their
    # cores and the second pass gets what is left (its finals then pass their deadline: the streaming ones).
    nice: int = 10
    # A job still running this long after its deadline has hung the worker: it is killed and started again.
    stuck_after_s: float = 30.0
    # An utterance whose speech is followed by this much silence (or more: what the endpoint's silence leaves
    # after the read's measured cost) is read early, while the worker has nothing else to do, so that its
    # final is ready at the endpoint; speech again drops the read. 0: only at the end.
    early_ms: int = 150
    # A REALTIME stream's final waiting for the second pass holds back the next utterance's interims (up to its
    # deadline). False: it goes with the streaming text once the next utterance has an interim (interims never
    # wait). A BATCH stream's finals always wait.
    holds_next: bool = False

    def __post_init__(self) -> None:
        resolve_model(self.model)  # raises ModelError with what to fix
        if not 1 <= self.deadline_ms <= 600_000:
            raise ValueError(f"final deadline must be 1 to 600000 ms, got {self.deadline_ms}")
        if self.max_queued < 1 or self.cpu_threads < 1 or self.max_batch < 1:
            raise ValueError("max_queued, max_batch and cpu_threads must be >= 1")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"second-pass nice must be 0 to 19, got {self.nice}")
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"second-pass device must be cpu, cuda or auto, got {self.device!r}")
        if not self.stuck_after_s > 0:
            raise ValueError(f"stuck_after_s must be > 0, got {self.stuck_after_s}")
        if not 0 <= self.early_ms <= 10_000:
            raise ValueError(f"final early read must be 0 (off) to 10000 ms of silence, got {self.early_ms}")


# --- in the worker process ---------------------------------------------------------------------------

_transcriber = None


def _started() -> None:
    """The worker's first act: named (``ps``, the benchmarks' CPU per process), and ended by the kernel when
    its frontend dies, however it dies (a SIGKILL leaves no worker behind holding the model's memory)."""
    exit_with_parent()
    set_process_name("cs-second-pass")


def _load(spec: str, cpu_threads: int, device: str, nice: int) -> tuple[float, str]:
    """Load the model (once per process); returns the seconds a 1 s warm-up took and the device it runs on."""
    global _transcriber
    from cosystream.secondpass.whisper import WhisperTranscriber

    if _transcriber is None:
        os.nice(nice)  # (the streaming engine and frontends come first for the CPU)
        _transcriber = WhisperTranscriber(spec, cpu_threads, device)
    return _transcriber.transcribe(np.zeros(16000, dtype=np.int16)).compute_s, _transcriber.device


def _transcribe(audios: list[np.ndarray], word_times: list[bool], hotwords: str = "") -> list[SecondPassResult]:
    return _transcriber.transcribe_batch(audios, word_times, hotwords)


def length_bucket(samples: int) -> int:
    """Jobs batch together only within a bucket: up to 2 s, 4 s, 8 s, 16 s, longer (16 kHz samples)."""
    return min(4, max(0, math.ceil(math.log2(max(samples, 1) / 32000))))


# --- in the frontend -----------------------------------------------------------------------------------

OnDone = Callable[[SecondPassResult | None], None]


class SecondPassObserver(Protocol):
    """Where the frontend's metrics hear of the second pass (``cosystream.metrics.SecondPassMetrics``)."""

    def job_ended(self, outcome: str, seconds: float) -> None:
        """A job ended ``seconds`` after it was queued: ``used``, ``gated`` (answered, the streaming final
        stands), ``late``, ``failed`` or ``cancelled``; or it was ``refused`` (0 s)."""

    def batch_read(self, size: int, seconds: float) -> None:
        """The worker read ``size`` utterances in one call of ``seconds``."""

    def early_ended(self, kept: bool) -> None:
        """An early read (of an utterance at a pause) was kept for its final, or dropped (speech went on)."""


class _Job:
    __slots__ = (
        "audio",
        "deadline_s",
        "done",
        "hotwords",
        "index",
        "key",
        "on_done",
        "submitted_s",
        "timer",
        "word_times",
    )

    def __init__(
        self,
        key: int,
        index: int,
        audio: np.ndarray,
        deadline_s: float,
        on_done: OnDone,
        word_times: bool,
        hotwords: str = "",
    ):
        self.key, self.index, self.audio, self.deadline_s, self.on_done = key, index, audio, deadline_s, on_done
        self.word_times, self.hotwords = word_times, hotwords
        self.submitted_s = time.monotonic()
        self.done = False
        self.timer: asyncio.TimerHandle | None = None


@dataclass(slots=True)
class SecondPassStats:
    """Counts since start: every submitted job ends as exactly one of used, late, failed and cancelled."""

    submitted: int = 0
    refused: int = 0  # the queue full, or the second pass off (never submitted)
    used: int = 0  # a result came in time (gated or not)
    late: int = 0  # the deadline passed first, or its final went without it (the next utterance's results came)
    failed: int = 0  # the worker failed or died
    cancelled: int = 0  # its session closed first
    batches: int = 0  # worker calls (each reads 1 to max_batch jobs)
    early: int = 0  # of those submitted: read early, at a pause before the utterance's end
    early_kept: int = 0  # early reads the utterance then ended on (their answer is its final's)
    early_dropped: int = 0  # early reads dropped: the speech went on (a dropped job still queued: cancelled)


class SecondPass:
    """The frontend's handle. Create and :meth:`start` it on the frontend's loop; :meth:`close` at stop."""

    def __init__(self, config: SecondPassConfig, observer: SecondPassObserver | None = None):
        self.config = config
        self.observer = observer
        self.stats = SecondPassStats()
        self._loop = asyncio.get_running_loop()
        self._heap: list[tuple[int, float, int, _Job]] = []
        self._seq = itertools.count()
        self._running: list[_Job] = []  # the batch the worker reads now
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._restarts: list[float] = []
        self._cutoff_s: float | None = None  # (monotonic) set by hurry()
        # Seconds of work per second of audio, measured (an average over recent batches; first the warm-up's,
        # which over-estimates: its padding is most of its cost); and the batch running now.
        self._cost_s = 1.0
        self._running_audio_s = 0.0
        self._running_since_s = 0.0
        self.enabled = False

    @property
    def idle(self) -> bool:
        """Nothing running and nothing queued: an early read would delay no one's final."""
        return not self._running and all(job.done for *_, job in self._heap)

    def predict_s(self, audio_s: float) -> float:
        """Seconds a read of ``audio_s`` seconds of audio takes alone, by the measured cost."""
        return audio_s * self._cost_s

    @property
    def pending(self) -> int:
        """Jobs queued or running that still wait for an answer."""
        return sum(not job.done for *_, job in self._heap) + sum(not job.done for job in self._running)

    async def start(self) -> None:
        """Start the worker and load the model; raises :class:`ModelError` (its message) when it cannot."""
        self._pool = self._new_pool()
        try:
            warmup_s, device = await asyncio.wait_for(
                asyncio.wrap_future(self._pool.submit(_load, *self._load_args())),
                WARMUP_TIMEOUT_S,
            )
        except concurrent.futures.process.BrokenProcessPool:
            self.close()
            raise ModelError("second pass: its worker process died while loading the model") from None
        except (ModelError, OSError, RuntimeError, ValueError, TimeoutError) as err:
            self.close()
            raise ModelError(f"second pass: {err}") from None
        self.enabled = True
        self._cost_s = warmup_s  # (1 s of audio)
        log.info("second pass: %s ready on %s (1 s of audio in %.2f s)", self.config.model, device, warmup_s)

    def submit(
        self,
        key: int,
        index: int,
        audio: np.ndarray,
        realtime: bool,
        on_done: OnDone,
        word_times: bool = False,
        hotwords: str = "",
        early: bool = False,
    ) -> _Job | None:
        """Queue utterance ``index`` of session ``key`` (int16, 16 kHz; ``word_times``: its words' times
        wanted; ``hotwords``: its session's phrases, Whisper's prompt): ``on_done`` gets its result, or None
        (late, failed, or the worker gone), exactly once, on the loop and never from inside this call.
        Returns the job (for :meth:`early_ended`), or None (and never calls ``on_done``) when it is refused: the
        streaming final stands. ``early``: a read at a pause, before the utterance has ended, taken only
        while the worker is :attr:`idle` (else None, not counted as refused: the read comes at the end)."""
        if early and not (self.enabled and self.idle):
            return None
        wait_s = self.config.deadline_ms / 1e3
        if self._cutoff_s is not None:
            wait_s = max(0.0, min(wait_s, self._cutoff_s - time.monotonic()))
        if not self.enabled or len(self._heap) >= self.config.max_queued or self._behind(audio, realtime, wait_s):
            self.stats.refused += 1
            if self.observer is not None:
                self.observer.job_ended("refused", 0.0)
            return None
        deadline_s = time.monotonic() + wait_s
        job = _Job(key, index, audio, deadline_s, on_done, word_times, hotwords)
        job.timer = self._loop.call_at(self._loop.time() + wait_s, self._late, job)
        heapq.heappush(self._heap, (0 if realtime else 1, deadline_s, next(self._seq), job))
        self.stats.submitted += 1
        self.stats.early += early
        self._loop.call_soon(self._dispatch)
        return job

    def early_ended(self, job: _Job, kept: bool) -> None:
        """The utterance of early read ``job`` ended on it (``kept``: its answer is the final's, whenever it
        comes), or its speech went on: the job is dropped (answered with nothing; a running one's answer is
        thrown away) and its utterance is read again at its end."""
        if kept:
            self.stats.early_kept += 1
        else:
            self.stats.early_dropped += 1
            self._finish(job, "cancelled")
        if self.observer is not None:
            self.observer.early_ended(kept)

    def give_up(self, job: _Job) -> None:
        """The final waiting for ``job`` was sent without it: the job ends as late (a queued one is never read,
        a running one's answer is thrown away)."""
        self._finish(job, "late")

    def _behind(self, audio: np.ndarray, realtime: bool, wait_s: float) -> bool:
        """Whether a job with ``audio`` would, by the measured cost, be answered after ``wait_s``, behind the
        batch running and the jobs queued ahead of it (REALTIME jobs wait only for REALTIME ones). Such a job
        is refused at once: its final goes now with the streaming text, instead of being held to its deadline
        and holding back its stream's next responses. A job with nothing ahead of it always gets its chance."""
        ahead = [entry[-1] for entry in self._heap if not entry[-1].done and (entry[0] == 0 or not realtime)]
        if not ahead and not self._running:
            return False
        running_s = max(0.0, self._running_audio_s * self._cost_s - (time.monotonic() - self._running_since_s))
        queued_audio_s = (sum(len(job.audio) for job in ahead) + len(audio)) / SAMPLE_RATE_HZ
        return running_s + queued_audio_s * self._cost_s > wait_s

    def hurry(self, within_s: float) -> None:
        """From now on no job waits past ``within_s`` from now (queued, running or submitted later): a drain's
        cut streams get their finals before the drain stops waiting for them, whatever the deadline."""
        cutoff_s = time.monotonic() + within_s
        self._cutoff_s = cutoff_s if self._cutoff_s is None else min(self._cutoff_s, cutoff_s)
        for job in [entry[-1] for entry in self._heap] + self._running:
            if not job.done and job.deadline_s > cutoff_s:
                job.deadline_s = cutoff_s
                job.timer.cancel()
                job.timer = self._loop.call_later(within_s, self._late, job)

    def cancel(self, key: int) -> None:
        """Session ``key`` closed: its jobs are answered with nothing and not run."""
        for *_, job in self._heap:
            if job.key == key:
                self._finish(job, "cancelled")
        for job in self._running:
            if job.key == key:
                self._finish(job, "cancelled")

    def close(self) -> None:
        """Stop the worker; every job still waiting gets None."""
        self.enabled = False
        for *_, job in self._heap:
            self._answer(job, None, "failed")
        self._heap.clear()
        for job in self._running:
            self._answer(job, None, "failed")
        if self._pool is not None:
            workers = self._workers()
            self._pool.shutdown(wait=False, cancel_futures=True)
            # An idle worker may never read the executor's stop sentinel (seen on CPython 3.11: the worker waits
            # for a job, the executor's thread and the frontend's exit wait for the worker), so it is ended here:
            # it holds nothing to save.
            for process in workers:
                if process.is_alive():
                    process.kill()
            self._pool = None

    # --- internals ---------------------------------------------------------------------------------

    def _load_args(self) -> tuple[str, int, str, int]:
        return self.config.model, self.config.cpu_threads, self.config.device, self.config.nice

    def _workers(self) -> list[multiprocessing.Process]:
        """The pool's worker processes (the executor has no public kill)."""
        return list((self._pool._processes or {}).values()) if self._pool is not None else []

    def _new_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        return concurrent.futures.ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_started
        )

    def _finish(self, job: _Job, outcome: str, gated: bool = False) -> bool:
        """Mark ``job`` answered (False if it already was) and count ``outcome``."""
        if job.done:
            return False
        job.done = True
        job.audio = None  # (a late job's audio is not kept until the worker is done with it)
        if job.timer is not None:
            job.timer.cancel()
        setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)
        if self.observer is not None:
            self.observer.job_ended("gated" if gated else outcome, time.monotonic() - job.submitted_s)
        return True

    def _answer(self, job: _Job, result: SecondPassResult | None, outcome: str) -> None:
        if self._finish(job, outcome, gated=result is not None and bool(result.gated)):
            try:
                job.on_done(result)
            except Exception:
                log.exception("second pass: a session's callback failed")

    def _late(self, job: _Job) -> None:
        self._answer(job, None, "late")
        if job in self._running:
            self._loop.call_later(self.config.stuck_after_s, self._kill_if_stuck, job)

    def _kill_if_stuck(self, job: _Job) -> None:
        """A batch running ``stuck_after_s`` past a job's deadline: kill the worker (its jobs then fail as a dead
        worker's, and the worker is started again), so the jobs behind it are not all late."""
        if job not in self._running or self._pool is None:
            return
        log.error("second pass: a job ran %.0f s past its deadline; killing the worker", self.config.stuck_after_s)
        for process in self._workers():
            process.kill()

    def _dispatch(self) -> None:
        if self._running or self._pool is None:
            return
        while self._heap:
            first = heapq.heappop(self._heap)
            if not first[-1].done:
                break
        else:
            return
        # The head job, and the next ones in queue order of its priority, length bucket and hotwords (one
        # prompt per call).
        priority, bucket, hotwords = first[0], length_bucket(len(first[-1].audio)), first[-1].hotwords
        batch, rest = [first[-1]], []
        for entry in sorted(self._heap):
            job = entry[-1]
            if job.done:
                continue
            if (
                len(batch) < self.config.max_batch
                and entry[0] == priority
                and length_bucket(len(job.audio)) == bucket
                and job.hotwords == hotwords
            ):
                batch.append(job)
            else:
                rest.append(entry)
        self._heap = rest  # (sorted: a heap already)
        self._running = batch
        self._running_audio_s = sum(len(job.audio) for job in batch) / SAMPLE_RATE_HZ
        self._running_since_s = time.monotonic()
        self.stats.batches += 1
        future = self._pool.submit(
            _transcribe, [job.audio for job in batch], [job.word_times for job in batch], hotwords
        )
        future.add_done_callback(lambda f: self._loop.call_soon_threadsafe(self._completed, batch, f))

    def _completed(self, batch: list[_Job], future: concurrent.futures.Future) -> None:
        self._running = []
        try:
            results = future.result()
        except concurrent.futures.process.BrokenProcessPool:
            log.error(
                "second pass: the worker process died; %d utterance(s) keep their streaming final", len(batch)
            )
            for job in batch:
                self._answer(job, None, "failed")
            self._restart()
        except Exception as err:  # (a bug in the worker: this batch only)
            log.error("second pass: %d utterance(s) failed in the worker: %s", len(batch), err)
            for job in batch:
                self._answer(job, None, "failed")
        else:
            if results:
                cost_s = results[0].compute_s / max(self._running_audio_s, 0.1)
                self._cost_s += COST_WEIGHT * (cost_s - self._cost_s)
                if self.observer is not None:
                    self.observer.batch_read(len(batch), results[0].compute_s)
            for job, result in zip(batch, results, strict=True):
                self._answer(job, result, "used")
        self._dispatch()

    def _restart(self) -> None:
        if self._pool is None:
            return
        self._pool.shutdown(wait=False, cancel_futures=True)
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S] + [now]
        if len(self._restarts) > MAX_RESTARTS:
            log.error(
                "second pass: the worker died %d times in %.0f s; turned off, finals come from the streaming model",
                len(self._restarts),
                RESTART_WINDOW_S,
            )
            self._pool = None
            self.close()
            return
        self._pool = self._new_pool()
        # (the model loads with the next job: that job's deadline may pass while it does)
        self._pool.submit(_load, *self._load_args())
