"""The words a decoder may spell: a pronunciation lexicon file and the trie over the model's tokens."""

from __future__ import annotations

import gzip
from collections import ChainMap
from collections.abc import Callable, Mapping
from pathlib import Path

from cosystream.decoding.lm import NgramLm

HOMOPHONES = 3  # words kept per spelling (the likeliest by unigram): the language model tells them apart


def read_spellings(path: str | Path) -> dict[str, str]:
    """A pronunciation lexicon file: ``word<TAB>spelling`` per line, the spelling in the model's
    one-character tokens (gzip when the name ends in .gz)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    spellings: dict[str, str] = {}
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            word, tab, spelling = line.rstrip("\n").partition("\t")
            if not tab or not word or not spelling:
                raise ValueError(f"{path}:{number}: expected 'word<TAB>spelling'")
            spellings[word] = spelling
    return spellings


class Lexicon:
    """A trie of the words the beam search may spell, over the model's tokens.

    A word is spelled by its letters, or, with ``spellings`` (word -> a string of one-character tokens, e.g.
    a phoneme model's pronunciations), by that string. Words with the same spelling (homophones) share a
    node: the ``homophones`` likeliest by unigram are kept, and each completes the spelling as a separate
    hypothesis, so the language model's context chooses among them.

    Node: ``[children, words, lookahead, guess]``: ``words`` a tuple (or None), ``lookahead`` the best unigram
    ln P of the words below (0 at the root), ``guess`` that word (shown for a word still being spelled).
    """

    def __init__(
        self,
        words,
        vocabulary: list[str],
        lm: NgramLm | None = None,
        spellings: dict[str, str] | None = None,
        homophones: int = HOMOPHONES,
    ) -> None:
        self.ids = {ch: i for i, ch in enumerate(vocabulary) if i > 0 and ch != " "}
        self.spelled = spellings is None  # words are spelled by their own letters
        self.root: list = [{}, None, 0.0, None]
        self.size = 0
        self.words: Mapping[str, str] = {}  # word -> its spelling, for every word in the trie
        unigram = lm.unigram if lm is not None else (lambda w: 0.0)
        for w in words:
            spelling = w if spellings is None else spellings.get(w)
            if not w or not spelling or any(ch not in self.ids for ch in spelling):
                continue
            self.words[w] = spelling
            node = self.root
            for ch in spelling:
                node = node[0].setdefault(self.ids[ch], [{}, None, 0.0, None])
            if node[1] is None:
                node[1] = (w,)
            elif w not in node[1]:
                node[1] = (*node[1], w)
        self._settle(self.root, unigram, homophones, 0)

    def _settle(self, node: list, unigram, homophones: int, depth: int) -> tuple[float, str | None]:
        """Rank each node's homophones and store the best reachable word and its unigram ln P below it."""
        best, guess = -1e9, None
        if node[1] is not None:
            ranked = sorted((-unigram(w), w) for w in node[1])
            node[1] = tuple(w for _, w in ranked[:homophones])
            self.size += len(node[1])  # the words it can recognize
            best, guess = -ranked[0][0], ranked[0][1]
        for child in node[0].values():
            score, word = self._settle(child, unigram, homophones, depth + 1)
            if score > best:
                best, guess = score, word
        node[2] = best if depth else 0.0
        node[3] = guess
        return best, guess

    def extended(
        self, new: dict[str, str], lookahead: dict[str, tuple[float, float]], spelling_of: Callable[[str], str]
    ) -> Lexicon:
        """This lexicon plus the words ``new`` (word -> spelling), and with the lookahead on the path of each
        word of ``lookahead`` (word -> (unigram ln P, bonus)) at least its unigram plus the share of the bonus
        its spelling has reached at that node (the whole bonus at its end, as a context graph's per-token
        score: a hypothesis is credited as it spells the word, not before); that word is then the guess shown
        while it is spelled. Only the nodes on those paths are copied; every other node is shared with this
        lexicon, which is unchanged."""
        other = object.__new__(Lexicon)
        other.ids, other.spelled = self.ids, self.spelled
        other.words = ChainMap(new, self.words)
        other.size = self.size + len(new)
        other.root = root = [dict(self.root[0]), *self.root[1:]]
        copied = {id(root)}
        for word in {**dict.fromkeys(new), **dict.fromkeys(lookahead)}:
            unigram, bonus = lookahead.get(word, (-1e9, 0.0))
            spelling = spelling_of(word)
            node = root
            for depth, ch in enumerate(spelling, 1):
                score = unigram + bonus * depth / len(spelling)
                token = self.ids[ch]
                child = node[0].get(token)
                if child is None:
                    child = [{}, None, -1e9, None]
                elif id(child) not in copied:
                    child = [dict(child[0]), *child[1:]]
                copied.add(id(child))
                node[0][token] = child
                if score > child[2]:
                    child[2], child[3] = score, word
                    child[4:] = [bonus * depth / len(spelling)]  # (a stalled spelling loses it: beam.py)
                node = child
            if node[1] is None or word not in node[1]:
                node[1] = (word, *(node[1] or ()))  # (a homophone the trie had left out comes back too)
        return other

    @classmethod
    def from_lm(cls, lm: NgramLm, vocabulary: list[str], spellings: dict[str, str] | None = None) -> Lexicon:
        """The language model's words (``<s>``, ``</s>`` and ``<unk>`` left out)."""
        return cls([w for w in lm.words if lm.known(w)], vocabulary, lm, spellings)
