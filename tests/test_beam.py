"""Word n-gram language models (ARPA), the Kneser-Ney builder, and lexicon-constrained CTC beam search."""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import random
from collections import Counter

import numpy as np
import pytest

from cosystream.app.commands.common import add_decoder_args
from cosystream.decoding.beam import BeamConfig, BeamCtcDecoder, _lse
from cosystream.decoding.config import DecoderConfig, DecoderFactory
from cosystream.decoding.greedy import CtcDecoder
from cosystream.decoding.lexicon import Lexicon
from cosystream.decoding.lm import NgramLm
from cosystream.models.loading import DEFAULT_MODEL_DIR
from training.lm import _discounts, interpolate, kneser_ney, perplexity, write_arpa
from training.text import wordnet_examples

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


def total_probability(lm: NgramLm, history: list[str]) -> float:
    state = lm.start()
    for w in history:
        state = lm.score(state, w)[1]
    return sum(math.exp(lm.score(state, w)[0]) for w in lm.words if w != "<s>")


# --- the language model --------------------------------------------------------------------------------------


def test_kneser_ney_is_a_distribution_in_every_context(lm):
    for history in ([], ["the"], ["the", "cat"], ["a", "dog"], ["never", "seen"]):
        assert total_probability(lm, history) == pytest.approx(1.0, abs=1e-3), history


def test_seen_continuations_beat_unseen(lm):
    state = lm.score(lm.score(lm.start(), "the")[1], "cat")[1]
    assert lm.score(state, "sat")[0] > lm.score(state, "flew")[0]
    assert lm.score(lm.start(), "the")[0] > lm.score(lm.start(), "mat")[0]
    # Word-list words are known, with the probability left for unseen words.
    assert lm.known("cab") and lm.score((), "cab")[0] < lm.score((), "cat")[0]
    assert not lm.known("zebra") and lm.score((), "zebra")[0] == lm.score((), "<unk>")[0]


def markov_text(seed: int, words: list[str], n: int = 600) -> list[list[str]]:
    """Sentences from a random bigram chain with Zipf-like choices: n-grams seen 1, 2, 3, 4+ times."""
    rng = random.Random(seed)
    follow = {w: rng.sample(words, 6) for w in words}
    out = []
    for _ in range(n):
        s = [rng.choice(words[:5])]
        while len(s) < rng.randint(3, 9):
            nxt = follow[s[-1]]
            s.append(nxt[min(int(rng.expovariate(0.8)), len(nxt) - 1)])
        out.append(s)
    return out


def load(tmp_path, model, name: str) -> NgramLm:
    write_arpa(tmp_path / name, *model)
    return NgramLm.load(tmp_path / name)


def test_modified_kneser_ney_discounts_follow_the_count_of_counts():
    counts = Counter({**{i: 1 for i in range(1000)}, **{i: 2 for i in range(1000, 1300)}})
    counts.update({i: 3 for i in range(2000, 2150)} | {i: 4 for i in range(3000, 3090)} | {"frequent": 50})
    y = 1000 / (1000 + 2 * 300)
    assert _discounts(counts, None) == pytest.approx(
        (1 - 2 * y * 300 / 1000, 2 - 3 * y * 150 / 300, 3 - 4 * y * 90 / 150)
    )
    assert _discounts(counts, 0.6) == (0.6, 0.6, 0.6)
    assert _discounts(Counter({"a": 1, "b": 1}), None) == (0.75, 0.75, 0.75)  # too few counts to estimate


def test_modified_kneser_ney_is_a_distribution_and_fits_better(tmp_path):
    words = [f"w{i}" for i in range(40)]
    text = markov_text(1, words)
    fit, dev = text[:500], text[500:]
    modified, plain = kneser_ney(fit, 3, None, set(words)), kneser_ney(fit, 3, 0.75, set(words))
    assert modified != plain
    lm = load(tmp_path, modified, "m.arpa")
    for history in ([], ["w0"], ["w0", words[-1]], [words[-1], words[-2]]):
        assert total_probability(lm, history) == pytest.approx(1.0, abs=1e-3), history
    assert perplexity(modified, dev) < perplexity(plain, dev)


