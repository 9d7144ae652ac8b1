"""The second pass's cost: utterances read per second and the time of one call, by batch size and device.

Each round reads ``batch`` utterances (the WAVs given, or espeak-ng sentences, cycled) in one call of
``WhisperTranscriber.transcribe_batch``, as the worker does when that many utterances of one length bucket
end together, against the same utterances read one call each. Prints JSON and a table.

    python -m benchmarks.second_pass --batches 1 2 4 8 --device cpu
    python -m benchmarks.second_pass --device cuda --batches 1 8 32 64 --wav .gpu/wav/*.wav
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from cosystream.app.evaluate import load_set
from cosystream.secondpass.whisper import EMBEDDED_WHISPER, WhisperTranscriber
from cosystream.v1.client import HelpFormatter

SENTENCES = (
    "please call me back at five o'clock tomorrow",
    "the meeting moves to the large room upstairs",
    "your order has shipped and will arrive on monday",
    "press one to speak with an agent",
)


def espeak_set(directory: Path) -> Path:
    for i, text in enumerate(SENTENCES):
        subprocess.run(["espeak-ng", "-w", str(directory / f"s{i}.wav"), text], check=True)
        (directory / f"s{i}.txt").write_text(text)
    return directory


def wav_set(paths: list[str], directory: Path) -> Path:
    for i, path in enumerate(paths):
        (directory / f"w{i}.wav").write_bytes(Path(path).read_bytes())
        (directory / f"w{i}.txt").write_text("")
    return directory


def measure(transcriber: WhisperTranscriber, audios: list[np.ndarray], batch: int, rounds: int) -> dict:
    group = [audios[i % len(audios)] for i in range(batch)]
    transcriber.transcribe_batch(group)  # (warm)
    batched, single = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        transcriber.transcribe_batch(group)
        batched.append(time.perf_counter() - started)
        started = time.perf_counter()
        for audio in group:
            transcriber.transcribe(audio)
        single.append(time.perf_counter() - started)
    audio_s = sum(len(a) for a in group) / 16000
    call_s, one_by_one_s = statistics.median(batched), statistics.median(single)
    return {
        "batch": batch,
        "audio_s": audio_s,
        "call_ms": call_s * 1e3,
        "one_by_one_ms": one_by_one_s * 1e3,
        "utterances_per_s": batch / call_s,
        "speedup": one_by_one_s / call_s,
        "real_time_factor": call_s / audio_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--model", default=EMBEDDED_WHISPER, help="the second pass's model")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"), help="where it runs")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8], help="utterances per call")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per batch size (the median is kept)")
    parser.add_argument("--wav", nargs="*", default=[], help="WAV files to read (default: espeak-ng sentences)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    transcriber = WhisperTranscriber(args.model, args.threads, args.device)
    with tempfile.TemporaryDirectory() as tmp:
        test_set = wav_set(args.wav, Path(tmp)) if args.wav else espeak_set(Path(tmp))
        audios = [u.audio for u in load_set(test_set)]
    rows = [measure(transcriber, audios, batch, args.rounds) for batch in args.batches]
    result = {"model": args.model, "device": transcriber.device, "threads": args.threads, "rows": rows}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\nsecond pass on {transcriber.device} ({args.threads} thread(s)): {args.model}")
    print(f"{'batch':>5} {'audio s':>8} {'call ms':>9} {'1-by-1 ms':>10} {'utt/s':>7} {'speedup':>8} {'RTF':>6}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['audio_s']:>8.1f} {r['call_ms']:>9.0f} {r['one_by_one_ms']:>10.0f}"
            f" {r['utterances_per_s']:>7.1f} {r['speedup']:>8.2f} {r['real_time_factor']:>6.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
