"""Incremental greedy CTC decoding: collapse rules, word timing and confidence, streaming = offline."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cosystream.decoding.greedy import CtcDecoder, Word

VOCAB = ["<blank>", " ", *"abcdefghijklmnopqrstuvwxyz", "'"]
ID = {s: i for i, s in enumerate(VOCAB)}


def _ids(pattern: str) -> np.ndarray:
    """One frame per character; '_' is blank, '|' is the word separator."""
    return np.array([ID[{"_": "<blank>", "|": " "}.get(c, c)] for c in pattern], dtype=np.int64)


def _push(dec: CtcDecoder, pattern: str, first_frame: int = 0, logprob: float = -0.1) -> bool:
    ids = _ids(pattern)
    return dec.push(ids, np.full(len(ids), logprob, dtype=np.float32), first_frame)


def test_collapse_repeats_and_drop_blanks() -> None:
    dec = CtcDecoder(VOCAB)
    assert _push(dec, "hh_ee_l_ll_oo")
    assert dec.text == "hello"
    dec.reset()
    _push(dec, "__dd_o_n''t___")
    assert dec.text == "don't"


def test_repeats_merge_across_pushes_unless_separated() -> None:
    dec = CtcDecoder(VOCAB)
    _push(dec, "aa", 0)
    assert not _push(dec, "a", 2)  # same id continues: nothing new
    assert dec.text == "a"
    _push(dec, "_", 3)
    _push(dec, "a", 4)  # blank between: counts twice
    assert dec.text == "aa"
    _push(dec, "a", 10)  # a gap in frames does not merge either
    assert dec.text == "aaa"


def test_words_spaces_and_timing() -> None:
    dec = CtcDecoder(VOCAB, frame_ms=10)
    #         frame: 0123456789012345
    _push(dec, "|_hi_||__yo_u|", first_frame=100)
    assert dec.text == "hi you"
    assert dec.words() == [
        Word("hi", 1020, 1040, pytest.approx(math.exp(-0.1))),
        Word("you", 1090, 1130, pytest.approx(math.exp(-0.1))),
    ]
    # A word in progress is in text and words(); it closes at the next separator.
    _push(dec, "th", first_frame=114)
    assert dec.text == "hi you th"
    assert dec.words()[-1] == Word("th", 1140, 1160, pytest.approx(math.exp(-0.1)))
    _push(dec, "e|", first_frame=116)
    assert dec.text == "hi you the"
    assert [w.word for w in dec.words()] == ["hi", "you", "the"]


def test_confidence_is_exp_mean_logprob_of_emitted_chars() -> None:
    dec = CtcDecoder(VOCAB)
    assert dec.confidence == 0.0 and dec.text == "" and dec.words() == []
    ids = _ids("a_b|c")
    logprobs = np.array([-0.5, -9.0, -1.5, -9.0, -2.0], dtype=np.float32)  # blanks/separators excluded
    dec.push(ids, logprobs, 0)
    ab, c = dec.words()
    assert ab.word == "ab" and ab.confidence == pytest.approx(math.exp(-1.0))
    assert c.word == "c" and c.confidence == pytest.approx(math.exp(-2.0))
    assert dec.confidence == pytest.approx(math.exp((-0.5 - 1.5 - 2.0) / 3))


def test_reset_starts_a_new_utterance() -> None:
    dec = CtcDecoder(VOCAB)
    _push(dec, "ab|c", 0)
    dec.reset()
    assert dec.text == "" and dec.words() == [] and dec.confidence == 0.0
    _push(dec, "b", 4)  # would have merged with nothing anyway; prev id is forgotten
    assert dec.text == "b" and dec.words()[0].start_ms == 40


def test_streaming_equals_offline() -> None:
    rng = np.random.default_rng(0)
    # Mostly blanks and repeats, like real CTC output.
    ids = rng.choice(len(VOCAB), 3000, p=[0.5, 0.05, *[0.45 / (len(VOCAB) - 2)] * (len(VOCAB) - 2)])
    ids = np.repeat(ids, rng.integers(1, 4, len(ids)))[:3000]
    logprobs = rng.uniform(-3, 0, len(ids)).astype(np.float32)
    offline = CtcDecoder(VOCAB)
    offline.push(ids, logprobs, 50)
    streaming = CtcDecoder(VOCAB)
    pos = 0
    while pos < len(ids):
        step = int(rng.integers(1, 40))
        streaming.push(ids[pos : pos + step], logprobs[pos : pos + step], 50 + pos)
        pos += step
    assert streaming.text == offline.text
    assert streaming.words() == offline.words()
    assert streaming.confidence == pytest.approx(offline.confidence)
    assert "  " not in offline.text and offline.text == offline.text.strip()
    # Reference: the textbook definition, applied to the whole sequence at once.
    collapsed = [int(t) for k, t in enumerate(ids) if t != 0 and (k == 0 or t != ids[k - 1])]
    assert offline.text == " ".join("".join(VOCAB[t] for t in collapsed).split())


def test_input_checks() -> None:
    dec = CtcDecoder(VOCAB)
    assert not dec.push(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32), 0)
    with pytest.raises(ValueError, match="token ids"):
        dec.push(np.array([len(VOCAB)]), np.zeros(1, dtype=np.float32), 0)
    with pytest.raises(ValueError, match="equal-length"):
        dec.push(np.array([1, 2]), np.zeros(1, dtype=np.float32), 0)
    with pytest.raises(ValueError):
        CtcDecoder(["<blank>"])