def test_interpolation_is_the_weighted_mixture_on_every_listed_ngram(tmp_path):
    words = [f"w{i}" for i in range(40)]
    a_text, b_text = markov_text(1, words), markov_text(2, words)
    a, b = kneser_ney(a_text[:500], 3, None, set(words)), kneser_ney(b_text[:500], 3, None, set(words))
    mixed = interpolate([a, b], [0.7, 0.3])
    lm, la, lb = load(tmp_path, mixed, "mix.arpa"), load(tmp_path, a, "a.arpa"), load(tmp_path, b, "b.arpa")
    for gram in random.Random(0).sample(sorted(g for g in mixed[0] if g[0] != "<s>" or len(g) > 1), 200):
        states = []
        for model in (lm, la, lb):
            state = model.start() if gram[0] == "<s>" else ()
            for w in gram[1 if gram[0] == "<s>" else 0 : -1]:
                state = model.score(state, w)[1]
            states.append(math.exp(model.score(state, gram[-1])[0]))
        assert states[0] == pytest.approx(0.7 * states[1] + 0.3 * states[2], rel=2e-3), gram
    for history in ([], ["w0"], ["w3", "w7"], ["w1", words[-1]]):
        assert total_probability(lm, history) == pytest.approx(1.0, abs=1e-3), history
    # Each side's held-out text: the mixture beats the model that never saw that kind of text.
    assert perplexity(mixed, b_text[500:]) < perplexity(a, b_text[500:])
    assert perplexity(mixed, a_text[500:]) < perplexity(b, a_text[500:])


def test_wordnet_usage_examples_are_normalized_sentences(tmp_path):
    (tmp_path / "data.noun").write_text(
        "  1 This software and database is being provided to you, the LICENSEE, by Princeton University\n"
        '00001740 03 n 01 entity 0 003 ~ 00001930 n 0000 | that which is perceived; "an entity of 3 parts"\n'
        '00002137 03 n 02 abstraction 0 | a general concept; "ok"; "it\'s abstract, isn\'t it?"\n'
    )
    (tmp_path / "data.verb").write_text('00001740 29 v 01 breathe 0 | draw air; "She breathed in the air"\n')
    for pos in ("adj", "adv"):
        (tmp_path / f"data.{pos}").write_text("")
    assert wordnet_examples(tmp_path) == [
        "an entity of three parts",
        "it's abstract isn't it",
        "she breathed in the air",
    ]


def test_arpa_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.arpa"
    bad.write_text("\\data\\\nngram 1=1\n\n\\1-grams:\nnot-a-number\tword\n\\end\\\n")
    with pytest.raises(ValueError, match=r"bad\.arpa:5"):
        NgramLm.load(bad)
    (tmp_path / "empty.arpa").write_text("hello\n")
    with pytest.raises(ValueError, match="not an ARPA file"):
        NgramLm.load(tmp_path / "empty.arpa")


class ArpaDicts:
    """The ARPA read the plain way, every n-gram a dict entry: the reference :class:`NgramLm`'s trie must score
    exactly as (the representation it replaced)."""

    def __init__(self, text: str) -> None:
        self.probs, self.bows, self.ids, section = {}, {}, {}, 0
        for line in text.splitlines():
            if line.startswith("\\") and line.endswith("-grams:"):
                section = int(line[1:].split("-")[0])
            elif section and line.strip() and not line.startswith("\\"):
                parts = line.split()
                key = tuple(self.ids.setdefault(w, len(self.ids)) for w in parts[1 : section + 1])
                self.probs[key] = float(parts[0]) * math.log(10)
                if len(parts) > section + 1:
                    self.bows[key] = float(parts[section + 1]) * math.log(10)
        self.order = max(map(len, self.probs))

    def score(self, state: tuple[int, ...], word: int) -> tuple[float, tuple[int, ...]]:
        if word < 0:
            return -30.0 * math.log(10), ()
        history, bow = state, 0.0
        while (*history, word) not in self.probs:
            if not history:
                return bow - 30.0 * math.log(10), ()
            bow += self.bows.get(history, 0.0)
            history = history[1:]
        nxt = (*state, word)[-(self.order - 1) :]
        while nxt and nxt not in self.bows:
            nxt = nxt[1:]
        return bow + self.probs[(*history, word)], nxt


