"""Phrase boosting: what it hears and what it costs (docs/MODELS.md, "Phrase boosting").

``python -m benchmarks.phrases`` synthesizes with espeak-ng (several voices) sentences holding names and
terms the default model's lexicon lacks, and ordinary sentences, decodes each offline with the Python beam
search, and prints (JSON, then a table):

- term recall (the boosted term found in the final, as words) and WER, with and without boosting;
- WER on the ordinary sentences with a list of 100 unrelated phrases boosted;
- decoding time per 10 ms frame with 0, 100 and 1,000 phrases (new words among them), and the time to
  build a session's boosting (G2P and lexicon) for 1,000 new words;
- named vocabularies (``serve --vocabulary``, at their default boost, ``phrases.vocabulary_boost``): the
  build time and memory of one of 10,000 and of 100,000 phrases of made-up words, term recall and ordinary
  WER with every term in the one of 10,000, decoding time per frame on it, and the build of a session's
  10 phrases on top of it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string
import time

import numpy as np
import torch

from cosystream.app.evaluate import edit_distance
from cosystream.decoding.config import DecoderConfig, DecoderFactory
from cosystream.decoding.phrases import MAX_VOCABULARY_CHARS, MAX_VOCABULARY_PHRASES, normalize, vocabulary_boost
from cosystream.models.loading import DEFAULT_MODEL_DIR, load_model
from tests.speech import silence, speech

TERMS = [  # (sentence, the term boosted): names and terms the lexicon lacks or misses
    ("the meeting with siobhan nguyen is at noon", "siobhan nguyen"),
    ("please call zorblax quindle tomorrow morning", "zorblax quindle"),
    ("deploy the service to kubernetes today", "kubernetes"),
    ("send the invoice to acme corporation", "acme corporation"),
    ("my doctor is called priyanka ramaswamy", "priyanka ramaswamy"),
    ("we flew to reykjavik last winter", "reykjavik"),
    ("the new phone from xiaomi is cheap", "xiaomi"),
    ("ask saoirse about the budget", "saoirse"),
]
ORDINARY = [
    "the weather is nice today",
    "please enter your password followed by the pound key",
    "i would like to book a table for two",
    "the train leaves at seven in the evening",
    "thank you for calling how can i help you",
]
VOICES = ["en-us", "en-gb", "en-us+f3"]


def unrelated_phrases(n: int, seed: int = 0) -> list[tuple[str, float]]:
    """``n`` phrases of made-up words (none in the test sentences)."""
    rng = random.Random(seed)
    return [
        (
            " ".join(
                "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 5))) for _ in range(rng.randint(1, 2))
            ),
            0.0,
        )
        for _ in range(n)
    ]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def vocabulary(pairs: list[tuple[str, float]]):
    """As ``read_vocabulary`` reads a file of these phrases, none with a boost of its own."""
    boost = vocabulary_boost(len(pairs))
    return normalize([(text, boost) for text, _ in pairs], MAX_VOCABULARY_PHRASES, MAX_VOCABULARY_CHARS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    model = load_model(DEFAULT_MODEL_DIR).eval()
    factory = DecoderFactory(DecoderConfig().resolve(None), model.vocabulary)

    def candidates(text: str, voice: str):
        audio = np.concatenate([silence(0.2), speech(text, voice), silence(0.3)])
        with torch.no_grad():
            logprobs = torch.log_softmax(model.forward(torch.from_numpy(audio)[None]), -1)[0]
        values, ids = logprobs.topk(8, -1)
        return ids.numpy(), values.numpy()

    def decode(ids, values, boosting=None) -> tuple[str, float]:
        decoder = factory(boosting)
        started = time.perf_counter()
        decoder.push(ids, values, 0)
        decoder.finalize()
        return decoder.text, (time.perf_counter() - started) / len(ids)

    started = time.perf_counter()
    many = factory.boosting(normalize(unrelated_phrases(1000)))
    build_1000_s = time.perf_counter() - started
    hundred = factory.boosting(normalize(unrelated_phrases(100)))
    named: dict[str, dict[str, float]] = {}
    for size in (10_000, 100_000):
        phrases = vocabulary([(term, 0.0) for _, term in TERMS] + unrelated_phrases(size - len(TERMS), seed=size))
        before, started = rss_mb(), time.perf_counter()
        factory.named(str(size), phrases)
        named[str(size)] = {"build_s": time.perf_counter() - started, "rss_mb": rss_mb() - before}
    large = factory.named("10000", ())
    started = time.perf_counter()
    on_large = factory.boosting(normalize(unrelated_phrases(10, seed=7)), ("10000", ()))
    named["10000"]["session_10_phrases_on_it_ms"] = 1000 * (time.perf_counter() - started)
    vocabulary_rows = [0, 0, 0, 0]  # found, terms, word errors, words: every term in the 10,000
    rows = {"plain": [0, 0, 0, 0], "boosted": [0, 0, 0, 0]}  # found, terms, word errors, words
    frame_s: dict[str, list[float]] = {"0": [], "100": [], "1000": []}
    for text, term in TERMS:
        boosting = factory.boosting(normalize([(term, 0.0)]))
        for voice in VOICES:
            ids, values = candidates(text, voice)
            for name, boost in (("plain", None), ("boosted", boosting)):
                heard, _ = decode(ids, values, boost)
                row = rows[name]
                row[0] += f" {term} " in f" {heard} "
                row[1] += 1
                row[2] += edit_distance(text.split(), heard.split())
                row[3] += len(text.split())
            heard, _ = decode(ids, values, large)
            vocabulary_rows[0] += f" {term} " in f" {heard} "
            vocabulary_rows[1] += 1
            vocabulary_rows[2] += edit_distance(text.split(), heard.split())
            vocabulary_rows[3] += len(text.split())
    ordinary = {"plain": [0, 0], "100 unrelated": [0, 0], "vocabulary of 10000": [0, 0]}
    frame_s["vocabulary of 10000"] = []
    for text in ORDINARY:
        for voice in VOICES:
            ids, values = candidates(text, voice)
            for name, boost, key in (("plain", None, "0"), ("100 unrelated", hundred, "100")):
                heard, per_frame = decode(ids, values, boost)
                frame_s[key].append(per_frame)
                ordinary[name][0] += edit_distance(text.split(), heard.split())
                ordinary[name][1] += len(text.split())
            frame_s["1000"].append(decode(ids, values, many)[1])
            heard, per_frame = decode(ids, values, on_large)
            frame_s["vocabulary of 10000"].append(per_frame)
            ordinary["vocabulary of 10000"][0] += edit_distance(text.split(), heard.split())
            ordinary["vocabulary of 10000"][1] += len(text.split())
    figures = {
        "term_recall": {k: v[0] / v[1] for k, v in rows.items()},
        "term_sentences_wer": {k: v[2] / v[3] for k, v in rows.items()},
        "ordinary_wer": {k: v[0] / v[1] for k, v in ordinary.items()},
        "decode_ms_per_frame": {k: 1000 * float(np.mean(v)) for k, v in frame_s.items()},
        "build_1000_new_words_ms": 1000 * build_1000_s,
        "vocabulary_term_recall": vocabulary_rows[0] / vocabulary_rows[1],
        "vocabulary_term_sentences_wer": vocabulary_rows[2] / vocabulary_rows[3],
        "named_vocabularies": named,
        "g2p_agreement_with_lexicon": factory._speller.agreement if factory._speller else None,
        "sentences": len(TERMS) * len(VOICES),
    }
    print(json.dumps(figures, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    print(f"\n{'':28} {'plain':>8} {'boosted':>8}")
    print(f"{'term recall':28} {figures['term_recall']['plain']:8.0%} {figures['term_recall']['boosted']:8.0%}")
    wer = figures["term_sentences_wer"]
    print(f"{'WER, sentences with terms':28} {wer['plain']:8.1%} {wer['boosted']:8.1%}")
    wer = figures["ordinary_wer"]
    print(f"{'WER, ordinary (100 unrelated)':28} {wer['plain']:8.1%} {wer['100 unrelated']:8.1%}")
    per_frame = figures["decode_ms_per_frame"]
    print("decode ms/frame with 0/100/1000 phrases: " + " / ".join(f"{per_frame[k]:.3f}" for k in per_frame))
    print(f"boosting for 1000 new words built in {figures['build_1000_new_words_ms']:.0f} ms")
    print(
        f"every term in a vocabulary of 10000: term recall {figures['vocabulary_term_recall']:.0%}, WER "
        f"{figures['vocabulary_term_sentences_wer']:.1%}; ordinary WER {wer['vocabulary of 10000']:.1%}"
    )
    for size, row in named.items():
        print(f"vocabulary of {size} phrases: built in {row['build_s']:.1f} s, {row['rss_mb']:.0f} MB")
    print(f"a session's 10 phrases on the 10000: {named['10000']['session_10_phrases_on_it_ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
