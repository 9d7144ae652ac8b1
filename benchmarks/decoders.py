"""The beam searches side by side on the same model outputs: WER, CER and decoding time per 10 ms frame.

Each set runs once through the model (the engine's ``Runner``, as ``cosystream eval`` streams it); its
per-frame top-k outputs are kept and every search decodes them, utterance by utterance in turn (the order
alternating), so that both see the same load on a shared machine; times are the decoding thread's CPU
time, so that waiting for a shared core is not counted. Two timings:

* **eval**: the outputs pushed as ``cosystream eval`` pushes them (16 frames a push), then the final;
* **stream**: ``--push-frames`` frames a push, and after every push that changed the text, the text, the
  confidence and the words read, as a server session does for an interim result. Its final is checked
  against the eval one (``chunking changed``: how many differ).

A set is ``NAME=PATH`` (a ``cosystream eval`` directory or manifest), optionally ``:even`` or ``:odd`` for
every other utterance in name order (``training/tune.py``'s halves). ``--espeak`` adds the 150 held-out
sentences of the training corpus (never in the language model's text), spoken by random espeak-ng training
voices; the sentences come from Debian's fortune files, fetched with ``apt-get download`` into ``--cache``.

    PYTHONPATH=. .venv/bin/python -m benchmarks.decoders --espeak \\
        --set ast16=.cache/accuracy/asterisk-prompts-16k:odd --set ast8=.cache/accuracy/asterisk-prompts-8k:odd

(the Asterisk prompts: ``python -m benchmarks.accuracy --prompts`` fetches them.) A search named
``python@REV`` is the Python search as it was at git revision ``REV`` (its ``cosystream/decoding/beam.py``,
``lexicon.py`` and ``lm.py``, the lexicon and language model read by that code, on this tree's settings), to
measure a change to it side by side: ``--searches python@HEAD~1,python``; each search's loading time is
printed. The searches share one process and its garbage collector: a full collection walks every search's
objects (and torch's) and is timed on whichever search triggered it; ``--no-gc`` decodes with the collector
off, to compare the searches' own work.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

from cosystream.app.evaluate import edit_distance, eval_runner
from cosystream.app.transcribe import write_wav
from cosystream.decoding.beam import BeamConfig
from cosystream.decoding.config import DecoderConfig, DecoderFactory
from cosystream.frames import FRAME_MS
from cosystream.models import load_model

ESPEAK_SEED = 12345  # the voices' draw
FORTUNE_PACKAGES = ("fortunes-min", "fortunes")


def fetch_espeak_set(cache: Path) -> Path:
    """The training corpus's held-out sentences by random espeak-ng training voices, as a test set."""
    from training.corpus import ESPEAK_ACCENTS, ESPEAK_FEMALE, ESPEAK_MALE, Voice, finish, synth_espeak
    from training.text import fortune_sentences

    target = cache / "espeak-heldout"
    if (target / "DONE").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["apt-get", "download", *FORTUNE_PACKAGES], cwd=tmp, check=True, capture_output=True)
        for deb in Path(tmp).glob("*.deb"):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(Path(tmp) / "root")], check=True)
        sentences = fortune_sentences(Path(tmp) / "root/usr/share/games/fortunes")
    # training.corpus.split_sentences(seed=1, n_eval=150), the corpus's defaults, on these files.
    random.Random(1).shuffle(sentences)
    held_out = set([s for s in sentences if 6 <= len(s.split()) <= 20][:150])
    rng = random.Random(ESPEAK_SEED)
    for i, text in enumerate(sorted(held_out, key=sentences.index)):
        female = rng.random() < 0.5
        variant = rng.choice(ESPEAK_FEMALE if female else ESPEAK_MALE)
        name = rng.choice(ESPEAK_ACCENTS) + (f"+{variant}" if variant else "")
        rate = rng.uniform(0.8, 1.35)  # (as training.corpus.sample_voice draws an espeak-ng voice)
        pitch = rng.uniform(40, 90) if female else rng.uniform(25, 80)
        audio = finish(synth_espeak(text, Voice("espeak", name, rate=rate, pitch=pitch)))
        write_wav(target / f"espeak-{i:03d}.wav", audio, 16000)
        (target / f"espeak-{i:03d}.txt").write_text(text + "\n")
    (target / "DONE").write_text("")
    return target


