"""Live captions from a microphone (or a WAV file paced at real time) through a cosystream server.

The terminal shows the utterance being spoken on one line, rewritten in place as interim results
arrive, and commits each final on its own line with its time span; when stdout is not a terminal only
the finals are printed, one plain line each. ``--vtt`` / ``--srt`` write the finals as subtitles, one
cue per final with text, flushed cue by cue so that nothing is lost however the program ends.

Ctrl-C stops listening: the stream is half-closed, the server's last final is shown and written, and
the program exits 0 (a second Ctrl-C exits at once with 130). A dropped connection (Wi-Fi roaming, a
proxy recycling it) is resumed: the session goes on where it was, with nothing missed or repeated
(``cosystream.v1.resume``; ``--no-resume`` ends the stream instead).

    python clients/caption.py                          # the default microphone, localhost:50051
    python clients/caption.py --list-devices
    python clients/caption.py --device pulse --vtt talk.vtt --srt talk.srt
    python clients/caption.py --file speech.wav --duration 30 > captions.txt
    COSYSTREAM_TOKEN=... python clients/caption.py --server asr.example.com:443 --tls

Uses only the public API (``cosystream.v1``). Audio capture is python-sounddevice (PortAudio), imported
only for the microphone, so ``--file`` works without PortAudio.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import signal
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

try:
    import grpc
    import numpy as np

    from cosystream.v1 import cosystream_pb2 as pb
    from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
    from cosystream.v1.client import (
        DEFAULT_SERVER,
        Connection,
        HelpFormatter,
        add_connection_args,
        connection_from_args,
        describe_error,
        read_phrases,
        read_wav,
        server_address,
    )
    from cosystream.v1.resume import DEFAULT_RESUME, NO_RESUME, ResumableStream, ResumeError
except ModuleNotFoundError as err:  # not the Python cosystream is installed in: say which, not a traceback
    sys.exit(
        f"caption: {err}: run it with cosystream's Python (`. .venv/bin/activate` in the checkout, made by"
        " `make serve`), or install it there: pip install -e '.[clients]'"
    )

MIC_RATE_HZ = 16000
BLOCK_MS = 10
CUE_LINE_CHARS = 42  # the usual subtitle line length
HOLD_MS = 400
"""An interim word is shown once it has stood unchanged this long (``StableInterim``); benchmarks/flicker.py
measured the choice (docs/CLIENTS.md)."""


class CaptionError(Exception):
    """A failure the user can act on; ``main`` prints it as one line and exits 1."""


@dataclass(frozen=True, slots=True)
class CaptionConfig:
    """Everything one run needs, built from the command line in ``parse_config`` only."""

    server: str = DEFAULT_SERVER
    device: int | str | None = None
    file: Path | None = None
    vtt: Path | None = None
    srt: Path | None = None
    duration_s: float | None = None
    connect_timeout_s: float = 5.0
    connection: Connection = field(default_factory=Connection)  # TLS and token (--tls, --ca-cert, --token...)
    drain_timeout_s: float = 10.0
    hold_ms: float = HOLD_MS  # interim words are shown once unchanged this long (0: as they come)
    phrases: tuple = ()  # phrase boosting (--phrases FILE): pb.Phrase
    vocabulary: str = ""  # a named vocabulary the server holds (--vocabulary NAME)
    resume: bool = True  # a dropped connection is resumed, nothing lost (--no-resume: the stream ends)

    def __post_init__(self) -> None:
        if self.hold_ms < 0:
            raise ValueError("--hold-ms must be 0 or more")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("--duration must be positive")
        if self.connect_timeout_s <= 0 or self.drain_timeout_s <= 0:
            raise ValueError("timeouts must be positive")


# --- cues and subtitle files ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Cue:
    """One final: its utterance, its span in the stream's audio, its text."""

    utterance_index: int
    start_ms: int
    end_ms: int
    text: str


