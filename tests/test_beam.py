"""Word n-gram language models (ARPA), the Kneser-Ney builder, and lexicon-constrained CTC beam search."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cosystream.server.beam import BeamConfig, BeamCtcDecoder, Lexicon
from cosystream.server.ctc import CtcDecoder
from cosystream.server.decoding import DecoderConfig, DecoderFactory
from cosystream.server.lm import NgramLm
from training.lm import kneser_ney, write_arpa

VOCAB = ["<blank>", " ", "'", *"abcdefghijklmnopqrstuvwxyz"]
ID = {s: i for i, s in enumerate(VOCAB)}

SENTENCES = [
    "the cat sat on the mat",
    "the dog sat on the log",
    "a cat and a dog",
    "the cat ate",
    "the bat flew",
    "i saw the cat",
]


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> NgramLm:
    logprobs, backoffs = kneser_ney([s.split() for s in SENTENCES], order=3, extra_words={"cab", "hat"})
    path = tmp_path_factory.mktemp("lm") / "lm.arpa.gz"
    write_arpa(path, logprobs, backoffs)
    return NgramLm.load(path)


def frames(pattern: str, sure: float = 0.9, rivals: dict | None = None):
    """Per frame of ``pattern`` ('_' blank, '|' word break): top-3 ids and log-probs, best first.

    ``rivals`` maps a frame index to ``(token, p_token, p_pattern)``: a competitor and both probabilities."""
    ids, lps = [], []
    rivals = rivals or {}
    for t, ch in enumerate(pattern):
        tok = ID[{"_": "<blank>", "|": " "}.get(ch, ch)]
        row = {tok: sure}
        if t in rivals:
            other, p, mine = rivals[t]
            row = {tok: mine, ID[other]: p}
        rest = (1.0 - sum(row.values())) / 2
        for filler in (0, ID["q"], ID["z"]):
            if len(row) < 3 and filler not in row:
                row[filler] = rest
        best = sorted(row.items(), key=lambda kv: -kv[1])[:3]
        ids.append([k for k, _ in best])
        lps.append([math.log(max(p, 1e-9)) for _, p in best])
    return np.array(ids, np.int64), np.array(lps, np.float32)


def decode(decoder, pattern: str, step: int = 0, **kwargs) -> str:
    ids, lps = frames(pattern, **kwargs)
    step = step or len(ids)
    for start in range(0, len(ids), step):
        decoder.push(ids[start : start + step], lps[start : start + step], start)
    decoder.finalize()
    return decoder.text


# --- the language model --------------------------------------------------------------------------------------


def test_kneser_ney_is_a_distribution_in_every_context(lm):
    words = [w for w in lm.words if w != "<s>"]
    for history in ([], ["the"], ["the", "cat"], ["a", "dog"], ["never", "seen"]):
        state = lm.start()
        for w in history:
            state = lm.score(state, w)[1]
        total = sum(math.exp(lm.score(state, w)[0]) for w in words)
        assert total == pytest.approx(1.0, abs=1e-3), history


def test_seen_continuations_beat_unseen(lm):
    state = lm.score(lm.score(lm.start(), "the")[1], "cat")[1]
    assert lm.score(state, "sat")[0] > lm.score(state, "flew")[0]
    assert lm.score(lm.start(), "the")[0] > lm.score(lm.start(), "mat")[0]
    # Word-list words are known, with the probability left for unseen words.
    assert lm.known("cab") and lm.score((), "cab")[0] < lm.score((), "cat")[0]
    assert not lm.known("zebra") and lm.score((), "zebra")[0] == lm.score((), "<unk>")[0]


def test_arpa_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.arpa"
    bad.write_text("\\data\\\nngram 1=1\n\n\\1-grams:\nnot-a-number\tword\n\\end\\\n")
    with pytest.raises(ValueError, match=r"bad\.arpa:5"):
        NgramLm.load(bad)
    (tmp_path / "empty.arpa").write_text("hello\n")
    with pytest.raises(ValueError, match="not an ARPA file"):
        NgramLm.load(tmp_path / "empty.arpa")


# --- beam search ---------------------------------------------------------------------------------------------


def test_clear_audio_decodes_to_the_spelled_words(lm):
    dec = BeamCtcDecoder(VOCAB, lm)
    assert decode(dec, "__th_e_|_cc_a_t__|_s_a_t_") == "the cat sat"
    words = dec.words()
    assert [w.word for w in words] == ["the", "cat", "sat"]
    assert words[0].start_ms == 20 and words[1].start_ms == 90 and all(w.end_ms > w.start_ms for w in words)


def test_the_lexicon_turns_a_misspelling_into_a_word(lm):
    # Greedy reads "cqt"; the beam search may only spell lexicon words and finds "cat".
    pattern = "_th_e_|_c_q_t__"
    rivals = {10: ("a", 0.4, 0.55)}
    greedy = CtcDecoder(VOCAB)
    ids, lps = frames(pattern, rivals=rivals)
    greedy.push(ids, lps, 0)
    assert greedy.text == "the cqt"
    assert decode(BeamCtcDecoder(VOCAB, lm), pattern, rivals=rivals) == "the cat"


@pytest.mark.parametrize(("alpha", "expected"), [(0.0, "the bat"), (1.0, "the cat")])
def test_the_language_model_settles_an_acoustic_near_tie(lm, alpha, expected):
    # 'b' is a little ahead of 'c' acoustically; both spell a word, and "the cat" is the likelier text.
    dec = BeamCtcDecoder(VOCAB, lm, config=BeamConfig(alpha=alpha))
    assert decode(dec, "_th_e_|_b_a_t__", rivals={8: ("c", 0.45, 0.5)}) == expected


def test_double_letters_need_a_blank_between(lm):
    # "ll" in a row is one 'l'; "l_l" is two. Neither "cal" nor "call" is a word, "all"-like checks via
    # the lexicon: build one with those words.
    lexicon = Lexicon(["al", "all"], VOCAB, lm)
    assert decode(BeamCtcDecoder(VOCAB, lm, lexicon), "_a_ll__") == "al"
    assert decode(BeamCtcDecoder(VOCAB, lm, lexicon), "_a_l_l_") == "all"


def test_streaming_pushes_equal_one_push(lm):
    pattern = "__th_e_|_cc_a_t__|_s_a_t_|_o_n_|_th_e_|_m_a_t___"
    offline = decode(BeamCtcDecoder(VOCAB, lm), pattern)
    for step in (1, 3, 16):
        assert decode(BeamCtcDecoder(VOCAB, lm), pattern, step=step) == offline


def test_reset_starts_a_new_utterance_and_bad_input_is_refused(lm):
    dec = BeamCtcDecoder(VOCAB, lm)
    decode(dec, "_th_e_")
    dec.reset()
    assert dec.text == "" and dec.words() == [] and dec.confidence == 0.0
    with pytest.raises(ValueError):
        dec.push(np.zeros((3,), np.int64), np.zeros((3,), np.float32), 0)
    with pytest.raises(ValueError):
        dec.push(np.full((2, 3), 99), np.zeros((2, 3), np.float32), 0)


def test_decoder_config_resolves_against_the_model(tmp_path, lm):
    # The embedded model ships a language model: auto means beam search with it.
    resolved = DecoderConfig().resolve(None)
    assert resolved.kind == "beam" and resolved.lm_path.endswith("lm.arpa.gz") and resolved.top_k > 1
    # A model directory without one decodes greedily; asking for beam search there is an error.
    assert DecoderConfig().resolve(str(tmp_path)).kind == "greedy"
    assert DecoderConfig("greedy").resolve(None).top_k == 1
    with pytest.raises(ValueError, match="needs a language model"):
        DecoderConfig("beam").resolve(str(tmp_path))
    with pytest.raises(ValueError, match="no such file"):
        DecoderConfig(lm_path=str(tmp_path / "missing.arpa")).resolve(None)
    with pytest.raises(ValueError):
        DecoderConfig("fancy")
    # The config crosses the engine -> frontend HELLO as a dict.
    assert DecoderConfig.from_dict(resolved.to_dict()) == resolved
    factory = DecoderFactory(resolved, VOCAB)
    a, b = factory(), factory()
    assert isinstance(a, BeamCtcDecoder) and a is not b and a.lm is b.lm
