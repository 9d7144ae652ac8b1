"""``clients/caption.py`` end to end: a local server, the client as users run it (a subprocess), and the
subtitles it writes; the microphone path through a real PulseAudio daemon with a null sink.

The model may be untrained, so these pin structure (one cue per final with text, valid WebVTT/SRT, time
spans where the speech is in the audio), never the words.
"""

from __future__ import annotations

import asyncio
import ctypes.util
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path

import numpy as np
import pytest

from clients import caption
from cosystream.app.local import LocalServer
from cosystream.engine.config import EngineConfig
from cosystream.v1 import cosystream_pb2 as pb
from tests.servers import CuttingProxy
from tests.speech import needs_espeak, silence, speech

ROOT = Path(__file__).resolve().parents[1]
CLIENT = [sys.executable, str(ROOT / "clients" / "caption.py")]
FIRST = "the quick brown fox jumps over the lazy dog"
SECOND = "please call me back tomorrow morning"
LINE = re.compile(r"\[(\d\d:\d\d:\d\d\.\d{3}) --> (\d\d:\d\d:\d\d\.\d{3})\] (\S.*)")


# --- helpers -------------------------------------------------------------------------------------


def write_wav(path: Path, audio: np.ndarray, rate_hz: int = 16000) -> Path:
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate_hz)
        wav.writeframes((np.clip(audio, -1, 1 - 1 / 32768) * 32768).astype("<i2").tobytes())
    return path


