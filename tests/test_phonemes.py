"""Phoneme units: espeak-ng's pronunciations as a lexicon, and the beam search spelling words by it."""

from __future__ import annotations

import ctypes.util
import gzip
import itertools

import pytest

from cosystream.decoding.beam import BeamConfig, BeamCtcDecoder
from cosystream.decoding.config import LEXICON_FILE, LM_FILE, DecoderConfig, DecoderFactory
from cosystream.decoding.lexicon import Lexicon, read_spellings
from cosystream.decoding.lm import NgramLm
from tests.test_beam import VOCAB, decode, frames
from training.lm import kneser_ney, write_arpa

needs_espeak = pytest.mark.skipif(ctypes.util.find_library("espeak-ng") is None, reason="needs libespeak-ng")

SENTENCES = ["the cat sat on the mat", "i saw the cat", "the bat flew", "a cat and a dog", "the cat ate"]
# A made-up pronunciation lexicon over VOCAB's letters: "cat" and "bat" sound alike here.
SPELLINGS = {"the": "d", "cat": "kat", "bat": "kat", "sat": "sat", "flew": "flu", "i": "ai", "saw": "so"}


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> NgramLm:
    logprobs, backoffs = kneser_ney([s.split() for s in SENTENCES], order=3)
    path = tmp_path_factory.mktemp("lm") / LM_FILE
    write_arpa(path, logprobs, backoffs)
    return NgramLm.load(path)


@needs_espeak
def test_espeak_pronunciations_become_one_character_units():
    from training.phonemes import Espeak, build, to_units, vocabulary

    espeak = Espeak()
    assert espeak.phonemes("cat") == ["k", "a", "t"]
    assert espeak.phonemes("two") == espeak.phonemes("too")  # stress marks are gone
    assert "'" not in "".join(espeak.phonemes("hello"))
    lexicon, names = build(["cat", "chat", "two", "too", "the", "weather's"])
    assert all(len(u) == 1 for units in lexicon.values() for u in units)
    assert lexicon["two"] == lexicon["too"]
    assert [names[u] for u in lexicon["chat"]] == ["tS", "a", "t"]  # an affricate is one unit
    vocab = vocabulary(lexicon)
    assert vocab[:2] == ["<blank>", " "] and len(set(vocab)) == len(vocab)
    assert to_units("the cat", lexicon) == lexicon["the"] + " " + lexicon["cat"]
    # Same words, same table: the units do not depend on which other words were built.
    assert build(["chat"])[0]["chat"] != "" and build(["cat", "chat"])[1] == build(["chat", "cat"])[1]


def test_lexicon_files_round_trip_and_bad_lines_are_named(tmp_path):
    from training.phonemes import write_lexicon

    write_lexicon(SPELLINGS, tmp_path / "lex.tsv.gz")
    assert read_spellings(tmp_path / "lex.tsv.gz") == SPELLINGS
    with gzip.open(tmp_path / "bad.tsv.gz", "wt") as f:
        f.write("cat\tkat\nbat\n")
    with pytest.raises(ValueError, match=r"bad\.tsv\.gz:2"):
        read_spellings(tmp_path / "bad.tsv.gz")


def test_homophones_are_told_apart_by_the_language_model(lm):
    lexicon = Lexicon.from_lm(lm, VOCAB, SPELLINGS)
    assert lexicon.size == len(SPELLINGS) and not lexicon.spelled
    assert Lexicon.from_lm(lm, VOCAB, {**SPELLINGS, "sat": "kat"}).size == len(SPELLINGS)  # cat, bat, sat: kept
    assert Lexicon(SPELLINGS, VOCAB, lm, SPELLINGS, homophones=1).size == len(SPELLINGS) - 1  # bat: dropped
    decoder = BeamCtcDecoder(VOCAB, lm, lexicon)
    # The same sounds, "kat", after "saw the" and before "flew".
    assert decode(decoder, "_ai|so|d|kat__") == "i saw the cat"
    decoder.reset()
    assert decode(decoder, "_d|kat|flu__") == "the bat flew"
    words = decoder.words()
    assert [w.word for w in words] == ["the", "bat", "flew"]
    assert all(w.end_ms > w.start_ms for w in words)


def test_interim_text_shows_words_not_units(lm):
    decoder = BeamCtcDecoder(VOCAB, lm, Lexicon.from_lm(lm, VOCAB, SPELLINGS))
    ids, lps = frames("_d|ka")
    decoder.push(ids, lps, 0)
    assert decoder.text.split()[0] == "the"
    assert decoder.text.split()[1] in {"cat", "bat"}  # the likeliest word "ka..." can become
    assert decoder.words()[-1].word in {"cat", "bat"}


def test_a_phoneme_model_directory_is_decoded_with_its_lexicon(tmp_path):
    from training.phonemes import write_lexicon

    write_lexicon(SPELLINGS, tmp_path / LEXICON_FILE)
    with pytest.raises(ValueError, match="phonemes"):
        DecoderConfig().resolve(str(tmp_path))  # words from phonemes need a language model
    logprobs, backoffs = kneser_ney([s.split() for s in SENTENCES], order=3)
    write_arpa(tmp_path / LM_FILE, logprobs, backoffs)
    beam = DecoderConfig().resolve(str(tmp_path))
    assert beam.kind == "beam" and beam.lexicon_path == str(tmp_path / LEXICON_FILE)
    assert DecoderConfig.from_dict(beam.to_dict()) == beam
    assert decode(DecoderFactory(beam, VOCAB)(), "_d|kat|flu__") == "the bat flew"
    # One hypothesis keeps only "the cat" (likelier so far); greedy decoding would print phonemes: refused.
    narrow = DecoderConfig("beam", beam=BeamConfig(beam_size=1)).resolve(str(tmp_path))
    assert decode(DecoderFactory(narrow, VOCAB)(), "_d|kat|flu__") == "the cat flew"
    with pytest.raises(ValueError, match="would print phonemes"):
        DecoderConfig("greedy").resolve(str(tmp_path))


def test_one_hypothesis_interims_only_grow(lm):
    decoder = BeamCtcDecoder(VOCAB, lm, Lexicon.from_lm(lm, VOCAB, SPELLINGS), BeamConfig(beam_size=1))
    assert decoder.stable_interims
    ids, lps = frames("_ai|so|d|kat|flu__")
    shown = []
    for t in range(len(ids)):
        decoder.push(ids[t : t + 1], lps[t : t + 1], t)
        shown.append(decoder.text)
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(shown)), shown
    assert "i saw the" in shown  # "cat" is not shown while it could still become another word
    decoder.finalize()
    assert decoder.text.startswith(shown[-1]) and decoder.text == "i saw the cat flew"