def timestamp(ms: int, decimal: str = ".") -> str:
    """``HH:MM:SS.mmm`` (WebVTT, and the terminal); SubRip wants ``decimal=","``."""
    seconds, millis = divmod(max(0, ms), 1000)
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}{decimal}{millis:03d}"


class SubtitleWriter:
    """Cues in WebVTT (``kind="vtt"``) or SubRip (``"srt"``), each flushed as soon as it is written."""

    def __init__(self, path: Path, kind: str):
        if kind not in ("vtt", "srt"):
            raise ValueError(kind)
        self.path, self.kind, self.cues = path, kind, 0
        try:
            self._file = open(path, "w", encoding="utf-8", newline="\n")  # noqa: SIM115 (closed in close())
        except OSError as err:
            raise CaptionError(f"cannot write {path}: {err.strerror}") from err
        if kind == "vtt":
            self._file.write("WEBVTT\n\n")
            self._file.flush()

    def write(self, cue: Cue) -> None:
        self.cues += 1
        decimal = "." if self.kind == "vtt" else ","
        text = cue.text
        if self.kind == "vtt":  # cue text is markup: "<" and "&" would start tags and entities
            text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        lines = textwrap.wrap(text, CUE_LINE_CHARS) or [text]
        span = f"{timestamp(cue.start_ms, decimal)} --> {timestamp(cue.end_ms, decimal)}"
        self._file.write(f"{self.cues}\n{span}\n" + "\n".join(lines) + "\n\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


# --- the terminal --------------------------------------------------------------------------------


def caption_line(cue: Cue) -> str:
    return f"[{timestamp(cue.start_ms)} --> {timestamp(cue.end_ms)}] {cue.text}"


class PlainDisplay:
    """Finals as plain lines on ``out``, flushed each; status lines on ``err``. For pipes and files."""

    def __init__(self, out: TextIO, err: TextIO):
        self.out, self.err = out, err

    def partial(self, start_ms: int, text: str) -> None:
        """The utterance in progress (``text`` may be empty: speech started, no words yet)."""

    def drop_partial(self) -> None:
        """The utterance ended with no text."""

    def final(self, cue: Cue) -> None:
        self.out.write(caption_line(cue) + "\n")
        self.out.flush()

    def status(self, message: str) -> None:
        self.err.write(f"caption: {message}\n")
        self.err.flush()

    def close(self) -> None:
        self.drop_partial()


class LiveDisplay(PlainDisplay):
    """The utterance in progress on one terminal line, rewritten in place; finals committed above it."""

    CLEAR_LINE, DIM, BOLD, RESET = "\r\x1b[2K", "\x1b[2m", "\x1b[1m", "\x1b[0m"

    def __init__(self, out: TextIO, err: TextIO, columns: Callable[[], int]):
        super().__init__(out, err)
        self._columns = columns
        self._partial = ""  # the partial line on screen, "" when none

    def partial(self, start_ms: int, text: str) -> None:
        prefix = f"[{timestamp(start_ms)} --> {'...':^12}] "
        room = max(8, self._columns() - 1 - len(prefix))  # never wrap: "\r" only rewinds one line
        if len(text) > room:
            text = "…" + text[-(room - 1) :]
        self._partial = prefix + text
        self._draw()

    def drop_partial(self) -> None:
        if self._partial:
            self._partial = ""
            self.out.write(self.CLEAR_LINE)
            self.out.flush()

    def final(self, cue: Cue) -> None:
        self._partial = ""
        span = f"[{timestamp(cue.start_ms)} --> {timestamp(cue.end_ms)}]"
        self.out.write(f"{self.CLEAR_LINE}{self.BOLD}{span}{self.RESET} {cue.text}\n")
        self.out.flush()

    def status(self, message: str) -> None:
        if self._partial:
            self.out.write(self.CLEAR_LINE)
            self.out.flush()
        super().status(message)
        self._draw()

    def _draw(self) -> None:
        if self._partial:
            self.out.write(f"{self.CLEAR_LINE}{self.DIM}{self._partial}{self.RESET}")
            self.out.flush()


class StableInterim:
    """The interim as a caption shows it: the longest prefix of its words each of which has stood unchanged
    (the same word after the same words) for ``hold_ms``, and never fewer words than were on show: a revised
    word already on screen is replaced at once rather than blanked. A beam search's interim may revise its
    newest words ("the can" -> "the cat"); holding them back until they have lasted hides most revisions,
    at the cost of showing each word ``hold_ms`` later. An interim whose ``stability`` is 1.0 (greedy
    decoding: it only grows) is shown whole at once. The page's stable.js is the same rule (docs/CLIENTS.md)."""

    def __init__(self, hold_ms: float = HOLD_MS):
        self.hold_ms = hold_ms
        self._words: list[str] = []
        self._since_ms: list[float] = []  # per word: when it took its current form (non-decreasing)
        self._on_show = 0  # words on show when the interim came: they stay on show

    def _settled(self, now_ms: float) -> int:
        settled_ms, count = now_ms - self.hold_ms, 0
        while count < len(self._words) and self._since_ms[count] <= settled_ms:
            count += 1
        return max(count, self._on_show)

    def update(self, text: str, now_ms: float, stability: float = 0.0) -> None:
        """A new interim at ``now_ms``; words it keeps keep their age."""
        words = text.split()
        self._on_show = min(self._settled(now_ms), len(words))
        kept = 0
        while kept < min(len(words), len(self._words)) and words[kept] == self._words[kept]:
            kept += 1
        if stability >= 1.0:  # it only grows: every word counts as settled
            self._since_ms = [-float("inf")] * len(words)
        else:
            self._since_ms = self._since_ms[:kept] + [now_ms] * (len(words) - kept)
        self._words = words

    def shown(self, now_ms: float) -> str:
        """The words to show at ``now_ms``."""
        return " ".join(self._words[: self._settled(now_ms)])

    def next_reveal_ms(self, now_ms: float) -> float | None:
        """When the next held word is due to be shown (None: none is held)."""
        count = self._settled(now_ms)
        return self._since_ms[count] + self.hold_ms if count < len(self._words) else None

    def reset(self) -> None:
        self._words, self._since_ms, self._on_show = [], [], 0


class Captions:
    """Turns the server's responses into display updates and subtitle cues (one cue per final with text).

    Interims go through :class:`StableInterim` (``hold_ms`` 0: shown as they come); a held word is shown when
    it is due, by a timer on the running loop, or at the next response when no loop runs."""

    def __init__(self, display: PlainDisplay, writers: list[SubtitleWriter], hold_ms: float = HOLD_MS):
        self.display, self.writers = display, writers
        self.finals = 0
        self.cues = 0
        self.interim = StableInterim(hold_ms)
        self._start_ms = 0
        self._shown = ""
        self._timer: asyncio.TimerHandle | None = None

    @staticmethod
    def _now_ms() -> float:
        return time.monotonic() * 1000

    def _show(self) -> None:
        self._timer = None
        now_ms = self._now_ms()
        text = self.interim.shown(now_ms)
        if text != self._shown:
            self._shown = text
            self.display.partial(self._start_ms, text)
        due_ms = self.interim.next_reveal_ms(now_ms)
        if due_ms is not None:
            with contextlib.suppress(RuntimeError):  # no running loop: the next response shows it
                self._timer = asyncio.get_running_loop().call_later((due_ms - now_ms) / 1000, self._show)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def handle(self, response: pb.StreamingRecognizeResponse) -> None:
        event = response.speech_event
        if response.HasField("speech_event") and event.type == pb.SpeechEvent.SPEECH_STARTED:
            self.display.partial(event.offset_ms, "")
        for result in response.results:
            if not result.is_final:
                self._cancel_timer()
                self._start_ms = result.start_ms
                self.interim.update(result.transcript, self._now_ms(), result.stability)
                self._show()
                continue
            self._cancel_timer()
            self.interim.reset()
            self._shown = ""
            self.finals += 1
            text = " ".join(result.transcript.split())
            if not text:  # a cough or a click: nothing to caption
                self.display.drop_partial()
                continue
            cue = Cue(result.utterance_index, result.start_ms, max(result.end_ms, result.start_ms + 1), text)
            self.cues += 1
            self.display.final(cue)
            for writer in self.writers:
                writer.write(cue)


# --- audio sources -------------------------------------------------------------------------------


def import_sounddevice():
    """python-sounddevice, or a CaptionError that says how to get PortAudio."""
    try:
        import sounddevice
    except OSError as err:  # the module imports, but the PortAudio library is missing
        raise CaptionError(f"PortAudio not found ({err}): install it, e.g. apt-get install libportaudio2") from err
    except ImportError as err:
        raise CaptionError("python-sounddevice is not installed: pip install sounddevice") from err
    return sounddevice


class MicrophoneSource:
    """16 kHz mono 16-bit blocks of ``BLOCK_MS`` from an input device.

    The PortAudio callback runs on its own thread and only hands a copy of each block to the event
    loop; everything else happens in ``blocks`` on the loop.
    """

    rate_hz = MIC_RATE_HZ

    def __init__(self, device: int | str | None):
        self._sd = import_sounddevice()
        try:
            self._sd.check_input_settings(device=device, channels=1, dtype="int16", samplerate=MIC_RATE_HZ)
            self.name = self._sd.query_devices(device, "input")["name"]
        except (ValueError, self._sd.PortAudioError) as err:
            which = f"{device!r}: {err}" if device is not None else f"no default input ({err})"
            raise CaptionError(f"no input device: {which}; see --list-devices") from err
        self.device = device
        self.overflows = 0
        self._queue: asyncio.Queue[tuple[bytes, object] | None] = asyncio.Queue()

    async def blocks(self) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        queue = self._queue

        def callback(indata, frames, time_info, status) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (bytes(indata), status))

        try:
            stream = self._sd.RawInputStream(
                samplerate=MIC_RATE_HZ,
                blocksize=MIC_RATE_HZ * BLOCK_MS // 1000,
                device=self.device,
                channels=1,
                dtype="int16",
                callback=callback,
            )
        except self._sd.PortAudioError as err:
            raise CaptionError(f"cannot open input device {self.name!r}: {err}") from err
        with stream:  # closing it waits for a running callback, so none fires after the loop is gone
            while (item := await queue.get()) is not None:
                block, status = item
                self.overflows += bool(status.input_overflow)
                yield block

    def stop(self) -> None:
        self._queue.put_nowait(None)