def assert_scores_as_the_arpa(lm: NgramLm, reference: ArpaDicts, samples: int, seed: int = 0) -> int:
    """Every sampled n-gram's own score, its backed-off scores (a shorter state; a random word after its
    context) and an unknown word's, equal to the reference's; returns how many were compared."""
    assert lm.words == list(reference.ids) and lm.order == reference.order
    rng = random.Random(seed)
    grams = list(reference.probs)
    compared = 0
    for gram in rng.sample(grams, min(samples, len(grams))):
        for state in (gram[:-1], gram[1:-1], (*gram[:-1], rng.randrange(len(lm.words)))[-(lm.order - 1) :]):
            for word in (gram[-1], rng.randrange(len(lm.words)), -1):
                lm._cache.clear()
                assert lm.score(state, word) == reference.score(state, word), (state, word)
                compared += 1
        assert lm.score(gram[:-1], "no-such-word") == reference.score(gram[:-1], lm.unk)
    for word in lm.words:
        assert lm.unigram(word) == reference.score((), lm.ids[word])[0]
    return compared


def test_the_trie_scores_as_the_arpa_file_says(tmp_path):
    # A 4-gram model listing a trigram whose context ("b c") is no bigram, an n-gram twice (the last counts),
    # a context without a back-off, and no <unk>.
    arpa = """\\data\\
ngram 1=5
ngram 2=4
ngram 3=3
ngram 4=1

\\1-grams:
-1.0\t<s>\t-0.5
-0.7\ta\t-0.3
-0.9\tb\t-0.25
-1.1\tc
-0.8\t</s>

\\2-grams:
-0.2\t<s> a\t-0.1
-0.4\ta b\t-0.2
-0.3\ta b\t-0.15
-0.6\tb a

\\3-grams:
-0.1\t<s> a b\t-0.05
-0.05\tb c a
-0.3\ta b a

\\4-grams:
-0.02\t<s> a b a

\\end\\
"""
    (tmp_path / "small.arpa").write_text(arpa)
    lm, reference = NgramLm.load(tmp_path / "small.arpa"), ArpaDicts(arpa)
    assert lm.score((1,), 2) == (-0.3 * math.log(10), (1, 2))  # "a b": the last of its two lines
    # "a b c" -> "b c" (no bigram) -> "c": bow(a b) + bow(b) + p(c)
    assert lm.score((1, 2), 3) == (pytest.approx(math.log(10) * (-0.15 - 0.25 - 1.1)), ())
    assert lm.score((2, 3), 1) == (-0.05 * math.log(10), (1,))  # "b c a", listed with no "b c"
    assert assert_scores_as_the_arpa(lm, reference, 20) > 100
    for state in [(), (0,), (1,), (2,), (3,), (1, 2), (2, 3), (0, 1, 2), (1, 2, 3), (2, 3, 1)]:
        for word in range(-1, len(lm.words)):
            lm._cache.clear()
            assert lm.score(state, word) == reference.score(state, word), (state, word)


def test_the_default_models_lm_scores_as_its_arpa_file_says():
    path = DEFAULT_MODEL_DIR / "lm.arpa.gz"
    reference = ArpaDicts(gzip.decompress(path.read_bytes()).decode())
    assert assert_scores_as_the_arpa(NgramLm.load(path), reference, 3000) == 3000 * 9


def test_the_kneser_ney_lm_scores_as_its_arpa_file_says(tmp_path):
    logprobs, backoffs = kneser_ney([s.split() for s in SENTENCES], order=3, extra_words={"cab", "hat"})
    write_arpa(tmp_path / "kn.arpa", logprobs, backoffs)
    reference = ArpaDicts((tmp_path / "kn.arpa").read_text())
    assert assert_scores_as_the_arpa(NgramLm.load(tmp_path / "kn.arpa"), reference, 1000) > 100


def test_the_score_cache_is_bounded(lm, monkeypatch):
    monkeypatch.setattr("cosystream.decoding.lm.CACHE_ENTRIES", 4)
    lm._cache.clear()
    expected = [lm.score(lm.start(), w) for w in lm.words]
    assert len(lm._cache) <= 4 and [lm.score(lm.start(), w) for w in lm.words] == expected


# --- beam search ---------------------------------------------------------------------------------------------


def test_clear_audio_decodes_to_the_spelled_words(lm):
    dec = BeamCtcDecoder(VOCAB, lm)
    assert decode(dec, "__th_e_|_cc_a_t__|_s_a_t_") == "the cat sat"
    words = dec.words()
    assert [w.word for w in words] == ["the", "cat", "sat"]
    assert words[0].start_ms == 20 and words[1].start_ms == 90 and all(w.end_ms > w.start_ms for w in words)


