"""What per-utterance tracing costs a frontend: a session's CPU per second of audio with tracing off
(``serve`` without ``--otlp-endpoint``), on but the utterance not sampled (``--trace-sample 0``), and on with
every utterance traced (spans batched to an exporter that drops them, so the export's HTTP is not counted).

One ``Session`` (real webrtcvad, endpointer, framing and greedy decoding; the engine answered in-process
with blank-and-token ids, so no model runs) is fed a recording in 10 ms chunks, as fast as it goes, in
interleaved rounds. Prints JSON and a table.

    python -m benchmarks.tracing --rounds 5 --seconds 60
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks._harness import dump
from cosystream.audio.codecs import AudioEncoding
from cosystream.audio.endpointing import EndpointingConfig
from cosystream.decoding.greedy import CtcDecoder
from cosystream.frontend.session import Session, SessionConfig
from cosystream.frontend.tracing import TracingConfig, start_tracing
from cosystream.priority import Priority
from cosystream.v1.client import read_wav

ROOT = Path(__file__).resolve().parents[1]
RECORDING = ROOT / "docs" / "audio" / "agent-pass.wav"
CONDITIONS = ("off", "on, not sampled", "on, every utterance")


class _Engine:
    """Answers the frames sent after each chunk (:meth:`answer`): a token every third frame, blanks between."""

    def __init__(self) -> None:
        self.session: Session | None = None
        self.sent: list[int] = []

    def send_frames(self, key: int, frames: np.ndarray) -> None:
        self.sent.append(len(frames))

    def answer(self) -> None:
        while self.sent:
            ids = np.where(np.arange(self.sent.pop(0)) % 3 == 0, 2, 0).astype(np.int32)[:, None]
            self.session.on_results(ids, np.full(ids.shape, -0.1, np.float32), 0.001, 0.002)

    def end_utterance(self, key: int) -> None:
        pass

    def reset(self, key: int) -> None:
        pass


def _drop_exporter():
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class Drop(SpanExporter):
        def __init__(self) -> None:
            self.spans = 0

        def export(self, spans) -> SpanExportResult:
            self.spans += len(spans)
            return SpanExportResult.SUCCESS

    return Drop()


def audio_pcm(seconds: float) -> tuple[bytes, int]:
    """The recording with 1 s of silence after it, repeated to ``seconds``, as 16-bit PCM; its rate."""
    audio, rate = read_wav(RECORDING)
    once = np.concatenate([audio, np.zeros(rate, np.float32)])
    audio = np.tile(once, int(np.ceil(seconds * rate / len(once))))[: int(seconds * rate)]
    return (np.clip(audio, -1, 1 - 1 / 32768) * 32768).astype("<i2").tobytes(), rate


def run(pcm: bytes, rate: int, condition: str) -> dict:
    tracer = None
    exporter = None
    if condition != "off":
        exporter = _drop_exporter()
        sample = 1.0 if condition == "on, every utterance" else 0.0
        tracer = start_tracing(TracingConfig("http://127.0.0.1:9/v1/traces", sample), exporter)
    engine, responses = _Engine(), []
    config = SessionConfig(
        encoding=AudioEncoding.LINEAR16,
        sample_rate_hz=rate,
        priority=Priority.REALTIME,
        interim_results=True,
        endpointing=EndpointingConfig(),
        word_time_offsets=True,
    )
    session = Session(1, "bench", config, CtcDecoder(["_", " ", "a"]), engine, responses.append, tracer=tracer)
    engine.session = session
    started = time.process_time()
    chunk = rate // 100 * 2  # 10 ms
    for offset in range(0, len(pcm), chunk):
        session.feed_audio(pcm[offset : offset + chunk], time.monotonic())
        engine.answer()
    session.finish()
    while engine.sent:
        engine.answer()
    cpu_s = time.process_time() - started
    session.close()
    if tracer is not None:
        tracer.shutdown()
    audio_s = len(pcm) / (2 * rate)
    finals = sum(1 for r in responses if r.result is not None and r.result.is_final)
    return {
        "cpu_ms_per_audio_s": 1000 * cpu_s / audio_s,
        "finals": finals,
        "spans": exporter.spans if exporter is not None else 0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=60.0, help="audio per run")
    parser.add_argument("--json", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    pcm, rate = audio_pcm(args.seconds)
    runs: dict[str, list[dict]] = {c: [] for c in CONDITIONS}
    for round_ in range(args.rounds):
        order = CONDITIONS if round_ % 2 == 0 else CONDITIONS[::-1]
        for condition in order:
            runs[condition].append(run(pcm, rate, condition))
    rows = []
    for condition, results in runs.items():
        cpu = [r["cpu_ms_per_audio_s"] for r in results]
        rows.append(
            {
                "condition": condition,
                "cpu_ms_per_audio_s_median": round(statistics.median(cpu), 4),
                "cpu_ms_per_audio_s_min": round(min(cpu), 4),
                "finals": results[0]["finals"],
                "spans": results[0]["spans"],
            }
        )
    dump({"rounds": args.rounds, "audio_s": args.seconds, "results": rows}, args.json)
    print(f"\n{'condition':<22}{'CPU ms/audio s (median)':>26}{'min':>10}{'finals':>8}{'spans':>8}")
    for row in rows:
        print(
            f"{row['condition']:<22}{row['cpu_ms_per_audio_s_median']:>26.3f}{row['cpu_ms_per_audio_s_min']:>10.3f}"
            f"{row['finals']:>8}{row['spans']:>8}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
