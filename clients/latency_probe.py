"""First-packet and per-chunk latency of a cosystream server under many concurrent paced streams.

Opens ``--realtime N`` REALTIME sessions streaming speech paced at real time in ``--chunk-ms`` chunks and
``--batch M`` BATCH sessions sending as fast as flow control allows, for ``--duration`` seconds, and
reports p50/p90/p95/p99/max per class of:

- first_packet_ms: first audio sent -> first response;
- first_result_ms: speech onset in the audio (the send time of the chunk holding it) -> first non-empty
  result of that utterance;
- chunk_latency_ms: send time of the chunk that completed the newest audio a result covers
  (``latency.audio_processed_ms``) -> that result's arrival;
- interim_latency_ms: the same for interim results only (a final that waits for a second pass is in
  chunk_latency_ms, and at one final per few seconds of speech it is that metric's tail);
- final_latency_ms: end of speech (send time of the chunk holding it) -> the final; includes the
  server's end-of-utterance silence (``endpointing.silence_ms``);
- finalize_ms (``--finalize-after-ms M``): each realtime stream sends FINALIZE M ms of audio after each
  sentence ends, as a push-to-talk client does on release; FINALIZE sent -> that utterance's final.

Uses only the public API (``cosystream.v1``) and, with ``--metrics-url``, the server's Prometheus
endpoint for deadline misses.

    python clients/latency_probe.py --server localhost:50051 --realtime 50 --duration 20 --json out.json
    COSYSTREAM_TOKEN=... python clients/latency_probe.py --server asr.example.com:443 --tls
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import wave
from dataclasses import dataclass, field
from pathlib import Path

from cosystream.v1.client import HelpFormatter

try:
    import grpc
    import numpy as np

    from cosystream.v1 import client
    from cosystream.v1 import cosystream_pb2 as pb
    from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
    from cosystream.v1.client import (
        DEFAULT_SERVER,
        Connection,
        StreamStatus,
        add_connection_args,
        connection_from_args,
        describe_error,
        server_address,
    )
except ModuleNotFoundError as err:  # not the Python cosystream is installed in: say which, not a traceback
    sys.exit(
        f"latency_probe: {err}: run it with cosystream's Python (`. .venv/bin/activate` in the checkout, made by"
        " `make serve`), or install it there: pip install -e '.[clients]'"
    )

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "please call me back tomorrow morning before nine",
    "she sells sea shells by the sea shore",
    "we will meet at the station at half past four",
    "thank you for calling how can i help you today",
    "the weather will be cloudy with a chance of rain",
]
METRICS = (
    "first_packet_ms",
    "first_result_ms",
    "chunk_latency_ms",
    "interim_latency_ms",
    "final_latency_ms",
    "finalize_ms",
)
PERCENTILES = (50, 90, 95, 99)
STREAMS_PER_CONNECTION = 8  # the default --channels: one connection per 8 sessions, as many clients would open


@dataclass
class Audio:
    """16-bit mono audio at 16 kHz with the known speech spans [(onset_ms, end_ms)]."""

    samples: np.ndarray
    speech_ms: list[tuple[int, int]]

    @property
    def duration_s(self) -> float:
        return len(self.samples) / 16000


def synthesize(seed: int = 0, gap_s: float = 1.2) -> Audio:
    """Sentences spoken by espeak-ng, separated by pauses, with their speech spans."""
    if shutil.which("espeak-ng") is None:
        sys.exit("latency_probe: espeak-ng is needed to synthesize speech (or pass --wav FILES)")
    import soxr

    rng = np.random.default_rng(seed)
    parts, spans, cursor = [np.zeros(int(0.5 * 16000), np.float32)], [], int(0.5 * 16000)
    with tempfile.TemporaryDirectory() as tmp:
        for i, sentence in enumerate(rng.permutation(SENTENCES)):
            path = Path(tmp) / f"{i}.wav"
            subprocess.run(["espeak-ng", "-w", str(path), str(sentence)], check=True, capture_output=True)
            samples, rate = read_wav(path)
            speech = soxr.resample(samples, rate, 16000).astype(np.float32)
            voiced = np.flatnonzero(np.abs(speech) > 0.02)
            spans.append(((cursor + voiced[0]) * 1000 // 16000, (cursor + voiced[-1]) * 1000 // 16000))
            gap = np.zeros(int(gap_s * 16000), np.float32)
            parts += [speech, gap]
            cursor += len(speech) + len(gap)
    return Audio(np.concatenate(parts), spans)


def read_wav(path: Path | str) -> tuple[np.ndarray, int]:
    """float32 mono samples and the rate of a WAV file (PCM, float, mu-law or A-law)."""
    try:
        return client.read_wav(path)
    except (OSError, ValueError) as err:
        sys.exit(f"latency_probe: {err}")


def write_wav(path: Path | str, samples: np.ndarray, rate_hz: int = 16000) -> None:
    """16-bit mono PCM."""
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate_hz)
        w.writeframes((np.clip(samples, -1, 1 - 1 / 32768) * 32768).astype("<i2").tobytes())


def load_wavs(paths: list[str]) -> Audio:
    """WAV files back to back; their speech spans from a simple energy detector."""
    import soxr

    samples = [soxr.resample(*read_wav(p), 16000).astype(np.float32) for p in paths]
    joined = np.concatenate(samples)
    frames = joined[: len(joined) // 160 * 160].reshape(-1, 160)
    active = np.sqrt((frames**2).mean(axis=1)) > 0.01
    spans, start = [], None
    for i, on in enumerate(active):
        if on and start is None:
            start = i
        if not on and start is not None and not active[i : i + 50].any():
            spans.append((start * 10, i * 10))
            start = None
    if start is not None:
        spans.append((start * 10, len(active) * 10))
    return Audio(joined, spans)


@dataclass
class SessionStats:
    priority: str
    first_packet_ms: list[float] = field(default_factory=list)
    first_result_ms: list[float] = field(default_factory=list)
    chunk_latency_ms: list[float] = field(default_factory=list)
    interim_latency_ms: list[float] = field(default_factory=list)
    final_latency_ms: list[float] = field(default_factory=list)
    finalize_ms: list[float] = field(default_factory=list)
    audio_s: float = 0.0
    wall_s: float = 0.0
    error: str | None = None


class Stream:
    """One session: its requests, the send time of each chunk, and what its responses measure."""

    def __init__(
        self,
        audio: Audio,
        chunk_ms: int,
        encoding: int,
        rate_hz: int,
        priority: str,
        duration_s: float,
        finalize_after_ms: float | None = None,
    ):
        self.audio = audio
        self.chunk_ms = chunk_ms
        self.priority = priority
        self.stats = SessionStats(priority)
        samples = audio.samples
        if rate_hz != 16000:
            import soxr

            samples = soxr.resample(samples, 16000, rate_hz).astype(np.float32)
        chunk = rate_hz * chunk_ms // 1000
        repeats = max(1, math.ceil(duration_s / audio.duration_s)) if priority == "realtime" else 1
        loop = np.tile(samples, repeats)[: int(duration_s * rate_hz)] if priority == "realtime" else samples
        if encoding == pb.MULAW:
            data, width = client.encode_mulaw(loop), 1
        else:
            data, width = (np.clip(loop, -1, 1 - 1 / 32768) * 32768).astype("<i2").tobytes(), 2
        self.chunks = [data[i : i + chunk * width] for i in range(0, len(data), chunk * width)]
        self.sent_s = np.full(len(self.chunks), np.nan)
        self.config = pb.StreamingConfig(
            encoding=encoding,
            sample_rate_hz=rate_hz,
            priority=pb.REALTIME if priority == "realtime" else pb.BATCH,
            # Live captions want interims; a file sent as BATCH wants its finals.
            interim_results=priority == "realtime",
        )
        period_ms = int(audio.duration_s * 1000)
        self.spans = [
            (on + k * period_ms, off + k * period_ms)
            for k in range(repeats)
            for on, off in audio.speech_ms
            if on + k * period_ms < len(loop) * 1000 // rate_hz
        ]
        self.queue: asyncio.Queue | None = None
        # FINALIZE after these chunks (the one holding each sentence's end + finalize_after_ms).
        self.finalize_after = (
            set()
            if finalize_after_ms is None
            else {
                self.chunk_index(off + finalize_after_ms)
                for _, off in self.spans
                if off + finalize_after_ms < len(loop) * 1000 // rate_hz
            }
        )
        self.finalize_sent: list[float] = []  # send times of the FINALIZEs not yet answered by a final

    def chunk_index(self, audio_ms: float) -> int:
        return min(len(self.chunks) - 1, max(0, math.ceil(audio_ms / self.chunk_ms) - 1))

    async def requests(self):
        if self.priority == "batch":
            yield pb.StreamingRecognizeRequest(config=self.config)
            for i, chunk in enumerate(self.chunks):
                self.sent_s[i] = time.monotonic()
                yield pb.StreamingRecognizeRequest(audio=chunk)
            return
        # A realtime stream opens its session when its audio starts, as a call does when it arrives: with
        # --ramp-s the sessions arrive over the ramp, not all at once waiting for their audio.
        i = await self.queue.get()
        if i is None:
            return
        yield pb.StreamingRecognizeRequest(config=self.config)
        while i is not None:
            self.sent_s[i] = time.monotonic()
            yield pb.StreamingRecognizeRequest(audio=self.chunks[i])
            if i in self.finalize_after:
                self.finalize_sent.append(time.monotonic())
                yield pb.StreamingRecognizeRequest(control=pb.Control(type=pb.Control.FINALIZE))
            i = await self.queue.get()

    async def run(self, stub, connection: Connection | None = None) -> None:
        stats = self.stats
        self.sent_s[:] = np.nan
        started = time.monotonic()
        utterance_seen: set[int] = set()
        status = StreamStatus()
        try:
            async for response in stub.StreamingRecognize(self.requests()):
                status.seen(response)
                now = time.monotonic()
                if not stats.first_packet_ms and not math.isnan(self.sent_s[0]):
                    stats.first_packet_ms.append((now - self.sent_s[0]) * 1e3)
                for result in response.results:
                    index = result.utterance_index
                    sent = self.sent_s[self.chunk_index(response.latency.audio_processed_ms)]
                    if not math.isnan(sent):
                        stats.chunk_latency_ms.append((now - sent) * 1e3)
                        if not result.is_final:
                            stats.interim_latency_ms.append((now - sent) * 1e3)
                    # The utterance's onset in the audio: the known speech span nearest the server's start.
                    onset_ms = (
                        min(self.spans, key=lambda span: abs(span[0] - result.start_ms))[0]
                        if self.spans
                        else result.start_ms
                    )
                    onset = self.sent_s[self.chunk_index(onset_ms + self.chunk_ms)]
                    if result.transcript and index not in utterance_seen and not math.isnan(onset):
                        utterance_seen.add(index)
                        stats.first_result_ms.append((now - onset) * 1e3)
                    if result.is_final:
                        end = self.sent_s[self.chunk_index(result.end_ms)]
                        if not math.isnan(end):
                            stats.final_latency_ms.append((now - end) * 1e3)
                        if self.finalize_sent:
                            stats.finalize_ms.append((now - self.finalize_sent.pop(0)) * 1e3)
        except grpc.aio.AioRpcError as err:
            code, details = status.code_and_details(err)
            stats.error = describe_error(code, details, connection)
        stats.wall_s = time.monotonic() - started
        stats.audio_s = np.count_nonzero(~np.isnan(self.sent_s)) * self.chunk_ms / 1000


async def run_probe(args: argparse.Namespace, audio: Audio) -> list[SessionStats]:
    encoding = pb.MULAW if args.encoding == "MULAW" else pb.LINEAR16
    # Each channel its own TCP connection: channels with equal arguments otherwise share one subchannel, and
    # a server's SO_REUSEPORT frontends balance connections, not streams.
    options = [("grpc.max_receive_message_length", 16 << 20), ("grpc.use_local_subchannel_pool", 1)]
    connection = args.connection
    sessions = args.realtime + args.batch
    count = args.channels or max(1, math.ceil(sessions / STREAMS_PER_CONNECTION))
    channels = [connection.aio_channel(args.server, options=options) for _ in range(count)]
    stubs = [pb_grpc.CosyStreamStub(c) for c in channels]
    realtime = [
        Stream(audio, args.chunk_ms, encoding, args.rate, "realtime", args.duration, args.finalize_after_ms)
        for _ in range(args.realtime)
    ]
    batch = [
        Stream(audio, args.batch_chunk_ms, encoding, args.rate, "batch", args.duration) for _ in range(args.batch)
    ]
    for stream in realtime:
        stream.queue = asyncio.Queue()
    tasks = []
    start = time.monotonic() + 0.2
    ramp_s = args.ramp_s
    offsets = [ramp_s * i / max(1, len(realtime)) for i in range(len(realtime))]
    for i, stream in enumerate(realtime):
        tasks.append(asyncio.create_task(stream.run(stubs[i % len(stubs)], connection)))
    deadline = time.monotonic() + args.duration + ramp_s + 30

    async def batch_loop(stream: Stream, stub) -> None:
        """A BATCH session streams the audio as fast as it may, again and again until the run ends."""
        total = stream.stats
        while True:
            await stream.run(stub, connection)
            total = _merge(total, stream.stats) if total is not stream.stats else total
            if stream.stats.error or time.monotonic() >= start + ramp_s + args.duration:
                break
            stream.stats = SessionStats("batch")
        stream.stats = total

    for i, stream in enumerate(batch):
        tasks.append(asyncio.create_task(batch_loop(stream, stubs[i % len(stubs)])))
    # One ticker paces every realtime stream: each tick hands every due stream its next chunk.
    next_chunk = [0] * len(realtime)
    tick = 0
    period = args.chunk_ms / 1000
    while (
        any(n < len(s.chunks) for n, s in zip(next_chunk, realtime, strict=True)) and time.monotonic() < deadline
    ):
        now = time.monotonic()
        for i, stream in enumerate(realtime):
            due = now - (start + offsets[i])
            while next_chunk[i] < len(stream.chunks) and next_chunk[i] * period <= due:
                stream.queue.put_nowait(next_chunk[i])
                next_chunk[i] += 1
                if next_chunk[i] == len(stream.chunks):
                    stream.queue.put_nowait(None)  # half-close right after the last chunk
        tick += 1
        await asyncio.sleep(max(0.0, start + tick * period / 2 - time.monotonic()))
    for n, stream in zip(next_chunk, realtime, strict=True):
        if n < len(stream.chunks):
            stream.queue.put_nowait(None)  # the deadline passed first
    if tasks:
        await asyncio.wait(tasks, timeout=max(5.0, deadline - time.monotonic()))
    for channel in channels:
        await channel.close()
    return [s.stats for s in realtime + batch]


def _probe_worker(args: argparse.Namespace, audio: Audio) -> list[SessionStats]:
    return asyncio.run(run_probe(args, audio))


def run_probe_processes(args: argparse.Namespace, audio: Audio) -> list[SessionStats]:
    """``--processes N``: the sessions split over N probe processes (one asyncio loop saturates a core
    near 200 paced streams), their per-session figures merged."""
    import concurrent.futures
    import multiprocessing

    n = max(1, min(args.processes, args.realtime + args.batch))  # no process without a session
    shares = [
        argparse.Namespace(
            **{**vars(args), "realtime": args.realtime // n + (i < args.realtime % n)}
            | {"batch": args.batch // n + (i < args.batch % n)}
        )
        for i in range(n)
    ]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(n, mp_context=context) as pool:
        parts = list(pool.map(_probe_worker, shares, [audio] * n))
    return [stats for part in parts for stats in part]


def _merge(total: SessionStats, more: SessionStats) -> SessionStats:
    for name in METRICS:
        getattr(total, name).extend(getattr(more, name))
    total.audio_s += more.audio_s
    total.wall_s += more.wall_s
    total.error = total.error or more.error
    return total


def summarize(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {**{f"p{p}": None for p in PERCENTILES}, "max": None}
    array = np.asarray(values)
    return {**{f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES}, "max": float(array.max())}


def deadline_misses(metrics_url: str | None) -> int | None:
    if not metrics_url:
        return None
    try:
        text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    except (OSError, ValueError) as err:
        sys.exit(f"latency_probe: cannot read --metrics-url {metrics_url}: {getattr(err, 'reason', err)}")
    match = re.search(r"^cosystream_deadline_misses_total (\S+)", text, re.M)
    return int(float(match.group(1))) if match else 0


def report(stats: list[SessionStats], config: dict, misses: int | None) -> dict:
    classes = {}
    for priority in ("realtime", "batch"):
        group = [s for s in stats if s.priority == priority]
        entry = {name: summarize([v for s in group for v in getattr(s, name)]) for name in METRICS}
        entry["sessions"] = len(group)
        entry["errors"] = sum(1 for s in group if s.error)
        entry["deadline_misses"] = (misses or 0) if priority == "realtime" else 0
        entry["audio_seconds"] = sum(s.audio_s for s in group)
        if priority == "batch" and group:
            wall = max(s.wall_s for s in group)
            entry["realtime_factor"] = entry["audio_seconds"] / wall if wall else None
        entry["error_messages"] = sorted({s.error for s in group if s.error})[:5]
        classes[priority] = entry
    return {"classes": classes, "config": config}


def table(result: dict, other: dict | None = None) -> str:
    lines = []
    header = f"{'class':<9} {'metric':<18} {'p50':>8} {'p90':>8} {'p95':>8} {'p99':>8} {'max':>8}"
    if other:
        header += f" {'other p50':>10} {'other p99':>10}"
    lines.append(header)
    for name, entry in result["classes"].items():
        if not entry["sessions"]:
            continue
        for metric in METRICS:
            s = entry[metric]
            if metric == "finalize_ms" and s["p50"] is None:
                continue  # measured only with --finalize-after-ms
            cells = " ".join(
                f"{s[k]:>8.1f}" if s[k] is not None else f"{'-':>8}" for k in ("p50", "p90", "p95", "p99", "max")
            )
            line = f"{name:<9} {metric:<18} {cells}"
            if other:
                o = other["classes"].get(name, {}).get(metric) or {}
                line += " ".join(
                    f" {o.get(k):>9.1f}" if o.get(k) is not None else f" {'-':>9}" for k in ("p50", "p99")
                )
            lines.append(line)
    return "\n".join(lines)


def summary_line(result: dict) -> str:
    rt, bt = result["classes"]["realtime"], result["classes"]["batch"]

    def p(entry, metric, q):
        value = entry[metric][q]
        return f"{value:.1f}" if value is not None else "-"

    line = (
        f"realtime={rt['sessions']} chunk p50={p(rt, 'chunk_latency_ms', 'p50')}ms p99={p(rt, 'chunk_latency_ms', 'p99')}ms"
        f" first_result p50={p(rt, 'first_result_ms', 'p50')}ms misses={rt['deadline_misses']} errors={rt['errors']}"
    )
    if bt["sessions"]:
        line += f" | batch={bt['sessions']} x{bt.get('realtime_factor') or 0:.1f} realtime errors={bt['errors']}"
    return line


def plot(result: dict, stats: list[SessionStats], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(5 * len(METRICS), 4))
    for ax, metric in zip(axes, METRICS, strict=True):
        for priority in ("realtime", "batch"):
            values = np.sort([v for s in stats if s.priority == priority for v in getattr(s, metric)])
            if len(values):
                ax.plot(values, np.linspace(0, 1, len(values)), label=priority)
        ax.set_title(metric)
        ax.set_xlabel("ms")
        ax.grid(True)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--server", default=DEFAULT_SERVER, type=server_address, help="host[:port]")
    parser.add_argument("--realtime", type=int, default=10, help="REALTIME sessions")
    parser.add_argument("--batch", type=int, default=0, help="BATCH sessions (sent as fast as allowed)")
    parser.add_argument("--chunk-ms", type=int, default=10, help="realtime chunk size (20 for telephony)")
    parser.add_argument("--batch-chunk-ms", type=int, default=100, help="BATCH chunk size")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of audio per realtime session")
    parser.add_argument(
        "--ramp-s",
        type=float,
        default=1.0,
        help="spread realtime sessions' arrivals (stream and audio) over this long",
    )
    parser.add_argument(
        "--finalize-after-ms",
        type=float,
        default=None,
        help="realtime streams send FINALIZE this long after each sentence ends (measures finalize_ms)",
    )
    parser.add_argument(
        "--encoding", choices=["LINEAR16", "MULAW"], default="LINEAR16", help="the audio's encoding"
    )
    parser.add_argument("--rate", type=int, default=16000, help="the audio's sample rate, Hz")
    parser.add_argument("--wav", nargs="*", help="WAV files to stream (default: synthesized speech)")
    parser.add_argument(
        "--channels",
        type=int,
        default=0,
        help=f"gRPC connections per probe process (default: one per {STREAMS_PER_CONNECTION} sessions)",
    )
    parser.add_argument(
        "--processes", type=int, default=1, help="probe processes to split the sessions over (each its own core)"
    )
    parser.add_argument(
        "--save-wav", default=None, help="write the synthesized speech to this WAV file and exit (for --wav)"
    )
    parser.add_argument("--metrics-url", default=None, help="the server's /metrics, for deadline misses")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, help="CDF plot (PNG)")
    parser.add_argument("--compare", default=None, help="an earlier --json to show side by side")
    add_connection_args(parser)
    args = parser.parse_args(argv)
    try:
        args.connection = connection_from_args(args)
        args.connection.credentials(args.server)  # a token to another host without TLS: say so now
    except ValueError as err:
        parser.exit(2, f"latency_probe: {err}\n")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.processes < 1:
        sys.exit("latency_probe: --processes must be >= 1")
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # say so now, not after the run
        sys.exit(
            "latency_probe: --plot needs matplotlib: pip install matplotlib (in the checkout: pip install -e '.[clients]')"
        )
    audio = load_wavs(args.wav) if args.wav else synthesize()
    if args.save_wav:
        write_wav(args.save_wav, audio.samples)
        return 0
    misses_before = deadline_misses(args.metrics_url)
    try:
        probe = run_probe_processes if args.processes > 1 else _probe_worker
        stats = probe(args, audio)
    except KeyboardInterrupt:
        return 130
    misses = None if misses_before is None else deadline_misses(args.metrics_url) - misses_before
    left_out = ("json", "plot", "compare", "wav", "save_wav", "connection", "token")  # (never the token)
    config = {k: v for k, v in vars(args).items() if k not in left_out}
    result = report(stats, config, misses)
    other = json.loads(Path(args.compare).read_text()) if args.compare else None
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, stats, args.plot)
    print(table(result, other))
    print(summary_line(result))
    failed = [s for s in stats if s.error]
    if stats and len(failed) == len(stats):
        reasons = sorted({s.error for s in failed})
        print(
            f"latency_probe: every stream failed against {args.server}: {'; '.join(reasons[:3])}", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