class FileSource:
    """A WAV file (PCM, float, mu-law or A-law; channels averaged) in ``BLOCK_MS`` blocks, paced at real time."""

    def __init__(self, path: Path):
        try:
            audio, self.rate_hz = read_wav(path)
        except (OSError, ValueError) as err:
            raise CaptionError(f"cannot read {path}: {err}") from err
        self._samples = (np.clip(audio, -1, 1 - 1 / 32768) * 32768).astype("<i2")
        self.name = str(path)
        self.overflows = 0
        self._stopped = False

    async def blocks(self) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        step = max(1, self.rate_hz * BLOCK_MS // 1000)
        start_s = loop.time()
        for offset in range(0, len(self._samples), step):
            await asyncio.sleep(max(0.0, start_s + offset / self.rate_hz - loop.time()))
            if self._stopped:
                return
            yield self._samples[offset : offset + step].tobytes()

    def stop(self) -> None:
        self._stopped = True


# --- the stream ----------------------------------------------------------------------------------


class Captioner:
    """One captioning run: connect, stream the source's audio, hand responses to ``Captions``."""

    def __init__(self, config: CaptionConfig, source: MicrophoneSource | FileSource, captions: Captions):
        self.config, self.source, self.captions = config, source, captions
        self.display = captions.display
        self.stopping = False
        self.audio_s = 0.0
        self._audio_ended_s: float | None = None  # (loop time) the source ended: the last final is due

    def stop(self) -> None:
        """Stop listening; the server's last final still arrives."""
        if not self.stopping:
            self.stopping = True
            self.display.status("stopping: waiting for the last final (Ctrl-C again to quit now)")
            self.source.stop()

    async def run(self) -> None:
        options = [("grpc.max_receive_message_length", 16 << 20)]
        try:
            channel = self.config.connection.aio_channel(self.config.server, options=options)
        except ValueError as err:
            raise CaptionError(str(err)) from err
        async with channel:
            stub = pb_grpc.CosyStreamStub(channel)
            try:
                info = await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=self.config.connect_timeout_s)
            except grpc.aio.AioRpcError as err:
                reason = describe_error(err.code(), err.details(), self.config.connection)
                if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise CaptionError(f"server unreachable at {self.config.server}: {reason}") from err
                raise CaptionError(f"server at {self.config.server} refused: {reason}") from err
            model = next((m.name for m in info.models if m.is_default), "?")
            self.display.status(
                f"connected to {self.config.server} (cosystream {info.version}, {model} on {info.device})"
            )
            config = pb.StreamingConfig(
                encoding=pb.LINEAR16,
                sample_rate_hz=self.source.rate_hz,
                priority=pb.REALTIME,
                interim_results=True,
                phrases=self.config.phrases,
                vocabulary=self.config.vocabulary,
            )
            stream = ResumableStream(
                stub,
                config,
                policy=DEFAULT_RESUME if self.config.resume else NO_RESUME,
                on_resume=lambda n: self.display.status(f"connection lost and resumed ({n}): nothing was missed"),
            )
            try:
                await self._stream(stream)
            except grpc.aio.AioRpcError as err:
                code, details = err.code(), err.details()
                verb = "ended the stream" if code == grpc.StatusCode.UNAVAILABLE else "refused the stream"
                raise CaptionError(
                    f"server {verb}: {describe_error(code, details, self.config.connection)}"
                ) from err
            except ResumeError as err:
                raise CaptionError(f"the stream could not be resumed: {err}") from err
        if self.source.overflows:
            self.display.status(f"warning: {self.source.overflows} input overflows (audio was dropped)")

    async def _stream(self, stream: ResumableStream) -> None:
        """Every response to the captions, the connection resumed if it drops; once the audio has ended, the
        last final must come within ``drain_timeout_s``."""
        responses = stream.recognize(self._audio())
        try:
            while True:
                wait_s = None if self._audio_ended_s is None else self._drain_left_s()
                try:
                    response = await asyncio.wait_for(anext(responses), wait_s)
                except StopAsyncIteration:
                    return
                except TimeoutError as err:
                    raise CaptionError(
                        f"the server sent no last final within {self.config.drain_timeout_s:g} s of the end of the audio"
                    ) from err
                self.captions.handle(response)
        finally:
            await responses.aclose()

    def _drain_left_s(self) -> float:
        return max(0.0, self._audio_ended_s + self.config.drain_timeout_s - asyncio.get_running_loop().time())

    async def _audio(self) -> AsyncIterator[bytes]:
        """The source's blocks, until it ends or ``duration_s`` of them were sent."""
        limit = self.config.duration_s * self.source.rate_hz if self.config.duration_s else float("inf")
        sent = 0
        try:
            async with contextlib.aclosing(self.source.blocks()) as blocks:
                async for block in blocks:
                    yield block
                    if not sent:
                        self.display.status(f"listening to {self.source.name} (Ctrl-C to stop)")
                    sent += len(block) // 2
                    self.audio_s = sent / self.source.rate_hz
                    if sent >= limit:
                        break
        finally:
            self._audio_ended_s = asyncio.get_running_loop().time()