def eager_trie(words, ids: dict[str, int], unigram, spellings: dict[str, str] | None, homophones: int) -> list:
    """The lexicon's trie built node by node as lists and dicts, its form before it was held in arrays."""
    root: list = [{}, None, 0.0, None]
    for w in words:
        spelling = w if spellings is None else spellings.get(w)
        if not w or not spelling or any(ch not in ids for ch in spelling):
            continue
        node = root
        for ch in spelling:
            node = node[0].setdefault(ids[ch], [{}, None, 0.0, None])
        node[1] = (w,) if node[1] is None else node[1] if w in node[1] else (*node[1], w)

    def settle(node: list, depth: int) -> tuple[float, str | None]:
        best, guess = -1e9, None
        if node[1] is not None:
            ranked = sorted((-unigram(w), w) for w in node[1])
            node[1] = tuple(w for _, w in ranked[:homophones])
            best, guess = -ranked[0][0], ranked[0][1]
        for child in node[0].values():
            score, word = settle(child, depth + 1)
            if score > best:  # the first of equals
                best, guess = score, word
        node[2], node[3] = best if depth else 0.0, guess
        return best, guess

    settle(root, 0)
    return root


def assert_same_trie(lexicon: Lexicon, expected: list) -> int:
    """Walks both tries, every node and child in order; returns how many nodes."""
    nodes, pending = 0, [(lexicon.root, expected)]
    while pending:
        node, want = pending.pop()
        nodes += 1
        assert node[1:] == want[1:]
        children = lexicon.children(node)
        assert list(children) == list(want[0])
        pending.extend(zip(children.values(), want[0].values(), strict=True))
    return nodes


@pytest.mark.parametrize("homophones", [1, 3])
def test_the_trie_held_in_arrays_is_the_trie_of_its_words(lm, homophones):
    words = [w for w in lm.words if lm.known(w)]
    lexicon = Lexicon(words, VOCAB, lm, homophones=homophones)
    assert all(child[0].__class__ is int for child in lexicon.root[0].values())  # none made below the root yet
    ids = lexicon.ids
    assert assert_same_trie(lexicon, eager_trie(words, ids, lm.unigram, None, homophones)) > len(words)
    assert dict(lexicon.words) == {w: w for w in words}
    # Homophones, and ties everywhere (no language model: every unigram 0): the first of equals is kept.
    spellings = {"read": "red", "red": "red", "reed": "rid", "rid": "rid", "a": "a", "an": "an", "and": "an"}
    spellings |= {"ant": "ant", "bad": "b'd", "oops": "0"}  # (0: no such token, left out)
    words = ["reed", "read", "an", "ant", "red", "a", "rid", "bad", "and", "oops"]
    lexicon = Lexicon(words, VOCAB, spellings=spellings, homophones=homophones)
    assert assert_same_trie(lexicon, eager_trie(words, ids, lambda w: 0.0, spellings, homophones)) == 12
    assert dict(lexicon.words) == {w: spellings[w] for w in words if w != "oops"}
    assert lexicon.size == (6 if homophones == 1 else 9)


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


def test_score_prune_drops_prefixes_far_behind_the_best(lm):
    # At frame 8 'b' (p 0.01) trails 'c' (p 0.9) by ~4.5 nats: a wide search keeps "the b..." as a hypothesis,
    # a score_prune of 3 nats drops it (and everything else that far behind); the best is the same.
    ids, lps = frames("_th_e_|_c", rivals={8: ("b", 0.01, 0.9)})
    kept = {}
    for prune in (math.inf, 3.0):
        dec = BeamCtcDecoder(VOCAB, lm, config=BeamConfig(score_prune=prune))
        dec.push(ids, lps, 0)
        kept[prune] = {p.text: dec._rank(p) for p in dec._beams.values()}
        assert dec.text == "the c"
    assert "the b" in kept[math.inf]
    assert "the b" not in kept[3.0] and len(kept[3.0]) < len(kept[math.inf])
    assert max(kept[3.0].values()) - min(kept[3.0].values()) <= 3.0


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