def module_at(rev: str, path: str) -> types.ModuleType:
    """The module at ``path`` as of git revision ``rev`` (its imports are this tree's)."""
    source = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout
    module = types.ModuleType(f"_{Path(path).stem}_at_{len(sys.modules)}")
    sys.modules[module.__name__] = module  # (dataclasses look their module up)
    exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)
    return module


def search_at(rev: str, config: DecoderConfig, vocabulary: list[str]):
    """The Python search as of git revision ``rev``: its beam search on its lexicon and language model, read
    by its code, with this tree's ``config``."""
    lm_code = module_at(rev, "cosystream/decoding/lm.py")
    lexicon_code = module_at(rev, "cosystream/decoding/lexicon.py")
    beam_code = module_at(rev, "cosystream/decoding/beam.py")
    lm = lm_code.NgramLm.load(config.lm_path)
    spellings = lexicon_code.read_spellings(config.lexicon_path) if config.lexicon_path else None
    lexicon = lexicon_code.Lexicon.from_lm(lm, vocabulary, spellings)
    return beam_code.BeamCtcDecoder(vocabulary, lm, lexicon, config.beam, FRAME_MS)


def decode_eval(decoder, chunks) -> tuple[str, float]:
    """As ``cosystream eval``: every push, then the final; the hypothesis and the seconds spent."""
    started = time.thread_time()
    decoder.reset()
    for ids, logprobs, first in chunks:
        decoder.push(ids, logprobs, first)
    decoder.finalize()
    return decoder.text, time.thread_time() - started


def decode_stream(decoder, ids, logprobs, push_frames: int) -> tuple[str, float, int]:
    """As a session: ``push_frames`` a push, an interim's reads after each change; the final, the seconds
    spent and the interims."""
    started = time.thread_time()
    decoder.reset()
    interims = 0
    for first in range(0, len(ids), push_frames):
        if decoder.push(ids[first : first + push_frames], logprobs[first : first + push_frames], first):
            interims += 1
            _ = decoder.text, decoder.confidence, decoder.words()
    decoder.finalize()
    _ = decoder.text, decoder.confidence, decoder.words()
    return decoder.text, time.thread_time() - started, interims


