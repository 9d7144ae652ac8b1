"""Accuracy against pocketsphinx on the same audio: WER, CER and real-time factor per test set.

Test sets are directories of NAME.wav + NAME.txt or JSONL manifests (see ``cosystream eval``).
``--real`` adds the human recordings that ship in pocketsphinx's source distribution (LibriVox read
speech, a card-game command set, "go forward ten meters"), fetched with pip into ``--cache``.
pocketsphinx (its PyPI wheel bundles an English model) is a benchmark-only dependency:
``pip install pocketsphinx``.

``--prompts`` adds the Asterisk PBX voice prompts (one professional voice actor, Allison Smith, reading IVR
phrases such as "please enter your password followed by the pound key"), fetched with ``apt-get download``
from Debian (bookworm: version 1.6.1-1) and cached as two sets of the same recordings:

* ``asterisk-prompts-16k``: ``asterisk-core-sounds-en-g722`` (G.722, 16 kHz wideband), decoded with PyAV
  (``av``, its PyPI wheel bundles FFmpeg; installed with pip into ``--cache`` when it is not importable);
  skipped, with a warning, if that fails.
* ``asterisk-prompts-8k``: ``asterisk-core-sounds-en-wav`` (8 kHz 16-bit PCM) as they are. The evaluation
  resamples them to 16 kHz; ``--telephone`` does not score sets recorded at 8 kHz again (their band is
  already a phone's), so they appear once, as band ``8k``.

Transcripts come from ``core-sounds-en.txt`` in ``asterisk-core-sounds-en``, normalized with the training
text normalizer (numbers spelled out). Kept: prompts of at least 3 words; dropped: digits, letters, sound
effects, bracketed notes, symbols (``*``, ``#``) and acronyms spoken letter by letter. ``--prompts-limit``
(default 300) caps the count with a seeded, deterministic draw. Licence: the recordings are CC-BY-SA-3.0,
copyright 2003-2010 Allison Smith (recorded by Allison Smith, financial contributions by Digium, Inc.);
see ``/usr/share/doc/asterisk-core-sounds-en/copyright`` in the package, copied into each set as
``COPYRIGHT``.

``--final-model SPEC`` (a second-pass Whisper model, as ``serve --final-model`` takes, e.g.
``embedded:whisper-tiny-en``) scores each cosystream decoder with the second pass as well: a row
``cosy DECODER+whisper`` beside the decoder's own (whose scores are the same run's first pass), its RTF the
streaming model's plus Whisper's, and the share of finals that came from Whisper (the rest were gated).

    python -m training.eval_set --out data/heldout    # the held-out synthetic voices as a test set
    python -m benchmarks.accuracy --real --prompts data/heldout --telephone
    python -m benchmarks.accuracy --real --prompts --telephone --decoders beam --final-model embedded:whisper-tiny-en
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import wave
from pathlib import Path

import numpy as np

from cosystream.app.evaluate import edit_distance, evaluate, load_set, normalize, set_files, telephone
from cosystream.app.transcribe import write_wav
from cosystream.decoding.config import DecoderConfig
from cosystream.v1.client import HelpFormatter

POCKETSPHINX_SDIST = "pocketsphinx==5.1.1"
PYAV_WHEEL = "av==18.1.0"
PROMPT_PACKAGES = ("asterisk-core-sounds-en", "asterisk-core-sounds-en-wav", "asterisk-core-sounds-en-g722")
PROMPT_SEED = 0
# Notes, sound effects, keypad symbols, acronyms ("PBX", "IAX") and things like "3D" don't read as words.
_PROMPT_BAD = re.compile(r"[()\[\]*#]|\b[A-Z]{2,}|\d[A-Za-z]")


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
                "pocketsphinx",  # the sdist; its build backend comes into pip's isolated environment
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
        write_wav(target / "goforward.wav", np.frombuffer((data / "goforward.raw").read_bytes(), "<i2"), 16000)
        (target / "goforward.txt").write_text("go forward ten meters")
    (target / "DONE").write_text("")
    return target


def prompt_reference(text: str) -> str | None:
    """A prompt's transcript in the model's alphabet, or None if it does not read cleanly as words."""
    from training.text import normalize as normalize_text  # the repository's, not installed: run with -m

    if _PROMPT_BAD.search(text):
        return None
    whole = normalize_text(text)
    if whole is not None or len(text.split()) <= 26:
        return whole
    # The training normalizer takes sentences of 3-26 words: normalize a long prompt in runs of clauses.
    chunks: list[list[str]] = [[]]
    for clause in re.split(r"(?<=[.,;:!?])\s+", text.strip()):
        if chunks[-1] and len(" ".join([*chunks[-1], clause]).split()) > 26:
            chunks.append([])
        chunks[-1].append(clause)
    if len(chunks) > 1 and len(" ".join(chunks[-1]).split()) < 3:
        chunks[-2] += chunks.pop()
    parts = [normalize_text(" ".join(chunk)) for chunk in chunks]
    return " ".join(part for part in parts if part) if all(parts) else None


def import_pyav(cache: Path):
    """PyAV, pip-installed into ``cache`` when it is not importable (its wheel bundles FFmpeg)."""
    try:
        import av
    except ImportError:
        target = cache / "pyav"
        if not (target / "av").exists():
            pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary", ":all:"]
            subprocess.run([*pip, "--target", str(target), PYAV_WHEEL], check=True, capture_output=True)
        sys.path.insert(0, str(target))
        import av
    return av


def decode_g722(av, data: bytes) -> np.ndarray:
    """G.722 bytes -> 16 kHz int16 samples."""
    with av.open(io.BytesIO(data), format="g722") as container:
        frames = [frame.to_ndarray().reshape(-1) for frame in container.decode(audio=0)]
    return np.concatenate(frames).astype("<i2")


def fetch_prompts(cache: Path, limit: int) -> list[Path]:
    """The Asterisk English prompts as test sets: ``asterisk-prompts-16k`` (from G.722) and ``-8k``."""
    narrow, wide = cache / "asterisk-prompts-8k", cache / "asterisk-prompts-16k"
    stamp = f"limit={limit} seed={PROMPT_SEED}\n"
    if (narrow / "DONE").exists() and (narrow / "DONE").read_text() == stamp:
        return [s for s in (wide, narrow) if (s / "DONE").exists() and (s / "DONE").read_text() == stamp]
    for directory in (narrow, wide):
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run(["apt-get", "download", *PROMPT_PACKAGES], cwd=tmp, check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as err:
            raise SystemExit(
                f"--prompts needs Debian's apt-get download of {', '.join(PROMPT_PACKAGES)}: {err}"
            ) from None
        root = Path(tmp) / "root"
        for deb in sorted(Path(tmp).glob("*.deb")):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        doc = root / "usr/share/doc/asterisk-core-sounds-en"
        sounds = root / "usr/share/asterisk/sounds/en_US_f_Allison"
        prompts = {}
        for line in gzip.decompress((doc / "core-sounds-en.txt.gz").read_bytes()).decode().splitlines():
            name, colon, text = line.partition(":")
            reference = prompt_reference(text) if colon and not line.startswith(";") else None
            if reference and (sounds / f"{name.strip()}.wav").exists():
                prompts[name.strip()] = reference
        chosen = sorted(prompts)
        if len(chosen) > limit:
            chosen = sorted(random.Random(PROMPT_SEED).sample(chosen, limit))
        sets = [wide, narrow]
        try:
            av = import_pyav(cache)
        except (subprocess.CalledProcessError, ImportError, OSError) as err:
            print(f"asterisk-prompts-16k skipped: no G.722 decoder ({err})", file=sys.stderr)
            av, sets = None, [narrow]
            shutil.rmtree(wide)
        for name in chosen:
            stem = name.replace("/", "-")
            (narrow / f"{stem}.wav").write_bytes((sounds / f"{name}.wav").read_bytes())
            if av:
                write_wav(wide / f"{stem}.wav", decode_g722(av, (sounds / f"{name}.g722").read_bytes()), 16000)
            for directory in sets:
                (directory / f"{stem}.txt").write_text(prompts[name])
        for directory in sets:
            shutil.copy(doc / "copyright", directory / "COPYRIGHT")
            (directory / "DONE").write_text(stamp)
    return sets


def native_rate(test_set: Path) -> int:
    """The sample rate of a test set's first recording."""
    first, _ = set_files(test_set)[0]
    with wave.open(str(first), "rb") as wav:
        return wav.getframerate()


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("sets", nargs="*", help="test sets (directories or manifests)")
    parser.add_argument("--real", action="store_true", help="add pocketsphinx's human recordings")
    parser.add_argument("--prompts", action="store_true", help="add the Asterisk voice prompts (16 and 8 kHz)")
    parser.add_argument("--prompts-limit", type=int, default=300, help="at most this many prompts (seeded draw)")
    parser.add_argument("--telephone", action="store_true", help="also score 8 kHz mu-law versions")
    parser.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    parser.add_argument("--cache", default=".cache/accuracy", help="where fetched recordings are kept")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--decoders",
        default="greedy,beam",
        help="cosystream decoders to score, side by side: greedy, beam (the compiled search when flashlight-text "
        "is installed), beam:python, beam:flashlight",
    )
    parser.add_argument(
        "--final-model",
        default=None,
        metavar="SPEC",
        help="also score each decoder with this second-pass Whisper model (a CTranslate2 directory or "
        "embedded:whisper-tiny-en), as an extra DECODER+whisper row",
    )
    args = parser.parse_args(argv)
    sets = [Path(s) for s in args.sets]
    if args.real:
        sets.append(fetch_real_recordings(Path(args.cache)))
    if args.prompts:
        sets += fetch_prompts(Path(args.cache), args.prompts_limit)
    if not sets:
        parser.error("give test sets, --real and/or --prompts")
    decoders = {}
    for name in args.decoders.split(","):
        kind, _, search = name.partition(":")
        try:
            decoders[name] = DecoderConfig(kind, search=search or "auto").resolve(args.model)
        except ValueError as err:  # e.g. greedy decoding of a phoneme model
            print(f"not scoring the {name} decoder: {err}", file=sys.stderr)
    if not decoders:
        parser.error("none of --decoders can decode this model")
    rows = []
    keys = ("wer", "cer", "real_time_factor", "decode_us_per_frame")
    second_pass_keys = ("final_model", "second_pass_share", "second_pass_rtf", "second_pass_gated")
    for test_set in sets:
        wideband = native_rate(test_set) > 8000
        for band in [False, True] if args.telephone and wideband else [False]:
            ours = {}
            for name, d in decoders.items():
                result = evaluate(args.model, test_set, band, d, final_model=args.final_model)
                ours[name] = {k: result[k] for k in keys}
                if args.final_model:
                    # One run scores both: the streaming model alone (its first pass) and with the second pass.
                    ours[name] |= {"wer": result["first_pass_wer"], "cer": result["first_pass_cer"]}
                    ours[f"{name}+whisper"] = {k: result[k] for k in (*keys, *second_pass_keys)}
                    ours[f"{name}+whisper"]["real_time_factor"] += result["second_pass_rtf"]
            theirs = pocketsphinx_scores(test_set, band)
            rows.append(
                {
                    "set": test_set.name,
                    "band": "8k-mulaw" if band else "16k" if wideband else "8k",
                    "utterances": result["utterances"],
                    "audio_seconds": result["audio_seconds"],
                    "words": sum(len(e["reference"].split()) for e in result["examples"]),
                    "cosystream": ours,
                    "pocketsphinx": theirs,
                }
            )
    print(json.dumps(rows, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    print(
        f"\n{'set':<28} {'band':<9} {'utts':>5} {'decoder':<21} {'WER':>7} {'CER':>6} {'RTF':>6} {'us/frame':>9}"
        + (f" {'2nd pass':>8}" if args.final_model else "")
    )
    for row in rows:
        lines = [(f"cosy {kind}", r) for kind, r in row["cosystream"].items()]
        lines.append(("pocketsphinx", row["pocketsphinx"]))
        for name, r in lines:
            per_frame = f"{r['decode_us_per_frame']:>9.0f}" if "decode_us_per_frame" in r else f"{'-':>9}"
            share = f" {r['second_pass_share'] * 100:>7.0f}%" if "second_pass_share" in r else ""
            print(
                f"{row['set']:<28} {row['band']:<9} {row['utterances']:>5} {name:<21} {r['wer'] * 100:>6.1f}%"
                f" {r['cer'] * 100:>5.1f}% {r['real_time_factor']:>6.3f} {per_frame}{share}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
