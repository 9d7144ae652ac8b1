"""The compiled beam search (flashlight-text's LexiconDecoder with KenLM): the same words as the Python search,
streaming equal to one push, pruning that does not change the result, the text traced back every few frames as
if after every one, and the default model on speech."""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest

from cosystream.decoding import flashlight
from cosystream.decoding.beam import BeamConfig, BeamCtcDecoder
from cosystream.decoding.config import DecoderConfig, DecoderFactory
from cosystream.decoding.flashlight import FlashlightCtcDecoder, FlashlightLexicon
from cosystream.decoding.lexicon import Lexicon
from cosystream.decoding.lm import NgramLm
from cosystream.models.loading import DEFAULT_MODEL_DIR
from tests.speech import needs_espeak, silence, speech
from tests.test_beam import ID, SENTENCES, VOCAB, decode, frames
from tests.test_phonemes import SENTENCES as PHONEME_SENTENCES
from tests.test_phonemes import SPELLINGS
from training.lm import kneser_ney, write_arpa

pytestmark = pytest.mark.skipif(
    not flashlight.available(), reason="needs flashlight-text (pip install flashlight-text)"
)

LONG = "__th_e_|_cc_a_t__|_s_a_t_|_o_n_|_th_e_|_m_a_t___|_th_e_|_d_o_g_|_s_a_t_|_o_n_|_th_e_|_l_o_g___"


@pytest.fixture(scope="module")
def arpa(tmp_path_factory):
    logprobs, backoffs = kneser_ney([s.split() for s in SENTENCES], order=3, extra_words={"cab", "hat"})
    path = tmp_path_factory.mktemp("lm") / "lm.arpa.gz"
    write_arpa(path, logprobs, backoffs)
    return path


@pytest.fixture(scope="module")
def lexicon(arpa) -> FlashlightLexicon:
    return FlashlightLexicon(arpa, VOCAB)


@pytest.fixture(scope="module")
def phonemes(tmp_path_factory) -> tuple[FlashlightLexicon, Lexicon, NgramLm]:
    """The made-up pronunciation lexicon of test_phonemes ("cat" and "bat" sound alike), both searches'."""
    logprobs, backoffs = kneser_ney([s.split() for s in PHONEME_SENTENCES], order=3)
    path = tmp_path_factory.mktemp("lm") / "lm.arpa.gz"
    write_arpa(path, logprobs, backoffs)
    lm = NgramLm.load(path)
    return FlashlightLexicon(path, VOCAB, SPELLINGS), Lexicon.from_lm(lm, VOCAB, SPELLINGS), lm


def test_clear_audio_decodes_to_the_spelled_words_with_their_times(lexicon):
    dec = FlashlightCtcDecoder(VOCAB, lexicon)
    assert decode(dec, "__th_e_|_cc_a_t__|_s_a_t_") == "the cat sat"
    words = dec.words()
    assert [w.word for w in words] == ["the", "cat", "sat"]
    # From each word's first token to one frame past its last new token, as the Python search times them.
    assert [(w.start_ms, w.end_ms) for w in words] == [(20, 60), (90, 150), (190, 240)]
    assert all(0.85 < w.confidence < 0.95 for w in words) and dec.confidence == pytest.approx(0.9, abs=0.01)


def test_the_lexicon_and_the_language_model_choose_the_words(lexicon):
    # Greedy reads "cqt"; only lexicon words can be spelled.
    assert (
        decode(FlashlightCtcDecoder(VOCAB, lexicon), "_th_e_|_c_q_t__", rivals={10: ("a", 0.4, 0.55)}) == "the cat"
    )
    # 'b' a little ahead of 'c' acoustically: the language model's weight settles it.
    for alpha, expected in ((0.0, "the bat"), (1.0, "the cat")):
        dec = FlashlightCtcDecoder(VOCAB, lexicon, BeamConfig(alpha=alpha))
        assert decode(dec, "_th_e_|_b_a_t__", rivals={8: ("c", 0.45, 0.5)}) == expected


def test_double_letters_need_a_blank_between(tmp_path):
    logprobs, backoffs = kneser_ney([["al"], ["all"]], order=2)
    write_arpa(tmp_path / "lm.arpa", logprobs, backoffs)
    lexicon = FlashlightLexicon(tmp_path / "lm.arpa", VOCAB)
    assert decode(FlashlightCtcDecoder(VOCAB, lexicon), "_a_ll__") == "al"
    assert decode(FlashlightCtcDecoder(VOCAB, lexicon), "_a_l_l_") == "all"


def test_streaming_pushes_equal_one_push(lexicon):
    offline = FlashlightCtcDecoder(VOCAB, lexicon)
    assert decode(offline, LONG) == "the cat sat on the mat the dog sat on the log"
    for step in (1, 3, 16):
        streamed = FlashlightCtcDecoder(VOCAB, lexicon)
        assert decode(streamed, LONG, step=step) == offline.text
        assert streamed.words() == offline.words()


