"""The words a decoder may spell: a pronunciation lexicon file and the trie over the model's tokens."""

from __future__ import annotations

import gzip
from array import array
from collections import ChainMap
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

from cosystream.decoding.lm import NgramLm

HOMOPHONES = 3  # words kept per spelling (the likeliest by unigram): the language model tells them apart
_NO_CHILDREN: Mapping[int, list] = MappingProxyType({})  # a leaf's (one, read-only, for every leaf)


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

    The trie is held in flat arrays, nodes numbered breadth first (a node's children are consecutive); a
    node's list is made when its parent's children are first asked (:meth:`children`), so only the nodes a
    search has reached exist as Python objects: until then ``children`` is the node's number. The default
    model's 168,130 nodes took 42 MB as lists and dicts; the arrays take 4.4 MB (docs/PERFORMANCE.md, "The
    decoder's data held compactly").
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
        self._vocabulary = list(vocabulary)
        self._homophones = homophones
        unigram = lm.unigram if lm is not None else (lambda w: 0.0)
        # The trie as a dict per node first (children in the order words first reach them), then numbered
        # breadth first into the arrays.
        edges: list[dict[int, int]] = [{}]
        ending: dict[int, list[str]] = {}
        for w in words:
            spelling = w if spellings is None else spellings.get(w)
            if not w or not spelling or any(ch not in self.ids for ch in spelling):
                continue
            node = 0
            for ch in spelling:
                token = self.ids[ch]
                child = edges[node].get(token)
                if child is None:
                    child = edges[node][token] = len(edges)
                    edges.append({})
                node = child
            here = ending.setdefault(node, [])
            if w not in here:
                here.append(w)
        numbered = [0]  # breadth first: node i's children are numbered first[i] to first[i + 1]
        self._token = array("B", [0])
        self._first = first = array("i")
        for node in numbered:
            first.append(len(numbered))
            numbered.extend(edges[node].values())
            self._token.extend(edges[node])
        first.append(len(numbered))
        del edges
        # Each node's words, likeliest first (homophones past the first ``homophones`` are kept for
        # :attr:`words` only), and bottom up the best word below it: its own best, else its children's, the
        # first of equals.
        self._words: list[str] = []
        self._at = at = array("i", [0])  # node i's words are _words[at[i]:at[i + 1]]
        best = array("d", bytes(8 * len(numbered)))
        self._guess = guess = array("i", [-1]) * len(numbered)  # an index into _words, -1: none
        self.size = 0
        for i, node in enumerate(numbered):
            here = ending.get(node)
            if here is not None:
                ranked = sorted((-unigram(w), w) for w in here)
                best[i], guess[i] = -ranked[0][0], len(self._words)
                self._words.extend(w for _, w in ranked)
                self.size += min(len(ranked), homophones)  # the words it can recognize
            else:
                best[i] = -1e9
            at.append(len(self._words))
        for i in range(len(numbered) - 1, -1, -1):
            for child in range(first[i], first[i + 1]):
                if best[child] > best[i]:
                    best[i], guess[i] = best[child], guess[child]
        best[0] = 0.0
        self._lookahead = best
        self._spellings: dict[str, str] | None = None
        self.root: list = [0, None, 0.0, self._words[guess[0]] if guess[0] >= 0 else None]  # (no word is "")
        self.children(self.root)

    def children(self, node: list) -> Mapping[int, list]:
        """``node``'s children by token, made the first time they are asked."""
        kids = node[0]
        if kids.__class__ is int:
            words, at, guess, lookahead, token = self._words, self._at, self._guess, self._lookahead, self._token
            homophones = self._homophones
            made = {}
            for j in range(self._first[kids], self._first[kids + 1]):
                start, end = at[j], at[j + 1]
                kept = tuple(words[start : min(end, start + homophones)]) if end > start else None
                made[token[j]] = [j, kept, lookahead[j], words[guess[j]]]  # (a word below: it has a guess)
            kids = node[0] = made or _NO_CHILDREN  # (two threads at once: both make equal ones, either is kept)
        return kids

    @property
    def words(self) -> Mapping[str, str]:
        """Every word in the trie -> its spelling; made the first time it is asked (phrase boosting asks)."""
        if self._spellings is None:
            vocabulary, token, first, at = self._vocabulary, self._token, self._first, self._at
            spelled = [""] * len(token)
            spellings: dict[str, str] = {}
            for i in range(len(token)):
                for child in range(first[i], first[i + 1]):
                    spelled[child] = spelled[i] + vocabulary[token[child]]
                for w in self._words[at[i] : at[i + 1]]:
                    spellings[w] = spelled[i]
            self._spellings = spellings
        return self._spellings

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
        other.__dict__.update(self.__dict__)  # (the arrays are shared: a node not on a path is made from them)
        other._spellings = ChainMap(new, self.words)
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
                    child = [dict(self.children(child)), *child[1:]]
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