def main(argv: list[str] | None = None) -> int:
    from training.tune import model_outputs, parse_set

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", dest="sets", type=parse_set, action="append", default=[])
    parser.add_argument("--espeak", action="store_true", help="add the held-out sentences by espeak-ng voices")
    parser.add_argument("--cache", type=Path, default=Path(".cache/decoders"))
    parser.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    parser.add_argument("--searches", default="python,flashlight", help="beam searches to compare")
    defaults = BeamConfig()
    parser.add_argument("--beam-size", type=int, default=defaults.beam_size)
    parser.add_argument("--lm-weight", type=float, default=defaults.alpha)
    parser.add_argument("--word-bonus", type=float, default=defaults.beta)
    parser.add_argument("--push-frames", type=int, default=2, help="frames a push in the stream timing")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--no-gc",
        action="store_true",
        help="decode with the garbage collector off, so that a collection one search triggers (over every "
        "search's objects, and torch's) is not timed on another",
    )
    args = parser.parse_args(argv)
    sets = list(args.sets)
    if args.espeak:
        sets.insert(0, ("espeak", fetch_espeak_set(args.cache), None))
    if not sets:
        parser.error("give --set NAME=PATH and/or --espeak")
    torch.set_num_threads(1)

    beam = dataclasses.replace(BeamConfig(), beam_size=args.beam_size, alpha=args.lm_weight, beta=args.word_bonus)
    searches = args.searches.split(",")
    configs = {s: DecoderConfig("beam", beam=beam, search=s.split("@")[0]).resolve(args.model) for s in searches}
    model = load_model(args.model)
    runner = eval_runner(model, next(iter(configs.values())).top_k)
    decoders = {}
    for search, config in configs.items():
        started = time.perf_counter()
        if "@" in search:
            decoders[search] = search_at(search.split("@", 1)[1], config, model.vocabulary)
        else:
            decoders[search] = DecoderFactory(config, model.vocabulary)()
        print(f"{search}: loaded in {time.perf_counter() - started:.1f} s", file=sys.stderr)

    rows = []
    for name, path, half in sets:
        outputs = model_outputs(runner, path, half)
        if args.no_gc:
            gc.collect()
            gc.disable()
        stats = {
            s: dict.fromkeys(("word_errors", "char_errors", "interims", "stream_final_differs"), 0)
            for s in searches
        }
        for s in stats.values():
            s["eval_s"] = s["stream_s"] = 0.0
        hypotheses = {s: [] for s in searches}
        words = chars = frames = 0
        for i, (reference, chunks) in enumerate(outputs):
            ids = np.concatenate([c[0] for c in chunks])
            logprobs = np.concatenate([c[1] for c in chunks])
            frames += len(ids)
            words += len(reference.split())
            chars += len(reference)
            order = searches if i % 2 == 0 else searches[::-1]
            for search in order:
                hypothesis, seconds = decode_eval(decoders[search], chunks)
                streamed, stream_s, interims = decode_stream(decoders[search], ids, logprobs, args.push_frames)
                s = stats[search]
                s["word_errors"] += edit_distance(reference.split(), hypothesis.split())
                s["char_errors"] += edit_distance(list(reference), list(hypothesis))
                s["eval_s"] += seconds
                s["stream_s"] += stream_s
                s["interims"] += interims
                s["stream_final_differs"] += streamed != hypothesis
                hypotheses[search].append(hypothesis)
        row = {"set": name, "half": half, "utterances": len(outputs), "words": words, "frames": frames}
        for search, s in stats.items():
            row[search] = {
                "wer": s["word_errors"] / max(words, 1),
                "cer": s["char_errors"] / max(chars, 1),
                "eval_us_per_frame": s["eval_s"] / frames * 1e6,
                "stream_us_per_frame": s["stream_s"] / frames * 1e6,
                "interims": s["interims"],
                "stream_final_differs": s["stream_final_differs"],
            }
        if len(searches) > 1:
            first = hypotheses[searches[0]]
            row["same_hypotheses"] = {
                s: sum(a == b for a, b in zip(first, hypotheses[s], strict=True)) for s in searches[1:]
            }
        rows.append(row)
        print(json.dumps(row), flush=True)

    print(
        f"\n{'set':<14} {'utts':>5} {'words':>6} {'search':<11} {'WER':>6} {'CER':>6} {'eval us/fr':>10}"
        f" {'stream us/fr':>12} {'interims':>8} {'chunking changed':>16}"
    )
    for row in rows:
        label = row["set"] + (f":{row['half']}" if row["half"] else "")
        for search in searches:
            r = row[search]
            print(
                f"{label:<14} {row['utterances']:>5} {row['words']:>6} {search:<11} {r['wer'] * 100:>5.1f}%"
                f" {r['cer'] * 100:>5.1f}% {r['eval_us_per_frame']:>10.1f} {r['stream_us_per_frame']:>12.1f}"
                f" {r['interims']:>8} {r['stream_final_differs']:>16}"
            )
        if "same_hypotheses" in row:
            print(f"{'':<14} same hypotheses: {row['same_hypotheses']} of {row['utterances']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
