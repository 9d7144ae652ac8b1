"""A compact, seeded subset of the corpus as Opus, to train where the corpus cannot be copied whole.

    PYTHONPATH=. .venv/bin/python -m training.pack build --corpus data/corpus --out packs/a \\
        --megabytes 42 --part 0 --parts 3 --eval-per-group 40
    PYTHONPATH=. python3 -m training.pack unpack packs/a --corpus data/gpu

``build`` draws training utterances in a seeded order (espeak-ng's formant voices, plentiful and the least
like the held-out voices, at ``--espeak-share`` of the rate of the others), gives every ``--parts``-th one to
this part, takes as many from the front of that order as fill ``--megabytes``, and encodes them as one
Ogg/Opus stream per source shard (about 13.6 kbit/s at the default ``--level``; log-mel features move by
~0.15 of their standard deviation, less than the noise the augmentation adds): ``pack_NNNN.npz`` files of
``opus`` bytes, decoded sample ``offsets``, ``text`` and ``voice``. ``--eval-per-group`` adds the first N
sentences of each evaluation group at a higher rate (``eval_GROUP.npz``). ``unpack`` decodes a pack into
corpus shards (``train/shard_op_<pack>_NNNN.npz``, ``eval/GROUP.npz``) that ``training.train`` reads like
any other.
Needs ``soundfile`` (in the ``dev`` extras; its wheels bundle libsndfile with Opus).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import os
from pathlib import Path

import numpy as np

from training.corpus import load_shard, save_shard

SAMPLE_RATE = 16000


def _soundfile():
    import soundfile  # a training-only dependency, imported where it is needed

    return soundfile


def encode(audios: list[np.ndarray], level: float) -> tuple[bytes, np.ndarray]:
    """int16 utterances -> one Ogg/Opus stream of them back to back, and their sample offsets."""
    offsets = np.zeros(len(audios) + 1, np.int64)
    offsets[1:] = np.cumsum([a.size for a in audios])
    buf = io.BytesIO()
    _soundfile().write(
        buf, np.concatenate(audios), SAMPLE_RATE, format="OGG", subtype="OPUS", compression_level=level
    )
    return buf.getvalue(), offsets


def decode(blob: bytes, offsets: np.ndarray) -> list[np.ndarray]:
    pcm, rate = _soundfile().read(io.BytesIO(blob), dtype="int16")
    if rate != SAMPLE_RATE or pcm.size < offsets[-1]:
        raise ValueError(f"pack stream decodes to {pcm.size} samples at {rate} Hz, expected {offsets[-1]}")
    return [pcm[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


def selection(corpus: Path, seed: int, espeak_share: float) -> list[tuple[str, int, int]]:
    """``(shard name, index, samples)`` of every training utterance kept, in a seeded order."""
    rng = np.random.default_rng(seed)
    chosen = []
    for path in sorted((corpus / "train").glob("shard_*.npz")):
        if path.name.endswith(".tmp.npz"):
            continue
        with np.load(path) as z:
            voices = [str(v) for v in z["voice"]]
            lengths = np.diff(z["offsets"])
        keep = rng.random(len(voices))
        for i, voice in enumerate(voices):
            formant = voice.startswith("espeak_") and not voice.startswith("espeak_mb-")
            if keep[i] < (espeak_share if formant else 1.0):
                chosen.append((path.name, i, int(lengths[i])))
    order = rng.permutation(len(chosen))
    return [chosen[i] for i in order]


def _encode_shard(args: tuple[Path, str, list[int], float, Path]) -> None:
    corpus, name, indices, level, out = args
    audio, offsets, texts, voices = load_shard(corpus / "train" / name)
    blob, offs = encode([audio[offsets[i] : offsets[i + 1]] for i in indices], level)
    _save(out, blob, offs, [texts[i] for i in indices], [voices[i] for i in indices])


def _save(out: Path, blob: bytes, offsets: np.ndarray, texts: list[str], voices: list[str]) -> None:
    tmp = out.with_suffix(".tmp.npz")
    np.savez(
        tmp, opus=np.frombuffer(blob, np.uint8), offsets=offsets, text=np.array(texts), voice=np.array(voices)
    )
    os.replace(tmp, out)


def build(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    total = 0
    if args.eval_per_group:
        for path in sorted((args.corpus / "eval").glob("*.npz")):
            audio, offsets, texts, voices = load_shard(path)
            n = min(args.eval_per_group, len(texts))
            blob, offs = encode([audio[offsets[i] : offsets[i + 1]] for i in range(n)], args.eval_level)
            _save(args.out / f"eval_{path.stem}.npz", blob, offs, texts[:n], voices[:n])
            total += (args.out / f"eval_{path.stem}.npz").stat().st_size
    items = selection(args.corpus, args.seed, args.espeak_share)[args.part :: args.parts]
    # A prefix of the seeded order that should fill the budget at the rate measured on its first utterances.
    rate = _bytes_per_second(args.corpus, items[:40], args.level)
    seconds_wanted = (args.megabytes * 1e6 - total) / rate
    prefix, seconds = [], 0.0
    for item in items:
        if seconds >= seconds_wanted:
            break
        prefix.append(item)
        seconds += item[2] / SAMPLE_RATE
    by_shard: dict[str, list[int]] = {}
    for name, index, _ in prefix:
        by_shard.setdefault(name, []).append(index)
    jobs = [
        (args.corpus, name, sorted(indices), args.level, args.out / f"pack_{k:04d}.npz")
        for k, (name, indices) in enumerate(sorted(by_shard.items()))
    ]
    with concurrent.futures.ProcessPoolExecutor(args.workers) as pool:
        list(pool.map(_encode_shard, jobs))
    # Over the budget (the rate was an estimate): drop whole files, last first.
    files = [job[-1] for job in jobs]
    total += sum(f.stat().st_size for f in files)
    while total > args.megabytes * 1e6 and files:
        total -= files[-1].stat().st_size
        files.pop().unlink()
    hours = 0.0
    for f in files:
        with np.load(f) as z:
            hours += z["offsets"][-1] / SAMPLE_RATE / 3600
    print(f"{args.out}: {total / 1e6:.1f} MB, {hours:.2f} h of training audio in {len(files)} files")


def _bytes_per_second(corpus: Path, sample: list[tuple[str, int, int]], level: float) -> float:
    """Opus bytes per second of audio on a sample of utterances."""
    audios = []
    for name, index, _ in sample:
        audio, offsets, _, _ = load_shard(corpus / "train" / name)
        audios.append(audio[offsets[index] : offsets[index + 1]])
    blob, offsets = encode(audios, level)
    return len(blob) / (offsets[-1] / SAMPLE_RATE)


def _unpack_one(args: tuple[Path, Path]) -> None:
    path, target = args
    with np.load(path) as z:
        audios = decode(z["opus"].tobytes(), z["offsets"])
        save_shard(target, audios, [str(t) for t in z["text"]], [str(v) for v in z["voice"]])


def unpack(args: argparse.Namespace) -> None:
    (args.corpus / "train").mkdir(parents=True, exist_ok=True)
    (args.corpus / "eval").mkdir(parents=True, exist_ok=True)
    tag = args.pack.name
    jobs = [
        (p, args.corpus / "train" / f"shard_op_{tag}_{p.stem[5:]}.npz")
        for p in sorted(args.pack.glob("pack_*.npz"))
    ]
    jobs += [(p, args.corpus / "eval" / f"{p.stem[5:]}.npz") for p in sorted(args.pack.glob("eval_*.npz"))]
    with concurrent.futures.ProcessPoolExecutor(args.workers) as pool:
        list(pool.map(_unpack_one, jobs))
    print(f"{args.pack} -> {args.corpus}: {len(jobs)} shards")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="encode a seeded subset of a corpus")
    b.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--megabytes", type=float, required=True, help="size of this part, evaluation included")
    b.add_argument("--part", type=int, default=0)
    b.add_argument("--parts", type=int, default=1)
    b.add_argument("--seed", type=int, default=1)
    b.add_argument("--espeak-share", type=float, default=0.4)
    b.add_argument("--level", type=float, default=0.97, help="libsndfile Opus compression level (1 = smallest)")
    b.add_argument("--eval-per-group", type=int, default=0)
    b.add_argument("--eval-level", type=float, default=0.9)
    b.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    u = sub.add_parser("unpack", help="decode a pack into corpus shards")
    u.add_argument("pack", type=Path)
    u.add_argument("--corpus", type=Path, required=True)
    u.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    build(args) if args.command == "build" else unpack(args)


if __name__ == "__main__":
    main()