def test_pruning_commits_old_words_and_changes_nothing(lexicon):
    # A decoder that prunes every 120 frames down to 10 (plus the way back to a word): the same result,
    # however the frames are pushed, as one that never prunes.
    unpruned = FlashlightCtcDecoder(VOCAB, lexicon)
    pattern = LONG * 3
    expected = decode(unpruned, pattern)
    for step in (0, 1, 7):
        pruned = FlashlightCtcDecoder(VOCAB, lexicon, prune_at_frames=120, keep_frames=10)
        assert decode(pruned, pattern, step=step) == expected
        assert pruned.words() == unpruned.words()
        assert pruned._dropped > 0 and pruned._committed
    with pytest.raises(ValueError, match="keep_frames"):
        FlashlightCtcDecoder(VOCAB, lexicon, prune_at_frames=120, keep_frames=30)


def test_the_text_is_traced_back_every_trace_frames_as_if_after_every_push(lexicon):
    # Frame by frame, one decoder tracing back after every frame and one every 4 frames (and after each
    # prune): at each trace-back the second's text is the first's; until the next one its text, words and
    # confidence stay those of the last trace-back (words first read 3 frames later); the final is the same.
    kwargs = {"prune_at_frames": 120, "keep_frames": 10}
    every = FlashlightCtcDecoder(VOCAB, lexicon, trace_frames=1, **kwargs)
    sparse = FlashlightCtcDecoder(VOCAB, lexicon, trace_frames=4, **kwargs)
    ids, lps = frames(LONG * 3)
    shown, since, prunes, changes, late_reads = ("", [], 0.0), 0, 0, 0, 0
    for t in range(len(ids)):
        every.push(ids[t : t + 1], lps[t : t + 1], t)
        dropped = sparse._dropped
        changed = sparse.push(ids[t : t + 1], lps[t : t + 1], t)
        since += 1
        pruned = sparse._dropped != dropped
        prunes += pruned
        if since == 4 or pruned:
            since = 0
            assert sparse.text == every.text and changed == (sparse.text != shown[0])
            shown = (every.text, every.words(), every.confidence)
            changes += changed
        else:
            assert not changed and sparse.text == shown[0]
            if since == 3:
                assert (sparse.words(), sparse.confidence) == shown[1:]
                late_reads += bool(shown[1])
    assert prunes >= 2 and changes >= 10 and late_reads >= 10
    every.finalize()
    sparse.finalize()
    assert sparse.text == every.text == " ".join(["the cat sat on the mat the dog sat on the log"] * 3)
    assert sparse.words() == every.words()
    with pytest.raises(ValueError, match="trace_frames"):
        FlashlightCtcDecoder(VOCAB, lexicon, trace_frames=0)


def test_it_finds_what_the_python_search_finds(lexicon, arpa):
    lm = NgramLm.load(arpa)
    # (Each frame lists 3 tokens here: with fewer than max_tokens listed, the compiled search also tries
    # unlisted ones, at the third's log-prob, which the Python search never does. The engine lists 8.)
    patterns = [LONG, "__a_|_d_o_g_|_a_n_d_|_a_|_c_a_t_", "_i_|_s_a_w_|_th_e_|_b_a_t___"]
    for pattern in patterns:
        python = BeamCtcDecoder(VOCAB, lm)
        compiled = FlashlightCtcDecoder(VOCAB, lexicon)
        assert decode(compiled, pattern) == decode(python, pattern)
        assert [(w.word, w.start_ms, w.end_ms) for w in compiled.words()] == [
            (w.word, w.start_ms, w.end_ms) for w in python.words()
        ]


def test_homophones_are_told_apart_by_the_language_model(phonemes):
    lexicon, python_lexicon, _ = phonemes
    assert not lexicon.spelled and lexicon.size == python_lexicon.size
    decoder = FlashlightCtcDecoder(VOCAB, lexicon)
    assert decode(decoder, "_ai|so|d|kat__") == "i saw the cat"
    decoder.reset()
    assert decode(decoder, "_d|kat|flu__") == "the bat flew"
    assert [w.word for w in decoder.words()] == ["the", "bat", "flew"]


def test_homophones_the_language_model_cannot_tell_apart_keep_one(tmp_path):
    # "kat" spells cat, bat and hat; bat and hat are word-list words with the same unigram probability,
    # so they would tie exactly wherever they are heard, and the tie would fall by memory address.
    logprobs, backoffs = kneser_ney([["the", "cat"], ["a", "cat"]], order=2, extra_words={"bat", "hat"})
    write_arpa(tmp_path / "lm.arpa", logprobs, backoffs)
    lexicon = FlashlightLexicon(
        tmp_path / "lm.arpa", VOCAB, {"the": "d", "a": "a", "cat": "kat", "bat": "kat", "hat": "kat"}
    )
    assert sorted(lexicon.words) == ["a", "bat", "cat", "the"]
    assert lexicon.guess((ID["k"],)) == "cat" and lexicon.guess((ID["k"], ID["q"])) == "cat"
    assert lexicon.guess((ID["q"],)) is None


