"""Word n-gram language models in the ARPA format, for CTC beam search.

ARPA is the plain-text back-off format SRILM, KenLM (``lmplz``) and the ``training.lm`` builder write, so
any such model (optionally gzipped) can be plugged in. Probabilities are kept as natural logs.
``score(state, word)`` returns ``(log P(word | state), next_state)``, where a state is the tuple of the
last ``order - 1`` word ids; unknown words score ``<unk>`` (or a floor when the model has none).

The n-grams are held as a trie in flat arrays (as KenLM's ``trie`` binary format holds them), not as
Python objects: the unigrams are indexed by word id; the n-grams of each higher order are sorted by their
context's index in the order below, then by word, so a context's continuations are one contiguous run
found by bisection. The default model's 391,713 n-grams take 8 MB this way; as dicts keyed by tuples of ids
they took 58 MB (docs/PERFORMANCE.md, "The decoder's data held compactly"). Values are the float64 the text
gives, times ln 10, so scores are exactly what the ARPA says.
"""

from __future__ import annotations

import gzip
import math
from array import array
from bisect import bisect_left
from pathlib import Path

import numpy as np

LN10 = math.log(10.0)
BOS, EOS, UNK = "<s>", "</s>", "<unk>"
_UNK_FLOOR = -30.0 * LN10  # log P of a word unknown to a model without <unk>
_ABSENT = math.nan  # no such probability or back-off in the model (a context only there for its continuations)
CACHE_ENTRIES = 1 << 16  # score() results kept (about 250 B each); cleared when full


class _Order:
    """The n-grams of one order, as parallel columns (parsed, before the trie is built)."""

    __slots__ = ("bows", "columns", "probs")

    def __init__(self, n: int) -> None:
        self.columns = [array("i") for _ in range(n)]
        self.probs = array("d")
        self.bows = array("d")


class NgramLm:
    """A back-off n-gram model: ``P(w | h) = p(h, w)`` if seen, else ``bow(h) * P(w | h[1:])``.

    Level ``n`` of the trie (1-based, as the n-gram order): ``_prob[n]`` and ``_bow[n]`` (NaN where the ARPA
    has none), and, below the highest order, ``_first[n]``: entry ``i``'s continuations are entries
    ``_first[n][i]`` to ``_first[n][i + 1]`` of level ``n + 1``, whose words (``_word[n + 1]``) ascend there.
    Level 1 is indexed by word id.
    """

    def __init__(
        self,
        order: int,
        words: list[str],
        word: list[array],
        prob: list[array],
        bow: list[array],
        first: list[array],
    ) -> None:
        self.order = order
        self.words = words
        self.ids = {w: i for i, w in enumerate(words)}
        self._word, self._prob, self._bow, self._first = word, prob, bow, first
        self.unk = self.ids.get(UNK, -1)
        self.bos = self.ids.get(BOS, -1)
        self.eos = self.ids.get(EOS, -1)
        self._cache: dict[tuple[tuple[int, ...], int], tuple[float, tuple[int, ...]]] = {}

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(cls, path: str | Path) -> NgramLm:
        """Read an ARPA file (``.arpa`` or ``.arpa.gz``)."""
        path = Path(path)
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            return cls.from_lines(f, source=str(path))

    @classmethod
    def from_lines(cls, lines, source: str = "<arpa>") -> NgramLm:
        counts: dict[int, int] = {}
        words: list[str] = []
        ids: dict[str, int] = {}
        orders: dict[int, _Order] = {}
        section = -1  # -1 before \data\, 0 in \data\, n in \n-grams:
        grams = None
        for lineno, raw in enumerate(lines, 1):
            line = raw.strip()
            if not line:
                continue
            if line == "\\data\\":
                section = 0
                continue
            if line == "\\end\\":
                break
            if line.startswith("\\") and line.endswith("-grams:"):
                section = int(line[1:].split("-")[0])
                grams = orders.setdefault(section, _Order(section))
                continue
            if section == 0:
                if line.startswith("ngram "):
                    n, c = line[6:].split("=")
                    counts[int(n)] = int(c)
                continue
            if section <= 0:
                continue
            parts = line.split()
            if len(parts) < section + 1:
                raise ValueError(f"{source}:{lineno}: expected {section} words after the probability")
            try:
                logp = float(parts[0]) * LN10
                bow = float(parts[section + 1]) * LN10 if len(parts) > section + 1 else _ABSENT
            except ValueError as exc:
                raise ValueError(f"{source}:{lineno}: {exc}") from None
            for column, w in zip(grams.columns, parts[1 : section + 1], strict=True):
                i = ids.get(w)
                if i is None:
                    i = ids[w] = len(words)
                    words.append(w)
                column.append(i)
            grams.probs.append(logp)
            grams.bows.append(bow)
        if not counts or not any(len(g.probs) for g in orders.values()):
            raise ValueError(f"{source}: not an ARPA file (no \\data\\ section or no n-grams)")
        order = max(counts)
        return cls(order, words, *_build_trie(order, len(words), orders))

    # ------------------------------------------------------------------ scoring

    def start(self) -> tuple[int, ...]:
        """The state at the start of a sentence (after ``<s>``)."""
        return (self.bos,) if self.bos >= 0 and self.order > 1 else ()

    def _find(self, gram: tuple[int, ...]) -> int:
        """The index of ``gram`` (non-empty) in its level of the trie, or -1."""
        i = gram[0]
        for n in range(1, len(gram)):
            first = self._first[n]
            lo, hi = first[i], first[i + 1]
            column = self._word[n + 1]
            w = gram[n]
            i = bisect_left(column, w, lo, hi)
            if i == hi or column[i] != w:
                return -1
        return i

    def _logp(self, history: tuple[int, ...], word: int) -> float:
        bow = 0.0
        while history:
            n = len(history)
            i = self._find(history)
            if i >= 0:
                first = self._first[n]
                lo, hi = first[i], first[i + 1]
                column = self._word[n + 1]
                j = bisect_left(column, word, lo, hi)
                if j != hi and column[j] == word:
                    p = self._prob[n + 1][j]
                    if p == p:  # (NaN: a context the ARPA lists no probability for)
                        return bow + p
                b = self._bow[n][i]
                if b == b:
                    bow += b
            history = history[1:]
        p = self._prob[1][word]
        return bow + (p if p == p else _UNK_FLOOR)

    def _is_context(self, gram: tuple[int, ...]) -> bool:
        """Whether the model gives ``gram`` a back-off weight (a state is the longest such suffix)."""
        i = self._find(gram)
        if i < 0:
            return False
        b = self._bow[len(gram)][i]
        return b == b

    def score(self, state: tuple[int, ...], word: str | int) -> tuple[float, tuple[int, ...]]:
        """``(ln P(word | state), next state)``; ``word`` is a string or an id from :attr:`ids`."""
        w = word if isinstance(word, int) else self.ids.get(word, self.unk)
        key = (state, w)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if w < 0:
            result = (_UNK_FLOOR, ())
        else:
            nxt = ((*state, w))[-(self.order - 1) :] if self.order > 1 else ()
            # Shorten the state to the longest suffix the model has seen as a context.
            while nxt and not self._is_context(nxt):
                nxt = nxt[1:]
            result = (self._logp(state, w), nxt)
        if len(self._cache) >= CACHE_ENTRIES:
            self._cache.clear()  # (most hits are a session's repeats a few frames apart: 72% of calls hit)
        self._cache[key] = result
        return result

    def unigram(self, word: str) -> float:
        """``ln P(word)``, not kept in the cache (the lexicon asks it once per word)."""
        w = self.ids.get(word, self.unk)
        return self._logp((), w) if w >= 0 else _UNK_FLOOR

    def end(self, state: tuple[int, ...]) -> float:
        """``ln P(</s> | state)`` (0 when the model has no end-of-sentence token)."""
        return self.score(state, self.eos)[0] if self.eos >= 0 else 0.0

    def known(self, word: str) -> bool:
        return word in self.ids and word not in (BOS, EOS, UNK)


