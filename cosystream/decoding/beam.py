"""Streaming CTC prefix beam search over a word lexicon, scored with a word n-gram language model.

Each frame extends the ``beam_size`` best prefixes (Hannun et al., 2014) that are within ``score_prune``
nats of the best by the tokens within ``token_prune`` nats of the frame's best token; a word may only be
spelled along the lexicon trie (by its letters, or by its pronunciation for a phoneme model), and when it
completes (a space is emitted, or the utterance ends) the prefix gains ``alpha * ln P_lm(word | history) +
beta``. Frames whose blank probability is at least ``blank_skip`` only carry every prefix over. The cost is
O(beam_size * tokens tried) Python operations per non-blank frame; ``benchmarks/accuracy.py`` prints it per
10 ms frame.

It has the greedy :class:`~cosystream.decoding.greedy.CtcDecoder`'s interface; :meth:`push` reads every
column of the engine's ``[frames, top_k]`` candidates, where greedy decoding reads only the first.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from cosystream.decoding.greedy import Alternative, Word, ranked_alternatives
from cosystream.decoding.lexicon import Lexicon
from cosystream.decoding.lm import NgramLm
from cosystream.decoding.phrases import Boosting

_NEG = -1e30
STALL_FRAMES = 25  # frames without a token of a boosted word being spelled before it loses its credit


def _lse(a: float, b: float) -> float:
    if a < b:
        a, b = b, a
    if b <= _NEG:
        return a
    return a + math.log1p(math.exp(b - a))


@dataclass(slots=True, frozen=True)
class BeamConfig:
    # Defaults tuned with the default (phoneme) model on the training voices' held-out sentences and every
    # other Asterisk prompt, never on the held-out voices (training/README.md, "Prior correction").
    beam_size: int = 64
    alpha: float = 0.8  # language model weight
    beta: float = -0.5  # bonus per word, in nats (negative: a penalty)
    token_prune: float = 5.0  # try tokens within this many nats of the frame's best
    blank_skip: float = 0.99  # frames with P(blank) >= this only carry prefixes over
    max_tokens: int = 6  # at most this many tokens tried per frame
    score_prune: float = 7.0  # drop prefixes more than this many nats below the frame's best


class _Prefix:
    __slots__ = (
        "ctx",
        "end",
        "last",
        "lm",
        "node",
        "partial",
        "pb",
        "phrase",
        "pnb",
        "start",
        "text",
        "tot",
        "wlp",
        "words",
    )

    def __init__(self, text, last, node, partial, ctx, lm, words, start, end, wlp):
        self.text = text  # committed words and the partial word's spelling, space separated
        self.last = last  # last emitted token id (0 when none, or after a word break)
        self.node = node  # lexicon node of the partial word
        self.partial = partial  # the partial word's spelling
        self.ctx = ctx  # language model state
        self.lm = lm  # accumulated alpha * ln P_lm + beta * words
        self.words = words  # tuple of finished Words
        self.start = start  # first frame of the partial word
        self.end = end  # frame after the partial word's last emission
        self.wlp = wlp  # summed acoustic log-prob of the partial word's emissions
        self.pb = _NEG
        self.pnb = _NEG
        self.tot = _NEG  # _lse(pb, pnb), kept up to date at the end of each frame (the next reads it per token)
        self.phrase = None  # the context graph state, with phrase boosting (phrases.Boosting.step)

    def copy(self) -> _Prefix:
        """The same prefix, with no probability yet (for the next frame)."""
        p = _Prefix(
            self.text,
            self.last,
            self.node,
            self.partial,
            self.ctx,
            self.lm,
            self.words,
            self.start,
            self.end,
            self.wlp,
        )
        p.phrase = self.phrase
        return p

    def word_confidence(self) -> float:
        return math.exp(self.wlp / max(1, len(self.partial)))


class BeamCtcDecoder:
    """Prefix beam search for one utterance at a time (see the module docstring)."""

    # The best prefix can lose to another as frames arrive: interim text may be revised. With one
    # hypothesis (beam_size 1) it only grows, once a pronunciation lexicon's word in progress is left out
    # of interims (its likeliest completion changes as it is spelled); see __init__.
    stable_interims = False

    def __init__(
        self,
        vocabulary: list[str],
        lm: NgramLm,
        lexicon: Lexicon | None = None,
        config: BeamConfig | None = None,
        frame_ms: int = 10,
        boosting: Boosting | None = None,
    ) -> None:
        """``boosting``: the session's phrases (its lexicon replaces ``lexicon``)."""
        if vocabulary[0] not in ("<blank>", "") or " " not in vocabulary:
            raise ValueError("beam search needs the blank at index 0 and a ' ' word separator")
        self._vocab = list(vocabulary)
        self._space = self._vocab.index(" ")
        self.lm = lm
        self.lexicon = lexicon or Lexicon.from_lm(lm, vocabulary)
        self.boosting = boosting
        if boosting is not None:
            self.lexicon = boosting.lexicon
        self.config = config or BeamConfig()
        self.stable_interims = self.config.beam_size == 1
        self.frame_ms = frame_ms
        self._log_blank_skip = math.log(self.config.blank_skip)
        self.reset()

    def reset(self) -> None:
        root = _Prefix("", 0, self.lexicon.root, "", self.lm.start(), 0.0, (), 0, 0, 0.0)
        root.pb = root.tot = 0.0
        self._beams: dict[str, _Prefix] = {"": root}
        self._best: _Prefix = root
        self._best_text = ""  # the text of _best, made once per push (interims read it again)
        self._finished: list[Word] | None = None
        self._scored: list[tuple[float, tuple[Word, ...]]] = []  # every prefix's final score and words

    # ------------------------------------------------------------------ search

    def push(self, ids: np.ndarray, logprobs: np.ndarray, first_frame: int) -> bool:
        """Add frames from ``first_frame`` on: per frame the ``K`` most likely token ids and their log-probs.

        ``ids`` and ``logprobs`` are ``[frames, K]``, best first (the engine's ``top_k`` output; ``K`` = the
        vocabulary size gives the full distribution). A token outside a frame's top ``K`` is treated as
        having the ``K``-th log-probability, an upper bound. Returns True if :attr:`text` changed.
        """
        ids = np.asarray(ids)
        logprobs = np.asarray(logprobs, dtype=np.float32)
        if ids.ndim != 2 or logprobs.shape != ids.shape:
            raise ValueError(f"ids {ids.shape} and logprobs {logprobs.shape} must be equal [frames, K]")
        rows = ids.tolist()  # Python lists: the search below reads every entry, numpy scalars cost more
        if ids.size and (min(map(min, rows)) < 0 or max(map(max, rows)) >= len(self._vocab)):
            raise ValueError(f"token ids must be in [0, {len(self._vocab)})")
        before = self.text
        cfg = self.config
        skip = self._log_blank_skip
        keep = cfg.max_tokens
        for t, (row_ids, row_lps) in enumerate(zip(rows, logprobs.tolist(), strict=True)):
            scores = dict(zip(row_ids, row_lps, strict=True))
            floor = row_lps[-1]
            blank = scores.get(0, floor)
            if blank >= skip:
                self._carry(blank, scores, floor)
                continue
            cutoff = row_lps[0] - cfg.token_prune
            tokens = [(k, lp) for k, lp in zip(row_ids[:keep], row_lps[:keep], strict=True) if k and lp >= cutoff]
            tokens.append((0, blank))  # every prefix survives through a blank
            self._step(first_frame + t, tokens)
        self._best_text = self._text_of(self._best)
        return self.text != before

    def _carry(self, lp_blank: float, scores: dict[int, float], floor: float) -> None:
        alpha = self.config.alpha
        best, best_rank = None, -math.inf
        for p in self._beams.values():
            p.pnb = pnb = p.pnb + scores.get(p.last, floor) if p.last else _NEG
            p.pb = pb = p.tot + lp_blank
            p.tot = total = _lse(pb, pnb)
            rank = total + p.lm + alpha * p.node[2]
            if rank > best_rank:  # the first of equals, as max() picks
                best, best_rank = p, rank
        self._best = best

    def _rank(self, p: _Prefix) -> float:
        return _lse(p.pb, p.pnb) + p.lm + self.config.alpha * p.node[2]

    def _step(self, frame: int, tokens: list[tuple[int, float]]) -> None:
        cfg = self.config
        space = self._space
        vocab = self._vocab
        nxt: dict[str, _Prefix] = {}
        lexicon = self.lexicon
        for p in self._beams.values():
            text = p.text
            total = p.tot
            children = p.node[0]
            if children.__class__ is int:  # (a node no search had reached: its children are made now)
                children = lexicon.children(p.node)
            for k, lp in tokens:
                if k == 0 or (k == space and not p.partial):  # a break with no word in progress: a blank
                    q = nxt.get(text)
                    if q is None:  # a new prefix's first path is its probability: _lse(_NEG, x) == x
                        q = nxt[text] = p.copy()
                        q.pb = total + lp
                    else:
                        q.pb = _lse(q.pb, total + lp)
                elif k == space:
                    if p.node[1] is None:
                        continue  # not a lexicon word
                    committed = text[: len(text) - len(p.partial)]
                    for word in p.node[1]:
                        key = committed + word + " "
                        q = nxt.get(key)
                        if q is None:
                            lm_lp, ctx = self.lm.score(p.ctx, word)
                            lm = p.lm + cfg.alpha * lm_lp + cfg.beta
                            words = (*p.words, self._word(p, word))
                            q = nxt[key] = _Prefix(key, 0, self.lexicon.root, "", ctx, lm, words, 0, 0, 0.0)
                            if self.boosting is not None:
                                q.phrase, gain = self.boosting.step(p.phrase, word)
                                q.lm += gain
                            q.pnb = total + lp
                        else:
                            q.pnb = _lse(q.pnb, total + lp)
                elif k == p.last:
                    q = nxt.get(text)  # a repeated token collapses
                    if q is None:
                        q = nxt[text] = p.copy()
                        q.pnb = p.pnb + lp
                    else:
                        q.pnb = _lse(q.pnb, p.pnb + lp)
                    child = children.get(k)
                    if child is not None and p.pb > _NEG:  # with a blank in between: a double letter
                        key = text + vocab[k]
                        q = nxt.get(key)
                        if q is None:
                            q = _Prefix(
                                key,
                                k,
                                child,
                                p.partial + vocab[k],
                                p.ctx,
                                p.lm,
                                p.words,
                                p.start,
                                frame + 1,
                                p.wlp + lp,
                            )
                            q.phrase = p.phrase
                            nxt[key] = q
                            q.pnb = p.pb + lp
                        else:
                            q.pnb = _lse(q.pnb, p.pb + lp)
                else:
                    child = children.get(k)
                    if child is None:
                        continue  # no lexicon word goes on this way
                    key = text + vocab[k]
                    q = nxt.get(key)
                    if q is None:
                        if p.partial:
                            partial, begin, wlp = p.partial + vocab[k], p.start, p.wlp + lp
                        else:
                            partial, begin, wlp = vocab[k], frame, lp
                        q = nxt[key] = _Prefix(key, k, child, partial, p.ctx, p.lm, p.words, begin, frame + 1, wlp)
                        q.phrase = p.phrase
                        q.pnb = total + lp
                    else:
                        q.pnb = _lse(q.pnb, total + lp)
        alpha = cfg.alpha
        scored = []
        for i, q in enumerate(nxt.values()):
            q.tot = total = _lse(q.pb, q.pnb)
            scored.append((total + q.lm + alpha * q.node[2], i, q))  # self._rank(q)
        if self.boosting is not None:
            ranked, floor = self._boosted_ranking(frame, scored)
        else:
            ranked = heapq.nlargest(cfg.beam_size, scored)
            floor = ranked[0][0] - cfg.score_prune
        self._beams = {p.text: p for score, _, p in ranked if score >= floor}
        self._best = ranked[0][2]  # what max(self._beams.values(), key=self._rank) picks: the first of the best

    def _boosted_ranking(self, frame: int, scored: list) -> tuple[list, float]:
        """The beam and its pruning floor with phrase boosting. A word being spelled is credited a share of its
        boost in the lookahead (``node[4]``, lexicon.extended); the floor is measured from the best
        hypothesis *without* that credit, so a boosted spelling the audio may not finish does not prune every
        other hypothesis, and a spelling stalled for STALL_FRAMES (no token of it) loses its credit, else it
        outranks through blanks every hypothesis that went on."""
        alpha = self.config.alpha
        stalled = frame - STALL_FRAMES
        plain_best = -math.inf
        adjusted = []
        for score, i, q in scored:
            node = q.node
            if len(node) > 4 and q.partial:
                credit = alpha * node[4]
                if q.end < stalled:
                    score -= credit
                    credit = 0.0
                plain_best = max(plain_best, score - credit)
            else:
                plain_best = max(plain_best, score)
            adjusted.append((score, i, q))
        ranked = heapq.nlargest(self.config.beam_size, adjusted)
        return ranked, min(ranked[0][0], plain_best) - self.config.score_prune

    # ------------------------------------------------------------------ results

    def _final(self, p: _Prefix) -> tuple[float, tuple[Word, ...]]:
        """Score and words of ``p`` as if the utterance ended now."""
        cfg = self.config
        score = _lse(p.pb, p.pnb) + p.lm
        words = p.words
        ctx = p.ctx
        boosting, phrase = self.boosting, p.phrase
        if p.partial:
            if p.node[1] is None:
                return score - 1e3, (*words, self._partial_word(p))
            # The homophone the language model likes best here (with its boost) ends the utterance.
            scored = []
            for w in p.node[1]:
                lm_lp, next_ctx = self.lm.score(ctx, w)
                gain, next_phrase = 0.0, None
                if boosting is not None:
                    next_phrase, gain = boosting.step(phrase, w)
                scored.append((cfg.alpha * lm_lp + gain, next_ctx, next_phrase, w))
            gained, ctx, phrase, word = max(scored, key=lambda s: s[0])
            score += gained + cfg.beta
            words = (*words, self._word(p, word))
        return score + cfg.alpha * self.lm.end(ctx), words

    def _word(self, p: _Prefix, word: str) -> Word:
        return Word(word, p.start * self.frame_ms, p.end * self.frame_ms, p.word_confidence())

    def _partial_word(self, p: _Prefix) -> Word:
        """The word in progress: its letters, or for a pronunciation lexicon the likeliest word it can
        still become (its spelling when none)."""
        word = p.partial if self.lexicon.spelled else (p.node[3] or p.partial)
        return self._word(p, word)

    def finalize(self) -> None:
        """The utterance has ended: pick the best hypothesis with its last word and ``</s>`` scored.

        From here until :meth:`reset`, :attr:`text` and :meth:`words` describe that hypothesis.
        """
        self._scored = [self._final(p) for p in self._beams.values()]
        _, words = max(self._scored, key=lambda scored: scored[0])
        self._finished = list(words)

    def alternatives(self, n: int) -> list[Alternative]:
        """After :meth:`finalize`: the ``n`` best distinct word sequences of the beam, best first (the first is
        :attr:`text`); fewer when the beam holds fewer."""
        return ranked_alternatives(self._scored, self.confidence, n)

    @property
    def text(self) -> str:
        """The best hypothesis so far (the word in progress included)."""
        if self._finished is not None:
            return " ".join(w.word for w in self._finished)
        return self._best_text

    def _text_of(self, p: _Prefix) -> str:
        if self.lexicon.spelled or not p.partial:
            return p.text.strip()
        return " ".join(w.word for w in self._words_of(p))

    def _guess_partial(self) -> bool:
        """Whether interims show a guess for the word in progress (not when they must only grow)."""
        return self.lexicon.spelled or not self.stable_interims

    def words(self) -> list[Word]:
        if self._finished is not None:
            return list(self._finished)
        return self._words_of(self._best)

    def _words_of(self, p: _Prefix) -> list[Word]:
        return list((*p.words, self._partial_word(p))) if p.partial and self._guess_partial() else list(p.words)

    @property
    def confidence(self) -> float:
        """Mean word confidence (0.0 while nothing is decoded)."""
        words = self.words()
        return sum(w.confidence for w in words) / len(words) if words else 0.0
