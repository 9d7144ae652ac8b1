"""Accuracy against pocketsphinx on the same audio: WER, CER and real-time factor per test set.

Test sets are directories of NAME.wav + NAME.txt or JSONL manifests (see ``cosystream eval``).
``--real`` adds the human recordings that ship in pocketsphinx's source distribution (LibriVox read
speech, a card-game command set, "go forward ten meters"), fetched with pip into ``--cache``.
pocketsphinx (its PyPI wheel bundles an English model) is a benchmark-only dependency:
``pip install pocketsphinx``.

    python benchmarks/accuracy.py --real data/corpus/eval/heldout --telephone
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import wave
from pathlib import Path

import numpy as np

from cosystream.evaluate import edit_distance, evaluate, load_set, normalize, telephone
from cosystream.server.decoding import DecoderConfig

POCKETSPHINX_SDIST = "pocketsphinx==5.1.1"


def fetch_real_recordings(cache: Path) -> Path:
    """pocketsphinx's test recordings with transcripts, as a directory of NAME.wav + NAME.txt."""
    target = cache / "pocketsphinx-recordings"
    if (target / "DONE").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--no-build-isolation",
                POCKETSPHINX_SDIST,
                "-d",
                tmp,
            ],
            check=True,
            capture_output=True,
        )
        with tarfile.open(next(Path(tmp).glob("pocketsphinx-*.tar.gz"))) as sdist:
            sdist.extractall(tmp, filter="data")
        data = next(Path(tmp).glob("pocketsphinx-*/test/data"))
        for wav in sorted((data / "librivox").glob("*.wav")):
            (target / wav.name).write_bytes(wav.read_bytes())
            (target / wav.with_suffix(".txt").name).write_text((wav.with_suffix(".txt")).read_text())
        # cards: "<transcript> (<id>)" lines in the order of cards.fileids
        ids = (data / "cards" / "cards.fileids").read_text().split()
        lines = (data / "cards" / "cards.transcription").read_text().splitlines()
        for file_id, line in zip(ids, lines, strict=False):
            name = Path(file_id).name
            (target / f"cards-{name}.wav").write_bytes((data / "cards" / f"{name}.wav").read_bytes())
            text = re.sub(r"\s*\(.*\)\s*$", "", line)
            (target / f"cards-{name}.txt").write_text(re.sub(r"</?s>|<sil>", "", text).strip())
        raw = np.frombuffer((data / "goforward.raw").read_bytes(), "<i2")
        with wave.open(str(target / "goforward.wav"), "wb") as out:
            out.setnchannels(1)
            out.setsampwidth(2)
            out.setframerate(16000)
            out.writeframes(raw.tobytes())
        (target / "goforward.txt").write_text("go forward ten meters")
    (target / "DONE").write_text("")
    return target


def pocketsphinx_scores(test_set: Path, telephone_band: bool) -> dict:
    from pocketsphinx import Decoder

    decoder = Decoder(samprate=16000, loglevel="FATAL")
    word_errors = words = char_errors = chars = 0
    audio_s = compute_s = 0.0
    for utterance in load_set(test_set):
        audio = telephone(utterance.audio) if telephone_band else utterance.audio
        pcm = (np.clip(audio, -1, 1 - 1 / 32768) * 32768).astype("<i2").tobytes()
        started = time.perf_counter()
        decoder.start_utt()
        decoder.process_raw(pcm, full_utt=True)
        decoder.end_utt()
        hypothesis = normalize(decoder.hyp().hypstr if decoder.hyp() else "")
        compute_s += time.perf_counter() - started
        audio_s += len(audio) / 16000
        reference = normalize(utterance.reference)
        word_errors += edit_distance(reference.split(), hypothesis.split())
        words += len(reference.split())
        char_errors += edit_distance(list(reference), list(hypothesis))
        chars += len(reference)
    return {
        "wer": word_errors / max(1, words),
        "cer": char_errors / max(1, chars),
        "real_time_factor": compute_s / audio_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sets", nargs="*", help="test sets (directories or manifests)")
    parser.add_argument("--real", action="store_true", help="add pocketsphinx's human recordings")
    parser.add_argument("--telephone", action="store_true", help="also score 8 kHz mu-law versions")
    parser.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    parser.add_argument("--cache", default=".cache/accuracy", help="where fetched recordings are kept")
    parser.add_argument("--json", default=None)
    parser.add_argument("--decoders", default="greedy,beam", help="cosystream decoders to score, side by side")
    args = parser.parse_args(argv)
    sets = [Path(s) for s in args.sets]
    if args.real:
        sets.append(fetch_real_recordings(Path(args.cache)))
    if not sets:
        parser.error("give test sets and/or --real")
    decoders = [DecoderConfig(kind) for kind in args.decoders.split(",")]
    rows = []
    keys = ("wer", "cer", "real_time_factor", "decode_us_per_frame")
    for test_set in sets:
        for band in [False, True] if args.telephone else [False]:
            ours = {d.kind: evaluate(args.model, test_set, band, d) for d in decoders}
            theirs = pocketsphinx_scores(test_set, band)
            first = next(iter(ours.values()))
            rows.append(
                {
                    "set": test_set.name,
                    "band": "8k-mulaw" if band else "16k",
                    "utterances": first["utterances"],
                    "audio_seconds": first["audio_seconds"],
                    "cosystream": {kind: {k: r[k] for k in keys} for kind, r in ours.items()},
                    "pocketsphinx": theirs,
                }
            )
    print(json.dumps(rows, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    print(
        f"\n{'set':<28} {'band':<9} {'utts':>5} {'decoder':<12} {'WER':>7} {'CER':>6} {'RTF':>6} {'us/frame':>9}"
    )
    for row in rows:
        lines = [(f"cosy {kind}", r) for kind, r in row["cosystream"].items()]
        lines.append(("pocketsphinx", row["pocketsphinx"]))
        for name, r in lines:
            per_frame = f"{r['decode_us_per_frame']:>9.0f}" if "decode_us_per_frame" in r else f"{'-':>9}"
            print(
                f"{row['set']:<28} {row['band']:<9} {row['utterances']:>5} {name:<12} {r['wer'] * 100:>6.1f}%"
                f" {r['cer'] * 100:>5.1f}% {r['real_time_factor']:>6.3f} {per_frame}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