async def caption(config: CaptionConfig, display: PlainDisplay) -> Captions:
    """Run until the audio ends, ``duration_s`` passes, or Ctrl-C; return what was captioned."""
    source = FileSource(config.file) if config.file else MicrophoneSource(config.device)
    writers: list[SubtitleWriter] = []
    try:
        for path, kind in ((config.vtt, "vtt"), (config.srt, "srt")):
            if path is not None:
                writers.append(SubtitleWriter(path, kind))
        captions = Captions(display, writers, config.hold_ms)
        captioner = Captioner(config, source, captions)
        loop = asyncio.get_running_loop()
        main_task = asyncio.current_task()

        def interrupt() -> None:
            if captioner.stopping:
                main_task.cancel()
            else:
                captioner.stop()

        with install_sigint(loop, interrupt):
            await captioner.run()
    finally:
        display.close()
        for writer in writers:
            writer.close()
    files = "".join(f", {w.path}" for w in writers)
    display.status(f"{captions.cues} caption(s) from {captioner.audio_s:.2f} s of audio{files}")
    return captions


@contextlib.contextmanager
def install_sigint(loop: asyncio.AbstractEventLoop, handler: Callable[[], None]):
    """Ctrl-C calls ``handler`` on the loop (portable, unlike ``loop.add_signal_handler``)."""
    previous = signal.signal(signal.SIGINT, lambda *_: loop.call_soon_threadsafe(handler))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# --- command line --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument(
        "--server", default=DEFAULT_SERVER, type=server_address, help="host[:port] (default: %(default)s)"
    )
    parser.add_argument("--list-devices", action="store_true", help="list audio devices and exit")
    parser.add_argument("--device", help="input device: an index or part of a name (see --list-devices)")
    parser.add_argument("--file", type=Path, metavar="WAV", help="play a 16-bit WAV at real time instead")
    parser.add_argument("--vtt", type=Path, metavar="OUT", help="write the finals as WebVTT subtitles")
    parser.add_argument("--srt", type=Path, metavar="OUT", help="write the finals as SubRip subtitles")
    parser.add_argument("--duration", type=float, metavar="S", help="stop after S seconds of audio")
    parser.add_argument("--connect-timeout-s", type=float, default=5.0, help="give up connecting after this long")
    parser.add_argument("--drain-timeout-s", type=float, default=10.0, help="wait for the last final this long")
    parser.add_argument(
        "--hold-ms",
        type=float,
        default=HOLD_MS,
        help="show an interim word once it has stood unchanged this long; 0 shows interims as they come "
        "(default: %(default)g)",
    )
    parser.add_argument(
        "--phrases",
        type=Path,
        help="words and phrases to expect (names, jargon), boosted: one per line, optionally a tab and a boost "
        "(0 < boost <= 20)",
    )
    parser.add_argument(
        "--vocabulary",
        default="",
        metavar="NAME",
        help="a named vocabulary the server holds (serve --vocabulary NAME=FILE), boosted with --phrases",
    )
    parser.add_argument(
        "--no-resume",
        dest="resume",
        action="store_false",
        help="end on a dropped connection instead of resuming the session (docs/RELIABILITY.md)",
    )
    add_connection_args(parser)
    return parser.parse_args(argv)


def parse_config(args: argparse.Namespace) -> CaptionConfig:
    device = int(args.device) if args.device and args.device.isdigit() else args.device
    return CaptionConfig(
        server=args.server,
        device=device,
        file=args.file,
        vtt=args.vtt,
        srt=args.srt,
        duration_s=args.duration,
        connect_timeout_s=args.connect_timeout_s,
        drain_timeout_s=args.drain_timeout_s,
        hold_ms=args.hold_ms,
        connection=connection_from_args(args),
        phrases=read_phrases(args.phrases) if args.phrases else (),
        vocabulary=args.vocabulary,
        resume=args.resume,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.list_devices:
            print(import_sounddevice().query_devices() or "no audio devices found")
            return 0
        try:
            config = parse_config(args)
        except ValueError as err:
            raise CaptionError(str(err)) from err
        if sys.stdout.isatty():
            display = LiveDisplay(sys.stdout, sys.stderr, lambda: shutil.get_terminal_size().columns)
        else:
            display = PlainDisplay(sys.stdout, sys.stderr)
        asyncio.run(caption(config, display))
    except CaptionError as err:
        print(f"caption: error: {err}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError):  # a second Ctrl-C, or one before the loop ran
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
