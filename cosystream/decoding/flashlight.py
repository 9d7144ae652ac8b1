"""The lexicon-constrained CTC beam search in C++: flashlight-text's ``LexiconDecoder`` with its KenLM.

The same search as :class:`~cosystream.decoding.beam.BeamCtcDecoder` (words spelled along the lexicon trie,
each finished word scored ``alpha * ln P_lm(word | history) + beta``, the best unigram reachable from a
partial word as look-ahead, hypotheses more than ``score_prune`` behind the best dropped), run by the
decoder torchaudio's ``ctc_decoder`` is built on (PyPI ``flashlight-text``; KenLM reads the ARPA file).
Each word's spelling ends with the ``" "`` token, so a word is finished when the model emits the break,
as in the Python search, and :meth:`FlashlightCtcDecoder.finalize` adds one frame of certain break
before the end of sentence is scored. KenLM's scores are log10: the LM weight is ``alpha * ln 10``.

Differences from the Python search: every frame is searched (no ``blank_skip``), with the ``max_tokens``
best tokens of the frame (no ``token_prune``); hypotheses merge by word history, lexicon node, last token
and blank, not by text; homophones the language model cannot tell apart are kept once (see
:class:`FlashlightLexicon`). On the default model that is 3-5x less decoding time at the same WER
(``benchmarks/decoders.py``; numbers in ``docs/MODELS.md``). Never call flashlight's ``Trie.get_root()``
from Python: its binding takes ownership of the root and frees it twice at exit.

Streaming: :meth:`~FlashlightCtcDecoder.push` hands each push's frames to ``decode_step``; the best
hypothesis is traced back once ``trace_frames`` frames (40 ms) have arrived since the last trace-back (its
finished words; the word in progress is guessed from the frames since, as the Python search shows the
likeliest word its partial spelling can become). A trace-back walks the best path through every held
frame, one cache miss per frame when served, so tracing back after every 10 ms push cost more than the
search itself. The decoder keeps every frame's hypotheses until it is pruned: every ``_PRUNE_AT_FRAMES``
frames the best path's words older than ``_KEEP_FRAMES`` are committed and their frames dropped, which
bounds memory and the trace-back of a long utterance. Pruning happens at fixed frame counts, so how the
frames are chunked into pushes never changes the result (nor does ``trace_frames``: only when the text is
read).
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from cosystream.decoding.beam import BeamConfig
from cosystream.decoding.greedy import Alternative, Word, ranked_alternatives
from cosystream.decoding.lexicon import HOMOPHONES

log = logging.getLogger(__name__)

try:
    from flashlight.lib.text.decoder import (
        CriterionType,
        LexiconDecoder,
        LexiconDecoderOptions,
        SmearingMode,
        Trie,
    )
    from flashlight.lib.text.decoder.kenlm import KenLM
    from flashlight.lib.text.dictionary import Dictionary
except ImportError:  # the Python search stands in (DecoderConfig.resolve)
    KenLM = None

LN10 = math.log(10.0)
_SPECIAL = ("<s>", "</s>", "<unk>")
_NEG = -1e9  # log-prob of a token that cannot be emitted (finite: the search adds and compares scores)
_PRUNE_AT_FRAMES = 500  # frames the decoder holds before it prunes (5 s of audio)...
_KEEP_FRAMES = 250  # ...down to this many (plus the frames back to the best path's last word, at most 100)
_LOOK_BACK_LIMIT = 100  # flashlight's kLookBackLimit: how far back a trace-back looks for a finished word
# Frames pushed between trace-backs of the best path (the text is read at most every 40 ms of audio). A
# trace-back walks every held frame's hypothesis, one dependent memory load per frame: offline, with the
# decoder's memory in cache, 1-5 us; served, 20-50 us (the engine's model step and the rest of the box have
# evicted it since the session's last push), more than the search of the frames itself (docs/PERFORMANCE.md).
_TRACE_FRAMES = 4


def available() -> bool:
    """Whether flashlight-text (with KenLM) is importable."""
    return KenLM is not None


def read_unigrams(path: str | Path) -> dict[str, tuple[float, float]]:
    """An ARPA file's words with their unigram log10 probability and back-off weight (only its
    ``\\1-grams:`` section is read)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    unigrams: dict[str, tuple[float, float]] = {}
    with opener(path, "rt", encoding="utf-8") as f:
        inside = False
        for line in f:
            if line.startswith("\\"):
                if inside:
                    break
                inside = line.startswith("\\1-grams:")
                continue
            parts = line.split()
            if inside and len(parts) >= 2:
                unigrams[parts[1]] = (float(parts[0]), float(parts[2]) if len(parts) > 2 else 0.0)
    if not unigrams:
        raise ValueError(f"{path}: not an ARPA file (no \\1-grams: section)")
    return unigrams


