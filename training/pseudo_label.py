"""Real recordings -> training shards, labelled by the second-pass model (pseudo-labels for distillation).

    PYTHONPATH=. nice -n 10 .venv/bin/python -m training.pseudo_label --out data/corpus --audio recordings/

The streaming model is trained on synthetic voices (``training/corpus.py``); the second pass (Whisper,
``cosystream/secondpass``) reads real speech far better. This turns any real audio a user holds (calls,
meetings, dictation: WAV, FLAC, OGG or MP3, any rate the server's uploads take) into shards the trainer
reads beside the synthetic ones, with Whisper's text as the label:

1. each file is decoded and resampled to 16 kHz, and cut into utterances as the server cuts a stream
   (webrtcvad and the endpointer, ``cosystream/audio``: the same pre-roll and trailing silence the model
   sees when serving);
2. the utterances are read by the second-pass model in batches of similar length
   (``WhisperTranscriber.transcribe_batch``: text in the streaming models' alphabet, digits spelled out);
3. an utterance is kept only when Whisper was sure of it: not gated (no speech, a loop, empty, an average
   token log-probability under -1) and an average log-probability of at least ``--min-logprob`` (stricter than
   serving's gate: a wrong label costs more in training than a final the streaming model would have given);
4. kept utterances go to ``<out>/train/shard_pl_NNNNN.npz`` (the synthetic shards' format, numbered after any
   already there), their ``voice`` the file they came from; nothing is written to ``<out>/eval``. With
   ``--held-out GROUP`` they go to ``<out>/eval/GROUP.npz`` instead: a held-out group of real speech that
   training reports beside the synthetic ones, and ``training.eval_set --groups GROUP`` makes a
   ``cosystream eval`` test set of (keep its recordings out of the training shards).

It prints, and with ``--json`` writes, what it read and kept: files, hours, utterances, why the others were
dropped, and how fast the second pass read (its real-time factor).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import soxr

from cosystream.app.transcribe import read_audio
from cosystream.audio.endpointing import Endpointer, EndpointingConfig
from cosystream.audio.files import UndecodableAudio
from cosystream.audio.vad import Vad
from cosystream.frames import FRAME_SAMPLES, SAMPLE_RATE_HZ
from cosystream.secondpass.whisper import EMBEDDED_WHISPER, WhisperTranscriber  # (faster-whisper: on load)
from training.corpus import save_shard

log = logging.getLogger(__name__)

AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3")
MIN_LOGPROB = -0.5
"""Whisper's average token log-probability under which an utterance is not used for training."""
MIN_UTTERANCE_S = 0.5  # shorter: a cough or a word cut off; not worth a label
MAX_UTTERANCE_S = 20.0  # the endpointer cuts longer speech here (the trainer's longest utterances)
SHARD_SIZE = 400  # utterances per shard, as the synthetic corpus
BATCH = 8  # utterances per second-pass call
ENDPOINTING = EndpointingConfig(silence_ms=500, max_utterance_ms=int(MAX_UTTERANCE_S * 1000))


@dataclass
class Summary:
    files: int = 0
    unreadable: list[str] = field(default_factory=list)
    audio_s: float = 0.0
    utterances: int = 0
    kept: int = 0
    kept_s: float = 0.0
    dropped: dict[str, int] = field(default_factory=dict)  # why: gated reasons, "low_confidence", "short"
    read_s: float = 0.0  # the second pass's compute
    shards: list[str] = field(default_factory=list)

    def drop(self, why: str) -> None:
        self.dropped[why] = self.dropped.get(why, 0) + 1


def audio_files(paths: list[Path]) -> list[Path]:
    """The files named, and the audio files under the directories named, in a stable order."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in AUDIO_SUFFIXES)
        else:
            found.append(path)
    return found


def utterances(pcm: np.ndarray, config: EndpointingConfig = ENDPOINTING) -> list[np.ndarray]:
    """``pcm`` (int16, 16 kHz) cut into utterances as a served stream is: each the frames the endpointer
    forwards for it (pre-roll, speech, trailing silence), so what is trained on is what is served."""
    vad, endpointer = Vad(config.vad_aggressiveness, int16_levels=True), Endpointer(config)
    frames = len(pcm) // FRAME_SAMPLES
    levels = pcm[: frames * FRAME_SAMPLES].astype(np.float32) / 32768
    found, first = [], -1
    for index in range(frames):
        decision = endpointer.feed(vad.is_speech(levels[index * FRAME_SAMPLES : (index + 1) * FRAME_SAMPLES]))
        if decision.started:
            first = decision.first_forward_frame
        if decision.ended:
            found.append(pcm[first * FRAME_SAMPLES : (decision.frame_index + 1) * FRAME_SAMPLES])
    if endpointer.finalize().ended:
        found.append(pcm[first * FRAME_SAMPLES : frames * FRAME_SAMPLES])
    return found


def read_16k(path: Path) -> np.ndarray:
    """A file's audio, mono int16 at 16 kHz; raises :class:`UndecodableAudio` saying what is wrong."""
    pcm, rate = read_audio(str(path))
    if rate == SAMPLE_RATE_HZ:
        return pcm
    resampled = soxr.resample(pcm.astype(np.float32) / 32768, rate, SAMPLE_RATE_HZ)
    return (np.clip(resampled, -1, 1 - 1 / 32768) * 32768).astype(np.int16)