def _rows(view: np.ndarray) -> np.ndarray:
    """Each row of a 2-d int32 array as one opaque value, for set operations on whole n-grams."""
    view = np.ascontiguousarray(view)
    return view.view(np.dtype((np.void, view.dtype.itemsize * view.shape[1]))).ravel()


def _build_trie(order: int, vocabulary: int, orders: dict[int, _Order]):
    """The parsed n-grams as the trie's arrays: ``(word, prob, bow, first)``, each a list by level."""
    columns: dict[int, np.ndarray] = {}
    probs: dict[int, np.ndarray] = {}
    bows: dict[int, np.ndarray] = {}
    for n in range(1, order + 1):
        grams = orders.get(n) or _Order(n)
        columns[n] = np.stack([np.frombuffer(c, np.int32) for c in grams.columns], axis=1).reshape(-1, n)
        probs[n] = np.frombuffer(grams.probs, np.float64)
        bows[n] = np.frombuffer(grams.bows, np.float64)
    # Every context of an n-gram must be in the level below (it is in any ARPA SRILM or KenLM writes); one
    # that is not is added there with neither probability nor back-off, so lookups walk through it as before.
    for n in range(order, 2, -1):
        contexts = np.unique(_rows(columns[n][:, :-1]))
        missing = contexts[~np.isin(contexts, _rows(columns[n - 1]))]
        if missing.size:
            added = np.frombuffer(missing.tobytes(), np.int32).reshape(-1, n - 1)
            columns[n - 1] = np.concatenate([columns[n - 1], added])
            probs[n - 1] = np.concatenate([probs[n - 1], np.full(len(added), _ABSENT)])
            bows[n - 1] = np.concatenate([bows[n - 1], np.full(len(added), _ABSENT)])
    level_prob = np.full(vocabulary, _ABSENT)
    level_bow = np.full(vocabulary, _ABSENT)
    level_prob[columns[1][:, 0]] = probs[1]  # (a word listed twice: the last line counts, as it did)
    level_bow[columns[1][:, 0]] = bows[1]
    word: list[array] = [array("i"), array("i", range(vocabulary))]
    prob: list[array] = [array("d"), array("d", level_prob.tobytes())]
    bow: list[array] = [array("d"), array("d", level_bow.tobytes())]
    first: list[array] = [array("q")]
    keys = {1: np.arange(vocabulary, dtype=np.int64)}  # level n's entries as (context's index, word), ascending
    for n in range(2, order + 1):
        rows = columns[n]
        context = rows[:, 0].astype(np.int64)
        for m in range(2, n):
            context = np.searchsorted(keys[m], context * vocabulary + rows[:, m - 1])
        key = context * vocabulary + rows[:, -1]
        sort = np.argsort(key, kind="stable")
        key = key[sort]
        last = np.ones(len(key), dtype=bool)  # an n-gram listed twice: the last line counts, as it did
        last[:-1] = key[1:] != key[:-1]
        sort, key = sort[last], key[last]
        keys[n] = key
        word.append(array("i", (key % vocabulary).astype(np.int32).tobytes()))
        prob.append(array("d", probs[n][sort].tobytes()))
        # (the highest order's back-offs are never read: a state is shorter)
        bow.append(array("d", bows[n][sort].tobytes() if n < order else b""))
        first.append(array("q", np.searchsorted(key // vocabulary, np.arange(len(prob[n - 1]) + 1)).tobytes()))
    first.append(array("q"))
    return word, prob, bow, first