@contextlib.contextmanager
def _stderr_to_log() -> Iterator[None]:
    """KenLM reports its progress on file descriptor 2: send that to the debug log instead."""
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode(errors="replace").strip()
            if text:
                log.debug("kenlm: %s", text)


class FlashlightLexicon:
    """The language model (KenLM) and the lexicon trie, loaded once and shared by every stream's decoder.

    The words are the language model's (``<s>``, ``</s>``, ``<unk>`` left out) that can be spelled in the
    model's tokens: by their letters, or by ``spellings`` (word -> one-character tokens, a phoneme model's
    pronunciations). Words that sound alike keep the ``homophones`` likeliest by unigram, as
    :class:`~cosystream.decoding.lexicon.Lexicon` does, less those with the same unigram probability and
    back-off as a likelier-or-equal one kept (the search could not tell them apart but by memory address).
    """

    def __init__(
        self,
        lm_path: str | Path,
        vocabulary: list[str],
        spellings: dict[str, str] | None = None,
        homophones: int = HOMOPHONES,
    ) -> None:
        if KenLM is None:
            raise ValueError("the compiled beam search needs flashlight-text: pip install flashlight-text")
        if vocabulary[0] not in ("<blank>", "") or " " not in vocabulary:
            raise ValueError("beam search needs the blank at index 0 and a ' ' word separator")
        self.vocabulary = list(vocabulary)
        self.space = self.vocabulary.index(" ")
        self.spelled = spellings is None
        ids = {ch: i for i, ch in enumerate(self.vocabulary) if i > 0 and ch != " "}
        unigrams = read_unigrams(lm_path)
        by_spelling: dict[str, list[tuple[float, str]]] = {}
        for word, (logp, _) in unigrams.items():
            spelling = word if spellings is None else spellings.get(word)
            if word in _SPECIAL or not spelling or any(ch not in ids for ch in spelling):
                continue
            by_spelling.setdefault(spelling, []).append((-logp, word))
        self.words: list[str] = []  # label -> word
        dictionary = Dictionary()
        entries = []
        for spelling, scored in by_spelling.items():
            tokens = [*(ids[ch] for ch in spelling), self.space]
            kept: list[str] = []
            for _, word in sorted(scored)[:homophones]:
                # Homophones with the same unigram probability and back-off tie exactly wherever the language
                # model backs off, and flashlight breaks ties by memory address, so that a result could change
                # from run to run: only the first is kept. (The default model's: 13,700 words in no longer
                # n-gram, which only a tie could ever choose, and 118 in one.)
                if any(unigrams[other] == unigrams[word] for other in kept):
                    continue
                dictionary.add_entry(word)
                # The trie's scores only make the look-ahead (smearing), which log-adds a node's own scores:
                # the likeliest homophone alone counts, so a partial word's look-ahead is the best unigram
                # reachable, as in the Python search.
                entries.append((tokens, len(self.words), unigrams[word][0] if not kept else _NEG))
                self.words.append(word)
                kept.append(word)
        self.size = len(self.words)
        with _stderr_to_log():
            self.lm = KenLM(str(lm_path), dictionary)
        self.trie = Trie(len(self.vocabulary), self.space)
        for tokens, label, logp in entries:
            self.trie.insert(tokens, label, logp)
        self.trie.smear(SmearingMode.MAX)
        # Each spelling prefix's likeliest word (for a word in progress); filled as interims ask.
        self._guesses: dict[tuple[int, ...], str | None] = {}

    def guess(self, spelling: tuple[int, ...]) -> str | None:
        """The likeliest word (by unigram) that ``spelling`` (token ids), or its longest prefix that a word
        starts with, can still become; None if no word starts with its first token."""
        if spelling in self._guesses:
            return self._guesses[spelling]
        node = self.trie.search(list(spelling)) if spelling else None
        word = None
        if node is None and len(spelling) > 1:
            word = self.guess(spelling[:-1])
        while node is not None and word is None:
            best = node.max_score
            for label, score in zip(node.labels, node.scores, strict=True):
                if score == best:
                    word = self.words[label]
                    break
            else:
                node = max(node.children.values(), key=lambda child: child.max_score, default=None)
        if len(self._guesses) < 100_000:
            self._guesses[spelling] = word
        return word