def test_interim_text_shows_words_not_units(phonemes):
    decoder = FlashlightCtcDecoder(VOCAB, phonemes[0])
    ids, lps = frames("_d|ka")
    assert decoder.push(ids, lps, 0)
    assert decoder.text.split()[0] == "the"
    assert decoder.text.split()[1] in {"cat", "bat"}  # the likeliest word "ka..." can become
    assert decoder.words()[-1].word == decoder.text.split()[1]
    ids, lps = frames("_d|ka_")
    decoder.reset()
    decoder.push(ids[:5], lps[:5], 0)
    assert not decoder.push(ids[5:], lps[5:], 5)  # a blank more: the same text


def test_one_hypothesis_interims_only_grow(phonemes):
    decoder = FlashlightCtcDecoder(VOCAB, phonemes[0], BeamConfig(beam_size=1))
    assert decoder.stable_interims
    ids, lps = frames("_ai|so|d|kat|flu__")
    shown = []
    for t in range(len(ids)):
        decoder.push(ids[t : t + 1], lps[t : t + 1], t)
        shown.append(decoder.text)
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(shown)), shown
    assert "i saw the" in shown
    decoder.finalize()
    assert decoder.text == "i saw the cat flew"


def test_reset_starts_a_new_utterance_and_bad_input_is_refused(lexicon):
    dec = FlashlightCtcDecoder(VOCAB, lexicon)
    decode(dec, "_th_e_")
    dec.reset()
    assert dec.text == "" and dec.words() == [] and dec.confidence == 0.0
    dec.finalize()
    assert dec.text == ""
    with pytest.raises(ValueError):
        dec.push(np.zeros((3,), np.int64), np.zeros((3,), np.float32), 0)
    with pytest.raises(ValueError):
        dec.push(np.full((2, 3), 99), np.zeros((2, 3), np.float32), 0)
    with pytest.raises(ValueError, match="another vocabulary"):
        FlashlightCtcDecoder(VOCAB[:-1], lexicon)


def test_loading_the_language_model_prints_nothing(arpa, capfd):
    FlashlightLexicon(arpa, VOCAB)
    assert capfd.readouterr() == ("", "")


def test_the_decoder_config_picks_the_compiled_search_when_installed():
    assert DecoderConfig().resolve(None).search == "python"  # the default, until it holds up end to end
    resolved = DecoderConfig(search="auto").resolve(None)
    assert resolved.kind == "beam" and resolved.search == "flashlight"
    assert DecoderConfig.from_dict(resolved.to_dict()) == resolved
    vocabulary = json.loads((DEFAULT_MODEL_DIR / "vocabulary.json").read_text())
    factory = DecoderFactory(resolved, vocabulary)
    a, b = factory(), factory()
    assert isinstance(a, FlashlightCtcDecoder) and a is not b and a.lexicon is b.lexicon
    python = DecoderFactory(dataclasses.replace(resolved, search="python"), vocabulary)()
    assert isinstance(python, BeamCtcDecoder)
    with pytest.raises(ValueError, match="beam search must be one of"):
        DecoderConfig(search="fast")


@needs_espeak
def test_the_default_model_on_speech_and_chunking_does_not_change_the_final():
    import torch

    from cosystream.app.evaluate import eval_runner, stream
    from cosystream.models import load_model

    torch.set_num_threads(1)
    model = load_model(None)
    runner = eval_runner(model, DecoderConfig().resolve(None).top_k)
    factory = DecoderFactory(DecoderConfig("beam", search="flashlight").resolve(None), model.vocabulary)
    decoder = factory()
    for text in ("please call me back tomorrow", "i would like to check my account balance"):
        audio = np.concatenate([silence(0.2), speech(text), silence(0.3)])
        outputs = list(stream(runner, audio))
        ids = np.concatenate([o[0] for o in outputs])
        lps = np.concatenate([o[1] for o in outputs])
        finals = set()
        for step in (1, 2, 16, len(ids)):
            decoder.reset()
            for first in range(0, len(ids), step):
                decoder.push(ids[first : first + step], lps[first : first + step], first)
            decoder.finalize()
            finals.add((decoder.text, tuple(decoder.words())))
        assert len(finals) == 1
        assert decoder.text == text
        assert all(w.start_ms < w.end_ms for w in decoder.words())


def test_alternatives_are_the_distinct_n_best_sorted_and_at_most_n(lexicon):
    dec = FlashlightCtcDecoder(VOCAB, lexicon)
    text = decode(dec, "_th_e_|_c_a_t__", rivals={8: ("b", 0.4, 0.5), 4: ("a", 0.3, 0.6)})
    alternatives = dec.alternatives(3)
    texts = [a.text for a in alternatives]
    assert texts[0] == text == "the cat"
    assert len(texts) == len(set(texts)) and 1 < len(texts) <= 3
    assert "the bat" in texts
    confidences = [a.confidence for a in alternatives]
    assert confidences == sorted(confidences, reverse=True)
    assert len(dec.alternatives(1)) == 1