def next_shard(train: Path) -> int:
    numbers = [
        int(p.stem.rsplit("_", 1)[1]) for p in train.glob("shard_pl_*.npz") if p.stem.rsplit("_", 1)[1].isdigit()
    ]
    return max(numbers, default=-1) + 1


def label(
    files: list[Path],
    out: Path,
    model: str,
    min_logprob: float = MIN_LOGPROB,
    threads: int = 1,
    shard_size: int = SHARD_SIZE,
    held_out: str | None = None,
) -> Summary:
    """Pseudo-label ``files`` into shards under ``out/train``, or into the held-out group ``out/eval/held_out``
    (see the module docstring)."""
    summary = Summary()
    pending: list[tuple[np.ndarray, str]] = []  # (utterance, its file)
    for path in files:
        try:
            pcm = read_16k(path)
        except (UndecodableAudio, OSError, ValueError) as err:
            log.warning("skipped %s: %s", path, err)
            summary.unreadable.append(str(path))
            continue
        summary.files += 1
        summary.audio_s += len(pcm) / SAMPLE_RATE_HZ
        for utterance in utterances(pcm):
            summary.utterances += 1
            if len(utterance) < MIN_UTTERANCE_S * SAMPLE_RATE_HZ:
                summary.drop("short")
            else:
                pending.append((utterance, str(path)))
    transcriber = WhisperTranscriber(model, cpu_threads=threads)
    pending.sort(key=lambda item: len(item[0]))  # (a batch pads to its longest: similar lengths together)
    kept: list[tuple[np.ndarray, str, str]] = []
    for start in range(0, len(pending), BATCH):
        batch = pending[start : start + BATCH]
        started = time.monotonic()
        results = transcriber.transcribe_batch([audio for audio, _ in batch])
        summary.read_s += time.monotonic() - started
        for (audio, source), result in zip(batch, results, strict=True):
            if result.gated:
                summary.drop(result.gated)
            elif result.avg_logprob < min_logprob:
                summary.drop("low_confidence")
            else:
                kept.append((audio, result.text, source))
    summary.kept = len(kept)
    summary.kept_s = sum(len(a) for a, _, _ in kept) / SAMPLE_RATE_HZ
    if held_out is not None:
        (out / "eval").mkdir(parents=True, exist_ok=True)
        if kept:
            summary.shards.append(f"eval/{_save(out / 'eval' / f'{held_out}.npz', kept)}")
        return summary
    train = out / "train"
    train.mkdir(parents=True, exist_ok=True)
    number = next_shard(train)
    for start in range(0, len(kept), shard_size):
        summary.shards.append(_save(train / f"shard_pl_{number:05d}.npz", kept[start : start + shard_size]))
        number += 1
    return summary


def _save(path: Path, kept: list[tuple[np.ndarray, str, str]]) -> str:
    """(audio, text, source file) as one shard at ``path``, each utterance's voice its source; its name."""
    save_shard(path, [a for a, _, _ in kept], [t for _, t, _ in kept], [f"pseudo:{s}" for *_, s in kept])
    return path.name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--audio", type=Path, nargs="+", required=True, help="audio files, or directories of them")
    parser.add_argument("--out", type=Path, required=True, help="the corpus directory (shards go to OUT/train)")
    parser.add_argument(
        "--final-model",
        default=EMBEDDED_WHISPER,
        help="the second-pass model that labels (as serve --final-model: embedded:NAME or a CTranslate2 directory)",
    )
    parser.add_argument("--min-logprob", type=float, default=MIN_LOGPROB, help="drop less certain utterances")
    parser.add_argument("--threads", type=int, default=1, help="the second pass's CPU threads")
    parser.add_argument(
        "--held-out", metavar="GROUP", default=None, help="write a held-out group OUT/eval/GROUP.npz instead"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the summary here too")
    args = parser.parse_args(argv)
    if args.held_out is not None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", args.held_out):
            parser.error(f"--held-out {args.held_out!r}: a group name is letters, digits, '_', '.' and '-'")
        if (args.out / "eval" / f"{args.held_out}.npz").exists():
            parser.error(f"{args.out / 'eval' / args.held_out}.npz exists: name another group")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    files = audio_files(args.audio)
    if not files:
        parser.error(f"no audio files in {' '.join(map(str, args.audio))} ({', '.join(AUDIO_SUFFIXES)})")
    summary = label(files, args.out, args.final_model, args.min_logprob, args.threads, held_out=args.held_out)
    report = vars(summary) | {"real_time_factor": summary.read_s / summary.audio_s if summary.audio_s else None}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    dropped = ", ".join(f"{why} {count}" for why, count in sorted(summary.dropped.items())) or "none"
    print(
        f"{summary.files} files ({summary.audio_s / 3600:.2f} h; {len(summary.unreadable)} unreadable), "
        f"{summary.utterances} utterances: {summary.kept} kept ({summary.kept_s / 3600:.2f} h) in "
        f"{len(summary.shards)} shards, dropped: {dropped}; second pass {summary.read_s:.1f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
