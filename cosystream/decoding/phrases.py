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

**Named vocabularies** (``serve --vocabulary NAME=FILE``: :func:`read_vocabulary`) are lists too large to send
with every session (up to :data:`MAX_VOCABULARY_PHRASES`): built once per model (phrases whose words the
model cannot spell are left out, and said), and a session that names one and sends phrases of its own builds
on it (``base``), paying for its own phrases only.
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
MAX_VOCABULARY_PHRASES = 100_000  # a named vocabulary's (serve --vocabulary NAME=FILE)
MAX_VOCABULARY_CHARS = 2_000_000
VOCABULARY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def vocabulary_boost(phrases: int) -> float:
    """The boost of a named vocabulary's phrase given without one: :data:`DEFAULT_BOOST` for a list of up to
    ~100 phrases, less for longer ones (2 nats per word at 10,000 phrases, 1 at 100,000). Measured with
    ``benchmarks/phrases.py`` on lists of made-up words (a worst case: short words everywhere in the trie):
    at the default of 8, 10,000 of them took ordinary speech from 0% to 21% WER, 1,000 to 1.7%; at 2 nats
    10,000 leave it at 0% and still find 46% of the terms (54% alone at 8)."""
    return min(DEFAULT_BOOST, 4.0 * (1000 / max(phrases, 1)) ** 0.3)


_WORD = re.compile(r"[a-z]+(?:'[a-z]+)*")
_SPLIT = re.compile(r"[\s\-]+")
_DROP = re.compile(r"[.,!?;:\"()\[\]]")


class PhraseError(ValueError):
    """A phrase that cannot be boosted; the message names it."""


@dataclass(frozen=True, slots=True)
class Phrase:
    words: tuple[str, ...]
    boost: float


def normalize(
    phrases: Iterable[tuple[str, float]], max_phrases: int = MAX_PHRASES, max_chars: int = MAX_PHRASE_CHARS
) -> tuple[Phrase, ...]:
    """``(text, boost)`` pairs as the model's words, checked against the limits (:class:`PhraseError`)."""
    out: list[Phrase] = []
    chars = 0
    for number, (text, boost) in enumerate(phrases, 1):
        if number > max_phrases:
            raise PhraseError(f"more than {max_phrases} phrases")
        chars += len(text)
        if chars > max_chars:
            raise PhraseError(f"phrases of more than {max_chars} characters in all (at phrase {number})")
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


def read_vocabulary(path) -> tuple[Phrase, ...]:
    """A named vocabulary's file: one phrase per line, optionally a tab and its boost (nats per word; none:
    :func:`vocabulary_boost` of the list's length), blank lines and lines starting with ``#`` skipped (the format of the clients' ``--phrases``
    files), at most :data:`MAX_VOCABULARY_PHRASES` phrases and :data:`MAX_VOCABULARY_CHARS` characters.
    Raises :class:`PhraseError` naming the file and line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise PhraseError(f"{path}: {err}") from None
    pairs: list[tuple[str, float]] = []
    where: list[int] = []
    for number, line in enumerate(lines, 1):
        text, _, boost = line.partition("\t")
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        try:
            pairs.append((text.strip(), float(boost) if boost.strip() else 0.0))
        except ValueError:
            raise PhraseError(
                f"{path}:{number}: the boost after the tab must be a number, got {boost!r}"
            ) from None
        where.append(number)
    if not pairs:
        raise PhraseError(f"{path}: no phrases")
    default = vocabulary_boost(len(pairs))
    pairs = [(text, boost or default) for text, boost in pairs]
    try:
        return normalize(pairs, MAX_VOCABULARY_PHRASES, MAX_VOCABULARY_CHARS)
    except PhraseError as err:  # (which line: the phrase normalize() stopped at)
        for number, pair in zip(where, pairs, strict=True):
            try:
                normalize([pair])
            except PhraseError:
                raise PhraseError(f"{path}:{number}: {err}") from None
        raise PhraseError(f"{path}: {err}") from None


class _Node:
    __slots__ = ("bonus", "children")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.bonus = 0.0  # a phrase of several words ends here: what completing it in order gains


class Boosting:
    """One session's phrases: its lexicon, its words' boosts and its context graph (the module docstring)."""

    __slots__ = ("boosts", "dropped", "lexicon", "phrases", "root")

    def __init__(self, phrases: tuple[Phrase, ...], lexicon: Lexicon, base: Boosting | None = None) -> None:
        """``base``: a Boosting these phrases add to (a named vocabulary), shared and unchanged: only the
        context graph's nodes on these phrases' paths are copied."""
        self.phrases = phrases  # (these, not the base's)
        self.lexicon = lexicon
        self.dropped: tuple[str, ...] = ()  # phrases left out as the model cannot spell them (build(skip=True))
        # word -> its boost (the largest of the phrases it is in)
        self.boosts: dict[str, float] = dict(base.boosts) if base is not None else {}
        self.root = _Node()
        copied = {id(self.root)}
        if base is not None:
            self.root.children = dict(base.root.children)
        for phrase in phrases:
            node = self.root
            for word in phrase.words:
                self.boosts[word] = max(self.boosts.get(word, 0.0), phrase.boost)
                child = node.children.get(word)
                if child is None or id(child) not in copied:
                    fresh = _Node()
                    if child is not None:
                        fresh.children, fresh.bonus = dict(child.children), child.bonus
                    child = node.children[word] = fresh
                    copied.add(id(child))
                node = child
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
        base: Boosting | None = None,
        skip: bool = False,
    ) -> Boosting:
        """``spell``: a new word's spelling in the model's tokens (None: unpronounceable); for a lexicon spelled
        by letters, the word itself. ``alpha``: the search's language model weight (a lookahead is weighted by
        it). ``base``: a Boosting built for ``lexicon`` to add these phrases to (its lexicon is extended in turn).
        ``skip``: a phrase with a word the model cannot spell is left out (listed in ``dropped``) rather than
        refused."""
        if base is not None:
            lexicon = base.lexicon
        known = lexicon.words
        new: dict[str, str] = {}
        kept: list[Phrase] = []
        dropped: list[str] = []
        for phrase in phrases:
            spellings: dict[str, str] = {}
            for word in phrase.words:
                if word in known or word in new or word in spellings:
                    continue
                spelling = word if lexicon.spelled or spell is None else spell(word)
                if not spelling or any(ch not in lexicon.ids for ch in spelling):
                    text = " ".join(phrase.words)
                    if skip:
                        dropped.append(text)
                        break
                    raise PhraseError(f"phrase {text!r}: the model cannot spell {word!r}")
                spellings[word] = spelling
            else:
                new.update(spellings)
                kept.append(phrase)
        boosting = cls(tuple(kept), lexicon, base)
        boosting.dropped = tuple(dropped)
        # (only these phrases' words: the base's are credited on its lexicon already, and a path's credit is
        # the largest asked, so a word both boost is credited by the larger)
        words = {word for phrase in kept for word in phrase.words}
        lookahead = {w: (lm.score((), w)[0], boosting.boosts[w] / alpha) for w in words}
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