def test_the_kept_totals_and_best_match_a_fresh_ranking_after_every_push(lm):
    # Each prefix keeps lse(pb, pnb) from the end of its last frame and the search keeps its best; both must
    # equal what recomputing from pb and pnb gives, through stepped frames and frames the blank skip carries
    # (blanks at 0.995 >= blank_skip), with rivals so that several prefixes compete.
    pattern = "__th_e__|_c_a_t__|_s_a_t___"
    ids, lps = frames(pattern, sure=0.995, rivals={4: ("a", 0.3, 0.6), 10: ("b", 0.4, 0.5), 18: ("o", 0.3, 0.6)})
    dec = BeamCtcDecoder(VOCAB, lm)
    carried = 0
    for t in range(len(ids)):
        carried += bool(lps[t][ids[t] == 0].max(initial=-math.inf) >= math.log(dec.config.blank_skip))
        dec.push(ids[t : t + 1], lps[t : t + 1], t)
        for p in dec._beams.values():
            assert p.tot == _lse(p.pb, p.pnb)
        assert dec._best is max(dec._beams.values(), key=dec._rank)
    assert carried >= 8 and len(dec._beams) > 1
    dec.finalize()
    assert dec.text == "the cat sat"


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
    # The embedded model ships a language model and its pronunciation lexicon: auto means beam search.
    resolved = DecoderConfig().resolve(None)
    assert resolved.kind == "beam" and resolved.lm_path.endswith("lm.arpa.gz") and resolved.top_k > 1
    assert resolved.lexicon_path.endswith("lexicon.tsv.gz")
    # A model directory without one decodes greedily; asking for beam search there is an error.
    assert DecoderConfig().resolve(str(tmp_path)).kind == "greedy"
    assert DecoderConfig("greedy").resolve(str(tmp_path)).top_k == 1
    with pytest.raises(ValueError, match="needs a language model"):
        DecoderConfig("beam").resolve(str(tmp_path))
    with pytest.raises(ValueError, match="no such file"):
        DecoderConfig(lm_path=str(tmp_path / "missing.arpa")).resolve(None)
    with pytest.raises(ValueError):
        DecoderConfig("fancy")
    # The config round-trips through a dict.
    assert DecoderConfig.from_dict(resolved.to_dict()) == resolved
    # The Python search (the compiled one, when flashlight-text is installed, is tests/test_flashlight.py's).
    python = dataclasses.replace(resolved, search="python")
    factory = DecoderFactory(python, json.loads((DEFAULT_MODEL_DIR / "vocabulary.json").read_text()))
    a, b = factory(), factory()
    assert isinstance(a, BeamCtcDecoder) and a is not b and a.lm is b.lm


def test_the_decoding_flags_help_states_the_beam_defaults():
    # The help reads the numbers off BeamConfig: this pins that it states them where a reader looks.
    parser = argparse.ArgumentParser()
    add_decoder_args(parser)
    text = " ".join(parser.format_help().split())
    defaults = BeamConfig()
    assert f"hypotheses kept per frame (default {defaults.beam_size})" in text
    assert f"language model weight (default {defaults.alpha})" in text
    assert f"score added per word, nats (default {defaults.beta})" in text


def test_without_flashlight_text_the_python_search_stands_in(monkeypatch):
    from cosystream.decoding import flashlight

    monkeypatch.setattr(flashlight, "KenLM", None)
    assert not flashlight.available()
    resolved = DecoderConfig(search="auto").resolve(None)
    assert resolved.kind == "beam" and resolved.search == "python"
    factory = DecoderFactory(resolved, json.loads((DEFAULT_MODEL_DIR / "vocabulary.json").read_text()))
    assert isinstance(factory(), BeamCtcDecoder)
    with pytest.raises(ValueError, match="pip install flashlight-text"):
        DecoderConfig("beam", search="flashlight").resolve(None)


def test_alternatives_are_the_distinct_n_best_sorted_and_at_most_n(lm):
    # 'b' a little behind 'c' and 'h' behind the second 't': the beam holds "the cat", "the bat", "the hat"...
    dec = BeamCtcDecoder(VOCAB, lm)
    text = decode(dec, "_th_e_|_c_a_t__", rivals={8: ("b", 0.4, 0.5), 4: ("a", 0.3, 0.6)})
    alternatives = dec.alternatives(3)
    texts = [a.text for a in alternatives]
    assert texts[0] == text == "the cat"
    assert len(texts) == len(set(texts)) and 1 < len(texts) <= 3
    assert "the bat" in texts
    confidences = [a.confidence for a in alternatives]
    assert confidences == sorted(confidences, reverse=True)
    assert confidences[0] == pytest.approx(dec.confidence)
    assert len(dec.alternatives(1)) == 1


def test_greedy_decoding_has_one_alternative():
    dec = CtcDecoder(VOCAB)
    decode(dec, "_th_e_|_c_a_t__")
    assert [a.text for a in dec.alternatives(5)] == ["the cat"]