def onsets_ms(parts: list[np.ndarray]) -> list[tuple[int, int]]:
    """The voiced span of each speech part (odd positions) of silence/speech/silence/... in ms."""
    spans, cursor = [], 0
    for i, part in enumerate(parts):
        if i % 2:
            voiced = np.flatnonzero(np.abs(part) > 0.02)
            spans.append(((cursor + voiced[0]) * 1000 // 16000, (cursor + voiced[-1]) * 1000 // 16000))
        cursor += len(part)
    return spans


def ms(text: str, decimal: str = ".") -> int:
    hours, minutes, rest = text.split(":")
    seconds, millis = rest.split(decimal)
    return ((int(hours) * 60 + int(minutes)) * 60 + int(seconds)) * 1000 + int(millis)


def parse_subtitles(text: str, kind: str) -> list[tuple[int, int, str]]:
    """Cues of a WebVTT or SubRip file, checking the syntax strictly: [(start_ms, end_ms, text)]."""
    decimal = "." if kind == "vtt" else ","
    stamp = r"\d{2,}:[0-5]\d:[0-5]\d" + re.escape(decimal) + r"\d{3}"
    if kind == "vtt":
        assert text.startswith("WEBVTT\n\n"), "a WebVTT file starts with its signature and a blank line"
        text = text[len("WEBVTT\n\n") :]
    assert text == "" or text.endswith("\n\n"), "every cue ends with a blank line"
    cues = []
    for number, block in enumerate(filter(None, text.split("\n\n")), start=1):
        lines = block.split("\n")
        if kind == "srt" or "-->" not in lines[0]:
            assert lines[0] == str(number), f"cue {number}: identifier {lines[0]!r}"
            lines = lines[1:]
        match = re.fullmatch(f"({stamp}) --> ({stamp})", lines[0])
        assert match, f"cue {number}: timing line {lines[0]!r}"
        payload = lines[1:]
        assert payload and all(line.strip() for line in payload), f"cue {number}: empty text"
        assert not any("-->" in line for line in payload)
        start, end = ms(match.group(1), decimal), ms(match.group(2), decimal)
        assert start < end, f"cue {number}: {start} >= {end}"
        cues.append((start, end, " ".join(payload)))
    starts = [c[0] for c in cues]
    assert starts == sorted(starts), "cues in time order"
    return cues


def plain_finals(stdout: str) -> list[tuple[int, int, str]]:
    """The non-TTY output: one plain line per final, no escape codes."""
    assert "\x1b" not in stdout and "\r" not in stdout
    lines = stdout.splitlines()
    matches = [LINE.fullmatch(line) for line in lines]
    assert all(matches), f"not a caption line: {lines}"
    return [(ms(m.group(1)), ms(m.group(2)), m.group(3)) for m in matches]


def run_client(*args: str, env: dict | None = None, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLIENT, *args], capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT, check=False
    )


def start_client(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, list[str]]:
    """The client in the background, once it has sent its first audio block; its stderr lines so far."""
    process = subprocess.Popen(
        [*CLIENT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    lines = []
    while not any("listening to" in line for line in lines):
        line = process.stderr.readline()
        assert line, "the client exited early:\n" + "".join(lines) + process.stderr.read()
        lines.append(line)
    return process, lines


# --- no server needed ----------------------------------------------------------------------------


def test_timestamps():
    assert caption.timestamp(0) == "00:00:00.000"
    assert caption.timestamp(3_723_045) == "01:02:03.045"
    assert caption.timestamp(61_001, ",") == "00:01:01,001"


@pytest.mark.parametrize("kind", ["vtt", "srt"])
def test_subtitles_are_flushed_cue_by_cue(tmp_path, kind):
    path = tmp_path / f"out.{kind}"
    writer = caption.SubtitleWriter(path, kind)
    writer.write(caption.Cue(0, 1200, 3400, "fish & chips <b>now</b> " + "word " * 20))
    # Still open: what a crash or a kill would leave behind is already there.
    (cue,) = parse_subtitles(path.read_text(), kind)
    writer.write(caption.Cue(1, 5000, 6000, "two"))
    writer.close()
    cues = parse_subtitles(path.read_text(), kind)
    assert cues[0] == cue and cues[1] == (5000, 6000, "two")
    assert cue[:2] == (1200, 3400)
    assert all(len(line) <= caption.CUE_LINE_CHARS for line in path.read_text().splitlines())
    if kind == "vtt":
        assert "&amp;" in cue[2] and "&lt;b&gt;" in cue[2] and "<" not in cue[2]


def test_live_display_rewrites_the_partial_in_place():
    out, err = io.StringIO(), io.StringIO()
    display = caption.LiveDisplay(out, err, columns=lambda: 60)
    display.partial(1000, "hello")
    display.partial(1000, "hello there " + "x" * 80)
    display.status("note")
    display.final(caption.Cue(0, 1000, 2500, "hello there"))
    display.close()
    screen = out.getvalue()
    drawn = [part.split("\x1b[2m")[-1].split("\x1b[0m")[0] for part in screen.split("\r\x1b[2K") if part]
    assert drawn[0] == "[00:00:01.000 -->     ...     ] hello"
    assert all(len(line) < 60 for line in drawn[:-1]), "a partial never wraps (\\r rewinds one line only)"
    assert drawn[1].endswith("…" + "x" * 26), "a long partial shows its newest words"
    assert screen.endswith("\r\x1b[2K\x1b[1m[00:00:01.000 --> 00:00:02.500]\x1b[0m hello there\n")
    assert screen.count("\n") == 1, "only finals are committed"
    assert err.getvalue() == "caption: note\n"


class ShownPartials(caption.PlainDisplay):
    """Records each partial the captions show."""

    def __init__(self):
        super().__init__(io.StringIO(), io.StringIO())
        self.shown: list[str] = []

    def partial(self, start_ms: int, text: str) -> None:
        self.shown.append(text)


def interim(text: str, stability: float = 0.5) -> pb.StreamingRecognizeResponse:
    return pb.StreamingRecognizeResponse(results=[pb.StreamingResult(transcript=text, stability=stability)])


def test_interims_are_shown_once_their_words_have_lasted():
    """A beam search's revision within the hold is never shown; the words that last appear by a timer,
    with no further response; a greedy interim (stability 1.0) and --hold-ms 0 show at once."""

    async def run(hold_ms: float) -> list[str]:
        display = ShownPartials()
        captions = caption.Captions(display, [], hold_ms=hold_ms)
        captions.handle(interim("the can"))
        await asyncio.sleep(0.05)
        captions.handle(interim("the cat"))  # "can" revised well within the hold
        await asyncio.sleep(hold_ms / 1000 + 0.3)  # nothing arrives: the timer shows what lasted
        captions.handle(interim("the cat sat on", stability=1.0))
        final = pb.StreamingResult(transcript="the cat sat on it", is_final=True, end_ms=900)
        captions.handle(pb.StreamingRecognizeResponse(results=[final]))
        await asyncio.sleep(hold_ms / 1000 + 0.1)  # and nothing is shown after the final
        return display.shown

    held = asyncio.run(run(1000))  # (long enough that a loaded box's sleep(0.05) stays well within it)
    assert held == ["the", "the cat", "the cat sat on"], held
    assert asyncio.run(run(0)) == ["the can", "the cat", "the cat sat on"]


def test_empty_finals_make_no_cue(tmp_path):
    out = io.StringIO()
    writer = caption.SubtitleWriter(tmp_path / "out.vtt", "vtt")
    captions = caption.Captions(caption.PlainDisplay(out, io.StringIO()), [writer])
    for index, text in enumerate(["", "  some  words "]):
        result = pb.StreamingResult(transcript=text, is_final=True, start_ms=10, end_ms=900, utterance_index=index)
        captions.handle(pb.StreamingRecognizeResponse(results=[result]))
    writer.close()
    assert (captions.finals, captions.cues) == (2, 1)
    assert plain_finals(out.getvalue()) == [(10, 900, "some words")]
    assert parse_subtitles((tmp_path / "out.vtt").read_text(), "vtt") == [(10, 900, "some words")]


def test_no_sounddevice(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sounddevice", None)  # import fails as it does without the package
    assert caption.main(["--list-devices"]) == 1
    assert (
        capsys.readouterr().err == "caption: error: python-sounddevice is not installed: pip install sounddevice\n"
    )


def test_no_portaudio(monkeypatch, capsys):
    pytest.importorskip("sounddevice", reason="needs python-sounddevice")
    monkeypatch.delitem(sys.modules, "sounddevice")  # re-imported, and restored afterwards
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert caption.main(["--list-devices"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("caption: error: PortAudio not found") and "libportaudio2" in err
    assert err.count("\n") == 1


def test_no_input_device(capsys):
    pytest.importorskip("sounddevice", reason="needs python-sounddevice and PortAudio (libportaudio2)")
    assert caption.main(["--device", "no-such-device", "--server", "127.0.0.1:1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("caption: error: no input device: 'no-such-device'") and err.count("\n") == 1


# --- against a local server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    with LocalServer(engine=EngineConfig(max_sessions=4, max_batch=4)) as srv:
        yield srv


@pytest.fixture(scope="module")
def two_utterances():
    """0.3 s silence, FIRST, 1.2 s pause, SECOND, 0.7 s silence; the voiced spans in ms."""
    parts = [silence(0.3), speech(FIRST), silence(1.2), speech(SECOND), silence(0.7)]
    return np.concatenate(parts), onsets_ms(parts)


@pytest.fixture(scope="module")
def file_run(server, two_utterances, tmp_path_factory):
    """One run of ``--file`` writing WebVTT and SubRip; 3 s of trailing silence cut off by ``--duration``."""
    audio, spans = two_utterances
    tmp = tmp_path_factory.mktemp("file_run")
    wav = write_wav(tmp / "speech.wav", np.concatenate([audio, silence(3.0)]))
    duration_s = len(audio) / 16000
    args = [
        "--server",
        server.address,
        "--file",
        str(wav),
        "--vtt",
        str(tmp / "out.vtt"),
        "--srt",
        str(tmp / "out.srt"),
    ]
    started = time.monotonic()
    run = run_client(*args, "--duration", f"{duration_s:.2f}")
    return run, time.monotonic() - started, tmp, spans, duration_s


@needs_espeak
def test_file_mode_writes_webvtt(file_run):
    run, wall_s, tmp, spans, duration_s = file_run
    assert run.returncode == 0, run.stderr
    cues = parse_subtitles((tmp / "out.vtt").read_text(), "vtt")
    assert len(cues) == 2, cues
    for (start, end, _), (onset, offset) in zip(cues, spans, strict=True):
        assert abs(start - onset) <= 300, (cues, spans)
        assert offset - 300 <= end <= offset + 800, (cues, spans)
    assert cues[0][1] < cues[1][0]
    # Paced at real time, and --duration stopped it before the trailing silence.
    assert duration_s - 0.5 <= wall_s <= duration_s + 6
    assert f"2 caption(s) from {duration_s:.2f} s of audio" in run.stderr


@needs_espeak
def test_srt_matches_the_webvtt(file_run):
    _, _, tmp, _, _ = file_run
    srt = parse_subtitles((tmp / "out.srt").read_text(), "srt")
    assert srt == parse_subtitles((tmp / "out.vtt").read_text(), "vtt") and srt


@needs_espeak
def test_plain_output_when_not_a_tty(file_run):
    run, _, tmp, _, _ = file_run
    finals = plain_finals(run.stdout)
    cues = parse_subtitles((tmp / "out.vtt").read_text(), "vtt")
    assert [f[:2] for f in finals] == [c[:2] for c in cues], "one line per final, one cue per final"
    assert [f[2].replace(" ", "") for f in finals] == [c[2].replace(" ", "") for c in cues]  # cues are wrapped
    assert "connected to" in run.stderr and "listening to" in run.stderr


@needs_espeak
def test_ctrl_c_flushes_the_last_final(server, tmp_path):
    """Ctrl-C mid-utterance: the stream is half-closed, the server finalizes it, the cue is written, exit 0."""
    wav = write_wav(tmp_path / "long.wav", np.concatenate([silence(0.3), *[speech(FIRST)] * 4]))
    process, _ = start_client("--server", server.address, "--file", str(wav), "--vtt", str(tmp_path / "out.vtt"))
    time.sleep(1.5)
    process.send_signal(signal.SIGINT)
    interrupted = time.monotonic()
    stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    assert time.monotonic() - interrupted < 5
    assert "stopping: waiting for the last final" in stderr
    cues = parse_subtitles((tmp_path / "out.vtt").read_text(), "vtt")
    assert len(cues) == 1 and len(plain_finals(stdout)) == 1
    start, end, _ = cues[0]
    assert abs(start - 300) <= 300 and 1000 <= end <= 2600, cues  # stopped near 1.5 s of a 10 s file


@needs_espeak
def test_a_dropped_connection_is_resumed_and_the_captions_are_whole(server, file_run):
    """The same file as ``file_run``, through a proxy that resets the connection mid-utterance: the captioner
    resumes the session by itself and writes the same captions, each once."""
    run, _, tmp, _, duration_s = file_run
    expected = parse_subtitles((tmp / "out.vtt").read_text(), "vtt")
    proxy = CuttingProxy(server.port)
    try:
        args = [
            "--server",
            f"127.0.0.1:{proxy.port}",
            "--file",
            str(tmp / "speech.wav"),
            "--vtt",
            str(tmp / "cut.vtt"),
        ]
        process, _ = start_client(*args, "--duration", f"{duration_s:.2f}")
        time.sleep(1.0)  # (inside the first utterance)
        proxy.cut()
        stdout, stderr = process.communicate(timeout=60)
    finally:
        proxy.close()
    assert process.returncode == 0, stderr
    assert "connection lost and resumed (1)" in stderr
    assert parse_subtitles((tmp / "cut.vtt").read_text(), "vtt") == expected
    assert plain_finals(stdout) == plain_finals(run.stdout)


def test_server_unreachable(tmp_path):
    wav = write_wav(tmp_path / "quiet.wav", silence(0.5))
    run = run_client("--server", "127.0.0.1:1", "--file", str(wav), "--connect-timeout-s", "3")
    assert run.returncode == 1
    assert run.stderr.startswith("caption: error: server unreachable at 127.0.0.1:1: UNAVAILABLE")
    assert run.stderr.count("\n") == 1, run.stderr


def test_server_refusal_shows_its_status(server, tmp_path):
    wav = write_wav(tmp_path / "low.wav", silence(0.5, 4000), rate_hz=4000)  # below the server's 8 kHz
    run = run_client("--server", server.address, "--file", str(wav), "--connect-timeout-s", "30")
    assert run.returncode == 1, run.stderr
    error = run.stderr.splitlines()[-1]
    assert error.startswith("caption: error: server refused the stream: INVALID_ARGUMENT: ") and "4000" in error


# --- the microphone, through PulseAudio ----------------------------------------------------------


@pytest.fixture()
def pulse():
    """A private PulseAudio daemon whose default source is a 16 kHz mono null sink's monitor.

    Root-safe: HOME and XDG_RUNTIME_DIR point at a temporary directory (so no user session, D-Bus or
    cookie is needed), the native socket accepts anonymous clients, and ``-n`` skips default.pa. What
    is played to ``vsink`` with paplay is what the ALSA ``pulse`` device records.
    """
    missing = [tool for tool in ("pulseaudio", "pactl", "paplay") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (apt-get install pulseaudio pulseaudio-utils)")
    if ctypes.util.find_library("portaudio") is None:
        pytest.skip("needs PortAudio (apt-get install libportaudio2)")
    pytest.importorskip("sounddevice", reason="needs python-sounddevice (pip install sounddevice)")
    directory = tempfile.mkdtemp(prefix="cosy-pa-")  # short: a unix socket path has ~100 bytes
    env = {
        **os.environ,
        "HOME": directory,
        "XDG_RUNTIME_DIR": directory,
        "PULSE_SERVER": f"unix:{directory}/native",
    }
    daemon = [
        "pulseaudio",
        "--daemonize=yes",
        "--exit-idle-time=-1",
        "-n",
        f"--log-target=file:{directory}/pulse.log",
        f"--load=module-native-protocol-unix auth-anonymous=1 socket={directory}/native",
        "--load=module-null-sink sink_name=vsink rate=16000 channels=1",
        "--load=module-always-sink",
    ]
    try:
        subprocess.run(daemon, env=env, check=True, capture_output=True, timeout=30)
        deadline = time.monotonic() + 10
        while subprocess.run(["pactl", "info"], env=env, capture_output=True).returncode != 0:
            assert time.monotonic() < deadline, Path(directory, "pulse.log").read_text()
            time.sleep(0.1)
        subprocess.run(["pactl", "set-default-source", "vsink.monitor"], env=env, check=True, timeout=10)
        listing = run_client("--list-devices", env=env)
        if not re.search(r"^\s*\d+ pulse,", listing.stdout, re.M):
            pytest.skip("ALSA has no 'pulse' device (apt-get install libasound2-plugins)")
        yield env
    finally:
        subprocess.run(["pulseaudio", "--kill"], env=env, capture_output=True, timeout=10)
        pid_file, deadline = Path(directory, "pulse", "pid"), time.monotonic() + 10
        while pid_file.exists() and time.monotonic() < deadline:  # it removes its pid file last
            time.sleep(0.05)
        shutil.rmtree(directory, ignore_errors=True)


@needs_espeak
def test_microphone_through_pulseaudio(server, pulse, two_utterances, tmp_path):
    audio, spans = two_utterances
    wav = write_wav(tmp_path / "speech.wav", audio)
    vtt = tmp_path / "out.vtt"
    process, _ = start_client("--server", server.address, "--device", "pulse", "--vtt", str(vtt), env=pulse)
    subprocess.run(["paplay", "--device=vsink", str(wav)], env=pulse, check=True, timeout=30)
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    cues = parse_subtitles(vtt.read_text(), "vtt")
    assert len(cues) == 2, (cues, stderr)
    assert len(plain_finals(stdout)) == 2
    # Playback began just after the client's first block: the spans are shifted by that start-up delay
    # (paplay's and PulseAudio's latency), but their spacing is the audio's.
    delay_ms = cues[0][0] - spans[0][0]
    assert -300 <= delay_ms <= 2000, (cues, spans)
    assert abs((cues[1][0] - cues[0][0]) - (spans[1][0] - spans[0][0])) <= 400, (cues, spans)
    assert cues[0][1] < cues[1][0]
    assert cues[0][1] - cues[0][0] >= (spans[0][1] - spans[0][0]) - 400


@needs_espeak
def test_phrases_file_boosts_a_name(server, tmp_path):
    """``--phrases FILE``: the name the model misses without it is in the captions with it."""
    named = "the meeting with siobhan nguyen is at noon"
    wav = write_wav(tmp_path / "named.wav", np.concatenate([silence(0.3), speech(named), silence(1.0)]))
    phrases = tmp_path / "phrases.txt"
    phrases.write_text("# people\nSiobhan Nguyen\t8\n\n")
    runs = {}
    for name, extra in (("plain", []), ("boosted", ["--phrases", str(phrases)])):
        vtt = tmp_path / f"{name}.vtt"
        run = run_client("--server", server.address, "--file", str(wav), "--vtt", str(vtt), *extra)
        assert run.returncode == 0, run.stderr
        runs[name] = " ".join(text for _, _, text in parse_subtitles(vtt.read_text(), "vtt"))
    assert "siobhan nguyen" not in runs["plain"]
    assert runs["boosted"] == named


def test_a_phrases_file_that_cannot_be_read_is_one_line(tmp_path):
    bad = tmp_path / "phrases.txt"
    bad.write_text("Siobhan Nguyen\tloud\n")
    run = run_client("--file", str(bad), "--phrases", str(bad))
    assert run.returncode != 0
    assert "phrases.txt:1: the boost after the tab must be a number, got 'loud'" in run.stderr
    assert run.stderr.count("\n") == 1, run.stderr