class FlashlightCtcDecoder:
    """Prefix beam search for one utterance at a time, in C++ (see the module docstring).

    It has :class:`~cosystream.decoding.beam.BeamCtcDecoder`'s interface.
    """

    # The best hypothesis can lose to another as frames arrive; with one hypothesis (beam_size 1) interims
    # only grow, once the word in progress is left out of them (as BeamCtcDecoder does).
    stable_interims = False

    def __init__(
        self,
        vocabulary: list[str],
        lexicon: FlashlightLexicon,
        config: BeamConfig | None = None,
        frame_ms: int = 10,
        prune_at_frames: int = _PRUNE_AT_FRAMES,
        keep_frames: int = _KEEP_FRAMES,
        trace_frames: int = _TRACE_FRAMES,
    ) -> None:
        if list(vocabulary) != lexicon.vocabulary:
            raise ValueError("the lexicon was built for another vocabulary")
        if not 0 < keep_frames < prune_at_frames - _LOOK_BACK_LIMIT:
            raise ValueError(f"need 0 < keep_frames < prune_at_frames - 100, got {keep_frames}, {prune_at_frames}")
        if trace_frames < 1:
            raise ValueError(f"need trace_frames >= 1, got {trace_frames}")
        self._prune_at, self._keep, self._trace_frames = prune_at_frames, keep_frames, trace_frames
        self.lexicon = lexicon
        self.config = config or BeamConfig()
        self.stable_interims = self.config.beam_size == 1
        self._guess_partial = lexicon.spelled or not self.stable_interims
        self.frame_ms = frame_ms
        self._vocab_size = len(vocabulary)
        self._space = lexicon.space
        cfg = self.config
        options = LexiconDecoderOptions(
            beam_size=cfg.beam_size,
            beam_size_token=cfg.max_tokens,
            beam_threshold=cfg.score_prune,
            lm_weight=cfg.alpha * LN10,  # KenLM scores are log10
            word_score=cfg.beta,
            unk_score=-math.inf,
            sil_score=0.0,
            log_add=True,
            criterion_type=CriterionType.CTC,
        )
        self._decoder = LexiconDecoder(options, lexicon.trie, lexicon.lm, self._space, 0, -1, [], False)
        # The frames the decoder holds, as dense log-probs (decode_step reads them from here), and each one's
        # best token; one more row for finalize()'s word break.
        self._emissions = np.empty((prune_at_frames + 1, self._vocab_size), np.float32)
        self._best_ids = np.empty(prune_at_frames + 1, np.int64)
        self._row_index = np.arange(prune_at_frames + 1)[:, None]
        self._base, self._row_bytes = self._emissions.ctypes.data, self._emissions.strides[0]
        self.reset()

    def reset(self) -> None:
        self._decoder.decode_begin()
        self._hypotheses = []  # finalize(): every final hypothesis, best first
        self._origin = -1  # stream frame of the utterance's first frame (set by the first push)
        self._held = 0  # frames in the decoder's buffer (rows of _emissions)
        self._dropped = 0  # frames pruned away before them
        self._traced = 0  # held frames at the last trace-back (the text and the words describe these)
        self._untraced = 0  # frames pushed since then
        self._committed: list[Word] = []  # the words of the frames pruned away
        self._labels: list[int] = []  # the best path's words in the held frames
        self._partial: tuple[int, ...] = ()  # the spelling of the word in progress, as the frames read
        self._shown = ""  # how the text shows it (its likeliest word)
        self._result = None  # the best path (a DecodeResult) after the last push
        self._path: list[int] = []  # its words per hypothesis index
        self._tail: tuple = (-1, 0, [], False, -1)  # where _spell_tail stopped: (start, row, its state)
        self._known: tuple = ([], [], [], 0)  # the path _held_words read last, its words, and where they end
        self._text: str | None = ""
        self._reported = ""  # the text at the last trace-back (push() says whether it changed)
        self._cache: list[Word] | None = []
        self._finished: list[Word] | None = None

    # ------------------------------------------------------------------ search

    def push(self, ids: np.ndarray, logprobs: np.ndarray, first_frame: int) -> bool:
        """Add frames from ``first_frame`` on: per frame the ``K`` most likely token ids and their log-probs.

        ``ids`` and ``logprobs`` are ``[frames, K]``, best first (``K`` = the vocabulary size gives the full
        distribution); a token outside a frame's top ``K`` gets the ``K``-th log-probability. Word times
        count frames from the first push's ``first_frame``. Returns True if :attr:`text` changed.

        The best path is traced back (and :attr:`text` and :meth:`words` brought up to date) once at least
        ``trace_frames`` frames have been pushed since the last trace-back, and after a prune; in between a
        push returns False and the text stays as it was. Finals do not depend on it.
        """
        ids = np.asarray(ids)
        logprobs = np.asarray(logprobs, dtype=np.float32)
        if ids.ndim != 2 or logprobs.shape != ids.shape:
            raise ValueError(f"ids {ids.shape} and logprobs {logprobs.shape} must be equal [frames, K]")
        if ids.size and (ids.min() < 0 or ids.max() >= self._vocab_size):
            raise ValueError(f"token ids must be in [0, {self._vocab_size})")
        if self._origin < 0:
            self._origin = first_frame
        done, frames, pruned = 0, len(ids), False
        while done < frames:
            # Stop at the pruning point, so that it falls on the same frame however pushes are chunked.
            take = min(frames - done, self._prune_at - self._held)
            self._step(ids[done : done + take], logprobs[done : done + take])
            done += take
            if self._held == self._prune_at:
                self._prune()
                pruned = True
        self._untraced += frames
        if self._untraced < self._trace_frames and not pruned:
            return False
        self._untraced = 0
        return self._trace()

    def _step(self, ids: np.ndarray, logprobs: np.ndarray) -> None:
        n, start = len(ids), self._held
        rows = self._emissions[start : start + n]
        rows[:] = logprobs[:, -1:]
        rows[self._row_index[:n], ids] = logprobs
        self._best_ids[start : start + n] = ids[:, 0]
        self._decoder.decode_step(self._base + start * self._row_bytes, n, self._vocab_size)
        self._held += n

    def _prune(self) -> None:
        """Commit the best path's words older than about ``keep_frames`` and drop their frames."""
        result = self._decoder.get_best_hypothesis(self._keep)
        cut = len(result.tokens) - 1  # the hypotheses of this many frames go (the decoder cuts at the same place)
        if cut < 1:
            raise RuntimeError("flashlight decoder: no hypothesis to prune")
        self._committed += self._words_of(result.tokens, result.words)
        self._decoder.prune(self._keep)
        kept = self._held - cut
        self._emissions[:kept] = self._emissions[cut : self._held]
        self._best_ids[:kept] = self._best_ids[cut : self._held]
        self._held, self._dropped = kept, self._dropped + cut
        # Hypothesis indices moved and words were committed: the next trace-back (in this push) is read whole.
        self._path, self._labels, self._text, self._cache = [], [], None, None
        self._tail, self._known = (-1, 0, [], False, -1), ([], [], [], 0)

    def _trace(self) -> bool:
        """Read the best path (its words and the word in progress); True if the text changed."""
        result = self._decoder.get_best_hypothesis(0)
        path = result.words  # per hypothesis index (0: the start, or a frame already committed): word or -1
        seen = self._path
        if len(path) >= len(seen) and path[: len(seen)] == seen:
            labels = self._labels + [w for w in path[max(len(seen), 1) :] if w >= 0]  # the path only grew
        else:
            labels = [w for w in path[1:] if w >= 0]
        self._path, self._result, self._traced = path, result, self._held
        partial = self._spell_tail(len(path) - 2) if self._guess_partial else ()
        if partial != self._partial:
            self._partial, self._cache = partial, None
            shown = self._partial_text()
            if shown != self._shown:
                self._shown, self._text = shown, None
        if labels != self._labels:
            self._labels, self._text, self._cache = labels, None, None
        before = self._reported
        if self._text is None:
            self._reported = self.text
        return self._reported != before

    def _spell_tail(self, start: int) -> tuple[int, ...]:
        """The word in progress: the held frames from row ``start`` on (just after the best path's last word)
        read greedily, after their last word break. A break that ends the frames keeps the word before it:
        the path may already be finishing it (its trace-back shows the word one frame later). The reading
        goes on from where the last one stopped while the path's last word stays where it was."""
        start = max(start, 0)
        if start == self._tail[0]:
            _, begin, spelling, broken, previous = self._tail
        else:
            begin, spelling, broken, previous = start, [], False, -1
        blank, space = 0, self._space
        for token in self._best_ids[begin : self._held].tolist():
            if token != previous:
                if token == space:
                    broken = True
                elif token != blank:
                    if broken:
                        spelling = []
                        broken = False
                    spelling.append(token)
            previous = token
        self._tail = (start, self._held, spelling, broken, previous)
        return tuple(spelling)

    # ------------------------------------------------------------------ results

    def _words_of(self, tokens: list[int], labels: list[int], offset: int = 0) -> list[Word]:
        """The words of a traced-back path (``tokens`` and ``labels`` from hypothesis index ``offset`` on; that
        index's own word is not read): from a word's first new token after the word before to one frame past
        its last new token, confidence ``exp(mean log-prob)`` of those tokens (as BeamCtcDecoder)."""
        tok = np.asarray(tokens[1:])  # hypothesis index offset + i + 1: the token of row offset + i
        lab = np.asarray(labels[1:])
        at = np.flatnonzero(lab >= 0)
        if at.size == 0:
            return []
        previous = np.empty_like(tok)
        previous[0], previous[1:] = tokens[0], tok[:-1]
        emitted = np.flatnonzero((tok != 0) & (tok != self._space) & (tok != previous))
        summed = np.zeros(emitted.size + 1)
        np.cumsum(self._emissions[emitted + offset, tok[emitted]], out=summed[1:])
        ends = np.searchsorted(emitted, at)  # each word's tokens: emitted[begins[k] : ends[k]]
        begins = np.empty_like(ends)
        begins[0], begins[1:] = 0, ends[:-1]
        count = ends - begins
        spelled = count > 0  # (a word whose tokens were all in frames already committed: at its break)
        rows = np.append(emitted, 0)  # (indexable where a word has no tokens)
        first = self._origin + self._dropped + offset
        starts = (first + np.where(spelled, rows[begins], at)) * self.frame_ms
        stops = (first + 1 + np.where(spelled, rows[ends - 1], at)) * self.frame_ms
        means = (summed[ends] - summed[begins]) / np.maximum(count, 1)
        words = self.lexicon.words
        return [
            Word(words[label], start, stop, confidence)
            for label, start, stop, confidence in zip(
                lab[at].tolist(), starts.tolist(), stops.tolist(), np.exp(means).tolist(), strict=True
            )
        ]

    def _held_words(self) -> list[Word]:
        """The best path's words in the held frames. Those up to the last word read before are read again only
        if the path up to it changed (interims ask for the words after every change)."""
        tokens, labels = self._result.tokens, self._result.words
        known_tokens, known_labels, known, upto = self._known
        if (
            upto
            and len(labels) >= upto
            and labels[:upto] == known_labels[:upto]
            and tokens[:upto] == known_tokens[:upto]
        ):
            words = known + self._words_of(tokens[upto - 1 :], labels[upto - 1 :], upto - 1)
        else:
            words = self._words_of(tokens, labels)
        last = len(labels) - 1  # the index of the last word (a path ends a frame or two after it)
        while last > 0 and labels[last] < 0:
            last -= 1
        self._known = (tokens, labels, words, last + 1 if last > 0 else 0)
        return words

    def _partial_word(self) -> Word | None:
        """The word in progress as the text shows it (its letters, or the likeliest word its spelling can
        become), over the frames of its tokens; None when none is shown."""
        if not self._shown:
            return None
        # Its tokens are the last len(partial) new non-break tokens of the frames traced back.
        ids = self._best_ids[: self._traced]
        rows: list[int] = []
        for row in range(self._traced - 1, -1, -1):
            token = int(ids[row])
            if token not in (0, self._space) and (row == 0 or ids[row - 1] != token):
                rows.append(row)
                if len(rows) == len(self._partial):
                    break
        rows.reverse()
        lps = self._emissions[rows, list(self._partial[-len(rows) :])].tolist() if rows else [0.0]
        word = self._shown
        first, ms = self._origin + self._dropped, self.frame_ms
        start, end = (rows[0], rows[-1] + 1) if rows else (self._traced, self._traced)
        return Word(word, (first + start) * ms, (first + end) * ms, math.exp(sum(lps) / len(lps)))

    def finalize(self) -> None:
        """The utterance has ended: finish the word in progress with a word break, score ``</s>``, and keep the
        best hypothesis. From here until :meth:`reset`, :attr:`text` and :meth:`words` describe it."""
        row = self._emissions[self._held : self._held + 1]  # (push leaves room for it: it prunes when full)
        row[:] = _NEG
        row[0, self._space] = 0.0
        self._best_ids[self._held] = self._space
        self._decoder.decode_step(row.ctypes.data, 1, self._vocab_size)
        self._held += 1
        self._decoder.decode_end()
        self._hypotheses = self._decoder.get_all_final_hypothesis()  # best first
        result = self._hypotheses[0] if self._hypotheses else self._decoder.get_best_hypothesis(0)
        self._finished = self._committed + self._words_of(result.tokens, result.words)

    def alternatives(self, n: int) -> list[Alternative]:
        """After :meth:`finalize`: the ``n`` best distinct word sequences of the final hypotheses (which
        flashlight returns sorted by score), best first; the first is :attr:`text`."""
        scored = [(0.0, tuple(self._finished or ()))]
        for h in self._hypotheses[1 : 4 * n]:  # (distinct words are rarer than distinct token paths)
            scored.append(
                (h.score - self._hypotheses[0].score, tuple(self._committed + self._words_of(h.tokens, h.words)))
            )
        return ranked_alternatives(scored, self.confidence, n)

    @property
    def text(self) -> str:
        """The best hypothesis so far (the word in progress included, unless interims must only grow)."""
        if self._finished is not None:
            return " ".join(w.word for w in self._finished)
        if self._text is None:
            words = self.lexicon.words
            parts = [w.word for w in self._committed]
            parts += [words[label] for label in self._labels]
            if self._shown:
                parts.append(self._shown)
            self._text = " ".join(parts)
        return self._text

    def _partial_text(self) -> str:
        if self.lexicon.spelled:
            return "".join(self.lexicon.vocabulary[t] for t in self._partial)
        return self.lexicon.guess(self._partial) or "" if self._partial else ""

    def words(self) -> list[Word]:
        if self._finished is not None:
            return list(self._finished)
        if self._cache is None:
            self._cache = self._committed + self._held_words()
            partial = self._partial_word()
            if partial is not None:
                self._cache.append(partial)
        return list(self._cache)

    @property
    def confidence(self) -> float:
        """Mean word confidence (0.0 while nothing is decoded)."""
        words = self.words()
        return sum(w.confidence for w in words) / len(words) if words else 0.0
