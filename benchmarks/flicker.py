"""Interim flicker: how many words a caption shows and then changes, raw interims against the clients'
stability-based display (``StableInterim`` in clients/caption.py; captions.js applies the same rule).

Streams espeak-ng sentences at real time through ``cosystream serve`` (gRPC, interim results, the server's
default decoder), records each interim with its arrival time, then replays the record through the display
rule for each ``--hold-ms`` (0 is the raw interims). For each display: the words previously shown that an
update changed or removed, per interim (the final's own changes to the shown line included), the share of
interims that changed a shown word, and the display delay each word pays: from when the raw interims first
showed it for good (the word and the words before it as in the final, unchanged until then) to when the
display did. Prints JSON and a table.

    python -m benchmarks.flicker --hold-ms 0 200 300 400 600 800 --json flicker.json --record interims.json
    python -m benchmarks.flicker --replay interims.json --hold-ms 0 400    # the same interims, no server
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
import wave
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import soxr

from benchmarks._harness import Server, dump
from clients.caption import StableInterim
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc

SENTENCES = (
    "the quick brown fox jumps over the lazy dog",
    "please call me back tomorrow morning before nine",
    "the weather forecast says it will rain all weekend",
    "she sells sea shells by the sea shore",
    "we need to buy milk bread and some fresh eggs",
    "turn left at the next light and park near the station",
    "the meeting has been moved to thursday afternoon",
    "can you read the last line of the report again",
    "our flight leaves at seven so we should be there by five",
    "he quickly put the laser printer back in the box",
    "the children played in the park until it got dark",
    "send me the numbers when you have a minute",
)
CHUNK_MS = 20
RATE_HZ = 16000


@dataclass(frozen=True, slots=True)
class Interim:
    at_ms: float  # arrival, on this process's clock
    text: str
    stability: float


@dataclass(frozen=True, slots=True)
class Utterance:
    interims: tuple[Interim, ...]
    final: str
    final_ms: float


def espeak(text: str) -> bytes:
    """``text`` spoken by espeak-ng, 16 kHz 16-bit mono PCM, with 0.5 s of silence either side."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.wav"
        subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True)
        with wave.open(str(path)) as wav:
            rate, pcm = wav.getframerate(), np.frombuffer(wav.readframes(wav.getnframes()), "<i2")
    audio = soxr.resample(pcm.astype(np.float32) / 32768, rate, RATE_HZ)
    pad = np.zeros(RATE_HZ // 2, np.float32)
    return (np.clip(np.concatenate([pad, audio, pad]), -1, 1 - 1 / 32768) * 32768).astype("<i2").tobytes()


def stream(stub, pcm: bytes) -> list[Utterance]:
    """One REALTIME stream of ``pcm`` paced at real time: its utterances' interims and finals."""
    step = RATE_HZ * 2 * CHUNK_MS // 1000

    def requests():
        yield pb.StreamingRecognizeRequest(
            config=pb.StreamingConfig(
                encoding=pb.LINEAR16, sample_rate_hz=RATE_HZ, priority=pb.REALTIME, interim_results=True
            )
        )
        start = time.monotonic()
        for i, offset in enumerate(range(0, len(pcm), step)):
            time.sleep(max(0.0, start + i * CHUNK_MS / 1000 - time.monotonic()))
            yield pb.StreamingRecognizeRequest(audio=pcm[offset : offset + step])

    utterances, interims = [], []
    for response in stub.StreamingRecognize(requests(), timeout=120):
        now_ms = time.monotonic() * 1000
        for result in response.results:
            if result.is_final:
                utterances.append(Utterance(tuple(interims), result.transcript, now_ms))
                interims = []
            else:
                interims.append(Interim(now_ms, result.transcript, result.stability))
    return utterances


def common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def timeline(utterance: Utterance, hold_ms: float) -> list[tuple[float, list[str]]]:
    """What the display shows, as (time, words) at each change, the final last."""
    rule = StableInterim(hold_ms)
    shown: list[tuple[float, list[str]]] = [(utterance.interims[0].at_ms if utterance.interims else 0.0, [])]

    def show(now_ms: float) -> None:
        words = rule.shown(now_ms).split()
        if words != shown[-1][1]:
            shown.append((now_ms, words))

    for i, interim in enumerate(utterance.interims):
        rule.update(interim.text, interim.at_ms, interim.stability)
        show(interim.at_ms)
        until_ms = utterance.interims[i + 1].at_ms if i + 1 < len(utterance.interims) else utterance.final_ms
        now_ms = interim.at_ms
        while (due_ms := rule.next_reveal_ms(now_ms)) is not None and due_ms < until_ms:
            show(due_ms)  # a held word comes due before the next interim
            now_ms = due_ms
    shown.append((utterance.final_ms, utterance.final.split()))
    return shown


def measure(utterances: list[Utterance], hold_ms: float) -> dict:
    changed, changed_at_final, changing, interims, added = 0, 0, 0, 0, []
    raw_delays, delays = [], []
    for utterance in utterances:
        interims += len(utterance.interims)
        shown = timeline(utterance, hold_ms)
        for (_, before), (_, after) in itertools.pairwise(shown):
            lost = len(before) - common_prefix(before, after)
            changed += lost
            changing += lost > 0
        final_words = utterance.final.split()
        changed_at_final += len(shown[-2][1]) - common_prefix(shown[-2][1], final_words)
        for display, out in ((timeline(utterance, 0), raw_delays), (shown, delays)):
            out.append(first_for_good(display, final_words))
    for raw, held in zip(raw_delays, delays, strict=True):
        added.extend(h - r for r, h in zip(raw, held, strict=True))
    interims = max(interims, 1)
    return {
        "hold_ms": hold_ms,
        "interims": interims,
        "changed_words_per_interim": round(changed / interims, 4),
        "changed_words_at_final_per_utterance": round(changed_at_final / max(len(utterances), 1), 3),
        "changing_interims_pct": round(100 * changing / interims, 2),
        "added_delay_ms_mean": round(statistics.fmean(added), 1) if added else 0.0,
        "added_delay_ms_p90": round(float(np.percentile(added, 90)), 1) if added else 0.0,
    }


def first_for_good(shown: list[tuple[float, list[str]]], final_words: list[str]) -> list[float]:
    """Per word of the final: when the display started showing it (and the words before it) as the final
    has them, with no change after that until the final."""
    times = []
    for i in range(len(final_words)):
        since = shown[-1][0]
        for at_ms, words in reversed(shown):
            if common_prefix(words, final_words) > i:
                since = at_ms
            else:
                break
        times.append(since)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hold-ms", type=float, nargs="+", default=[0, 200, 300, 400, 600, 800])
    parser.add_argument("--rounds", type=int, default=1, help="times each sentence is streamed")
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--serve-arg", action="append", default=[], help="passed to cosystream serve")
    parser.add_argument("--record", help="write the interims received here (for --replay)")
    parser.add_argument("--replay", help="measure the interims of an earlier --record instead of streaming")
    args = parser.parse_args(argv)
    if args.replay:
        utterances = [
            Utterance(tuple(Interim(*i) for i in u["interims"]), u["final"], u["final_ms"])
            for u in json.loads(Path(args.replay).read_text())
        ]
    else:
        audio = [espeak(sentence) for sentence in SENTENCES]
        utterances = []
        with Server(*args.serve_arg) as server, grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.CosyStreamStub(channel)
            for _ in range(args.rounds):
                for pcm in audio:
                    utterances.extend(stream(stub, pcm))
    if args.record:
        record = [
            {
                "interims": [[i.at_ms, i.text, i.stability] for i in u.interims],
                "final": u.final,
                "final_ms": u.final_ms,
            }
            for u in utterances
        ]
        Path(args.record).write_text(json.dumps(record))
    results = [measure(utterances, hold_ms) for hold_ms in args.hold_ms]
    result = {
        "sentences": len(SENTENCES),
        "rounds": args.rounds,
        "utterances": len(utterances),
        "displays": results,
    }
    dump(result, args.json)
    columns = (
        "hold_ms",
        "changed_words_per_interim",
        "changing_interims_pct",
        "changed_words_at_final_per_utterance",
        "added_delay_ms_mean",
        "added_delay_ms_p90",
    )
    print(" | ".join(columns), file=sys.stderr)
    for row in results:
        print(" | ".join(f"{row[c]:g}" for c in columns), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
