"""Phrase boosting: the words and phrases a session expects, made likelier in the beam search.

A session sends up to :data:`MAX_PHRASES` phrases (:data:`MAX_PHRASE_CHARS` characters in all), each words
and a boost (nats per word, 0 < boost <= :data:`MAX_BOOST`; 0 in a request means :data:`DEFAULT_BOOST`).
:func:`normalize` checks them and writes them as the model's words (lower case, letters and apostrophes).
:meth:`Boosting.build` then makes, once per session:

- **the session's lexicon**: the model's, shared, with the phrases' new words added by copying only the
  trie nodes on their paths (the rest is shared with every other session, so the cost is per new word, not
  per lexicon); a new word is spelled by its letters, or for a phoneme model by the G2P
  (:mod:`cosystream.decoding.g2p`). The lookahead on every boosted word's path is raised by the share of its
  boost its spelling has reached, so a word being spelled is credited as it goes (a context graph's
  per-token score) and the beam keeps it, without a hypothesis that has only begun it taking the beam.
- **word boosts and a context graph over words** (after WeNet's context graph and icefall's
  ``ContextGraph``, at the word level because the search commits whole words). Each phrase word a
  hypothesis completes gains its boost, wherever it stands: the lookahead credited it as it was spelled,
  and a gain that depended on the words before it would leave a hypothesis stuck in a boosted word's
  spelling better ranked than the ones that finished it (measured: such a hypothesis swallowed the rest of
  the utterance as blanks). A hypothesis also carries its place in a trie of the phrases' word sequences,
  and completing a phrase of several words in order gains its boost once more.

The language model is unchanged and shared; a word it does not know scores its ``<unk>``. A session without
phrases has no Boosting and pays nothing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cosystream.decoding.lexicon import Lexicon
from cosystream.decoding.lm import NgramLm

MAX_PHRASES = 1000
MAX_PHRASE_CHARS = 10_000  # all of a session's phrases together
MAX_PHRASE_WORDS = 10
MAX_BOOST = 20.0
DEFAULT_BOOST = 8.0  # nats per word, for a phrase sent without one (measured: docs/MODELS.md, "Phrase boosting")
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)*")
_SPLIT = re.compile(r"[\s\-]+")
_DROP = re.compile(r"[.,!?;:\"()\[\]]")


class PhraseError(ValueError):
    """A phrase that cannot be boosted; the message names it."""


@dataclass(frozen=True, slots=True)
class Phrase:
    words: tuple[str, ...]
    boost: float


def normalize(phrases: Iterable[tuple[str, float]]) -> tuple[Phrase, ...]:
    """``(text, boost)`` pairs as the model's words, checked against the limits (:class:`PhraseError`)."""
    out: list[Phrase] = []
    chars = 0
    for number, (text, boost) in enumerate(phrases, 1):
        if number > MAX_PHRASES:
            raise PhraseError(f"more than {MAX_PHRASES} phrases")
        chars += len(text)
        if chars > MAX_PHRASE_CHARS:
            raise PhraseError(f"phrases of more than {MAX_PHRASE_CHARS} characters in all (at phrase {number})")
        if not math.isfinite(boost) or not 0 <= boost <= MAX_BOOST:
            raise PhraseError(f"phrase {text!r}: boost {boost} is out of range (0 < boost <= {MAX_BOOST:g})")
        words = tuple(w for w in _SPLIT.split(_DROP.sub("", text.lower())) if w)
        if not words:
            raise PhraseError(f"phrase {number} is empty")
        if len(words) > MAX_PHRASE_WORDS:
            raise PhraseError(f"phrase {text!r}: more than {MAX_PHRASE_WORDS} words")
        for word in words:
            if not _WORD.fullmatch(word):
                raise PhraseError(
                    f"phrase {text!r}: {word!r} cannot be spelled (letters and apostrophes only; write numbers "
                    "and symbols as words)"
                )
        out.append(Phrase(words, boost or DEFAULT_BOOST))
    return tuple(out)


class _Node:
    __slots__ = ("bonus", "children")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.bonus = 0.0  # a phrase of several words ends here: what completing it in order gains


class Boosting:
    """One session's phrases: its lexicon, its words' boosts and its context graph (the module docstring)."""

    __slots__ = ("boosts", "lexicon", "phrases", "root")

    def __init__(self, phrases: tuple[Phrase, ...], lexicon: Lexicon) -> None:
        self.phrases = phrases
        self.lexicon = lexicon
        self.boosts: dict[str, float] = {}  # word -> its boost (the largest of the phrases it is in)
        self.root = _Node()
        for phrase in phrases:
            node = self.root
            for word in phrase.words:
                self.boosts[word] = max(self.boosts.get(word, 0.0), phrase.boost)
                node = node.children.setdefault(word, _Node())
            if len(phrase.words) > 1:
                node.bonus = max(node.bonus, phrase.boost)

    @classmethod
    def build(
        cls,
        phrases: tuple[Phrase, ...],
        lexicon: Lexicon,
        lm: NgramLm,
        alpha: float,
        spell: Callable[[str], str | None] | None = None,
    ) -> Boosting:
        """``spell``: a new word's spelling in the model's tokens (None: unpronounceable); for a lexicon spelled
        by letters, the word itself. ``alpha``: the search's language model weight (a lookahead is weighted by
        it)."""
        known = lexicon.words
        new: dict[str, str] = {}
        for phrase in phrases:
            for word in phrase.words:
                if word in known or word in new:
                    continue
                spelling = word if lexicon.spelled or spell is None else spell(word)
                if not spelling or any(ch not in lexicon.ids for ch in spelling):
                    text = " ".join(phrase.words)
                    raise PhraseError(f"phrase {text!r}: the model cannot spell {word!r}")
                new[word] = spelling
        boosting = cls(phrases, lexicon)
        lookahead = {w: (lm.score((), w)[0], b / alpha) for w, b in boosting.boosts.items()}
        boosting.lexicon = lexicon.extended(new, lookahead, lambda w: known.get(w) or new[w])
        return boosting

    def step(self, state: _Node | None, word: str) -> tuple[_Node | None, float]:
        """A hypothesis in ``state`` (None: no phrase in progress) completes ``word``: its next state and what
        its score gains (the word's boost, and a phrase's bonus when this word completes it in order)."""
        gain = self.boosts.get(word)
        if gain is None:
            return None, 0.0
        child = state.children.get(word) if state is not None else None
        if child is None:
            child = self.root.children.get(word)
        if child is None:
            return None, gain
        following = child
        if not child.children:  # the graph ends here: a phrase that begins with this word may go on
            following = self.root.children.get(word)
            if following is not None and not following.children:
                following = None
        return following, gain + child.bonus
