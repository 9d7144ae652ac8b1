"""``cosystream eval``: word and character error rates and real-time factor of a model on a test set.

Audio streams through the same ``Runner`` and state slab the server uses (16 frames a step, then single
frames for the tail), decoded with the same decoder the server would use (``--decoder``: beam search with
the model's language model by default, or greedy), without VAD: one hypothesis per file.

A test set is a directory of ``NAME.wav`` files, each with its transcript in ``NAME.txt``, or a JSONL
manifest of ``{"audio": PATH, "text": TRANSCRIPT}`` lines (paths relative to the manifest).
``--telephone`` first passes the audio through an 8 kHz G.711 mu-law round trip, as a phone call would;
``--tilt DB`` through a spectral tilt of ``DB`` dB per octave around 1 kHz, as a bright (positive) or muffled
(negative) microphone would: a measure of how much the channel, not the words, moves the scores.

``final_model`` (a second-pass Whisper model, as ``serve --final-model`` takes) also re-transcribes each
utterance, the same audio the streaming model got, and its text becomes the final hypothesis unless the second
pass gated it or said nothing (then the streaming hypothesis stands, as in the server). The final is scored as
``wer``/``cer``, the streaming model's alone as ``first_pass_wer``/``first_pass_cer``; ``second_pass_share`` is
the fraction of finals that came from Whisper and ``second_pass_rtf`` its compute over the audio
(``real_time_factor`` stays the streaming model's: the server runs the second pass in its own process).
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soxr
import torch

from cosystream.app.transcribe import read_wav
from cosystream.audio.codecs import MULAW_TO_INT16, encode_mulaw
from cosystream.decoding.beam import BeamCtcDecoder
from cosystream.decoding.config import DecoderConfig, DecoderFactory
from cosystream.decoding.greedy import CtcDecoder
from cosystream.models import FRAME_SAMPLES, load_model, output_delay_frames
from cosystream.runtime.runner import Runner, RunnerConfig
from cosystream.runtime.slab import StateSlab
from cosystream.secondpass.whisper import WhisperTranscriber

STEP_FRAMES = 16


@dataclass(slots=True)
class Utterance:
    name: str
    audio: np.ndarray  # float32, 16 kHz
    reference: str


@dataclass(slots=True)
class Scored:
    name: str
    reference: str
    hypothesis: str
    word_errors: int
    words: int
    char_errors: int
    chars: int


def score(name: str, reference: str, hypothesis: str) -> Scored:
    """One utterance's errors; ``reference`` normalized, ``hypothesis`` in the model's alphabet."""
    return Scored(
        name,
        reference,
        hypothesis,
        edit_distance(reference.split(), hypothesis.split()),
        len(reference.split()),
        edit_distance(list(reference), list(hypothesis)),
        len(reference),
    )


def error_rates(scored: list[Scored]) -> tuple[float, float]:
    """(WER, CER) over a test set's scored utterances."""
    words = sum(s.words for s in scored)
    chars = sum(s.chars for s in scored)
    return sum(s.word_errors for s in scored) / max(1, words), sum(s.char_errors for s in scored) / max(1, chars)


def normalize(text: str) -> str:
    """Lower case, the model's alphabet (a-z, apostrophe), single spaces."""
    text = re.sub(r"[^a-z' ]+", " ", text.lower().replace("-", " "))
    return " ".join(word.strip("'") for word in text.split() if word.strip("'"))


def edit_distance(reference: list, hypothesis: list) -> int:
    previous = list(range(len(hypothesis) + 1))
    for i, ref in enumerate(reference, start=1):
        current = [i]
        for j, hyp in enumerate(hypothesis, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ref != hyp)))
        previous = current
    return previous[-1]


def set_files(path: Path) -> list[tuple[Path, str]]:
    """A test set's ``(WAV path, transcript)`` pairs: a directory of NAME.wav + NAME.txt, or a JSONL manifest."""
    if path.is_dir():
        pairs = [(wav, wav.with_suffix(".txt").read_text()) for wav in sorted(path.glob("*.wav"))]
    else:
        pairs = []
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                pairs.append((path.parent / entry["audio"], entry["text"]))
    if not pairs:
        raise ValueError(f"{path}: no WAV files with transcripts")
    return pairs


def load_set(path: Path) -> list[Utterance]:
    utterances = []
    for wav, text in set_files(path):
        samples, rate = read_wav(str(wav))
        audio = soxr.resample(samples.astype(np.float32) / 32768, rate, 16000).astype(np.float32)
        utterances.append(Utterance(Path(wav).stem, audio, text))
    return utterances


def telephone(audio: np.ndarray) -> np.ndarray:
    """16 kHz -> 8 kHz -> G.711 mu-law -> 8 kHz -> 16 kHz."""
    narrow = soxr.resample(audio, 16000, 8000)
    decoded = MULAW_TO_INT16[np.frombuffer(encode_mulaw(narrow), np.uint8)].astype(np.float32) / 32768
    return soxr.resample(decoded, 8000, 16000).astype(np.float32)


def tilt(audio: np.ndarray, db_per_octave: float, max_db: float = 24.0) -> np.ndarray:
    """``audio`` filtered by a gain of ``db_per_octave`` dB per octave away from 1 kHz (at most ``max_db`` either
    way), peak-normalized to its own peak."""
    if not db_per_octave:
        return audio
    nfft = 1 << max(1, (audio.size - 1).bit_length())
    freqs = np.fft.rfftfreq(nfft, 1 / 16000)
    freqs[0] = freqs[1]
    gain_db = np.clip(db_per_octave * np.log2(freqs / 1000.0), -max_db, max_db)
    out = np.fft.irfft(np.fft.rfft(audio, nfft) * 10 ** (gain_db / 20), nfft)[: audio.size]
    return (out * (np.abs(audio).max() / (np.abs(out).max() + 1e-9))).astype(np.float32)


def eval_runner(model: torch.nn.Module, top_k: int) -> Runner:
    """A one-slot runner that steps 16 frames at a time, then single frames for a file's tail."""
    config = RunnerConfig(max_batch=1, frame_buckets=(1, STEP_FRAMES), top_k=top_k)
    return Runner(model, StateSlab(model.cache_specs(), 1), config)


def stream(runner: Runner, audio: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """Stream ``audio`` through one slot of ``runner``: per step, the top-k token ids and log-probs of its
    frames (``[frames, K]``) and its first frame's index. Like the server, it ends with the model's output
    delay in silence (none for a model without right context)."""
    delay = output_delay_frames(runner.model)
    if delay:
        audio = np.concatenate([audio, np.zeros(delay * FRAME_SAMPLES, dtype=audio.dtype)])
    slot = runner.slab.alloc()
    try:
        frames = len(audio) // FRAME_SAMPLES
        done = 0
        while done < frames:
            step = STEP_FRAMES if frames - done >= STEP_FRAMES else 1
            result = runner.run([slot], audio[done * FRAME_SAMPLES : (done + step) * FRAME_SAMPLES][None])
            yield result.ids[0], result.logprobs[0], done
            done += step
    finally:
        runner.slab.free(slot)


def decode(
    decoder: CtcDecoder | BeamCtcDecoder, outputs: Iterable[tuple[np.ndarray, np.ndarray, int]]
) -> tuple[str, float]:
    """The hypothesis for one file's model outputs (as :func:`stream` yields them) and the seconds spent in
    the decoder."""
    decoder.reset()
    decode_s = 0.0
    for ids, logprobs, first_frame in outputs:
        started = time.perf_counter()
        decoder.push(ids, logprobs, first_frame)
        decode_s += time.perf_counter() - started
    started = time.perf_counter()
    decoder.finalize()
    return decoder.text, decode_s + time.perf_counter() - started


def evaluate(
    model_path: str | None,
    test_set: Path,
    telephone_band: bool = False,
    decoding: DecoderConfig | None = None,
    tilt_db: float = 0.0,
    precision: str = "float32",
    final_model: str | None = None,
) -> dict:
    """Scores of ``model_path`` on ``test_set`` (see the module docstring), with examples. ``final_model``
    adds the second pass (raises :class:`~cosystream.secondpass.whisper.ModelError` if it cannot load)."""
    torch.set_num_threads(1)
    model = load_model(model_path, precision=precision)
    decoding = (decoding or DecoderConfig()).resolve(model_path)
    runner = eval_runner(model, decoding.top_k)
    decoder = DecoderFactory(decoding, model.vocabulary)()
    transcriber = WhisperTranscriber(final_model) if final_model else None
    scored, first_scored, gated = [], [], []
    audio_s, compute_s, decode_s, second_pass_s = 0.0, 0.0, 0.0, 0.0
    for utterance in load_set(test_set):
        audio = tilt(utterance.audio, tilt_db)
        audio = telephone(audio) if telephone_band else audio
        started = time.perf_counter()
        hypothesis, decoding_s = decode(decoder, stream(runner, audio))
        compute_s += time.perf_counter() - started
        decode_s += decoding_s
        audio_s += len(audio) / 16000
        reference = normalize(utterance.reference)
        if transcriber is not None:
            first_scored.append(score(utterance.name, reference, hypothesis))
            second = transcriber.transcribe(audio)
            second_pass_s += second.compute_s
            # As the server: a gated or empty answer leaves the streaming final standing.
            gated.append(second.gated or ("" if second.text else "empty"))
            hypothesis = hypothesis if gated[-1] else second.text
        scored.append(score(utterance.name, reference, hypothesis))
    wer, cer = error_rates(scored)
    result = {
        "test_set": str(test_set),
        "telephone": telephone_band,
        "tilt_db_per_octave": tilt_db,
        "decoder": decoding.kind,
        "precision": precision,
        "utterances": len(scored),
        "audio_seconds": audio_s,
        "wer": wer,
        "cer": cer,
        "real_time_factor": compute_s / max(audio_s, 1e-9),
        # Decoder time per 10 ms frame (the rest of the real-time factor is the model).
        "decode_us_per_frame": decode_s / max(audio_s * 100, 1e-9) * 1e6,
        "examples": [{"name": s.name, "reference": s.reference, "hypothesis": s.hypothesis} for s in scored],
    }
    if transcriber is not None:
        result["final_model"] = final_model
        result["first_pass_wer"], result["first_pass_cer"] = error_rates(first_scored)
        result["second_pass_share"] = gated.count("") / max(1, len(gated))
        result["second_pass_rtf"] = second_pass_s / max(audio_s, 1e-9)
        # Why the streaming final stood, by reason ("no_speech", "low_confidence", "empty", "loop").
        result["second_pass_gated"] = {reason: gated.count(reason) for reason in sorted(set(gated) - {""})}
        for example, first, reason in zip(result["examples"], first_scored, gated, strict=True):
            example["first_pass"] = first.hypothesis
            example["second_pass_gated"] = reason
    return result


def eval_command(
    model_path: str | None,
    test_set: str,
    decoding: DecoderConfig,
    telephone_band: bool = False,
    tilt_db: float = 0.0,
    json_path: str | None = None,
    show: int = 5,
    precision: str = "float32",
    final_model: str | None = None,
) -> int:
    """``cosystream eval``: scores printed (and written to ``json_path``); 1 with the reason on failure.
    ``final_model``: score with the Whisper second pass too (see :func:`evaluate`)."""
    try:
        result = evaluate(model_path, Path(test_set), telephone_band, decoding, tilt_db, precision, final_model)
    except (OSError, EOFError, ValueError, KeyError, ImportError) as err:
        print(f"cosystream eval: {err}", file=sys.stderr)
        return 1
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    for example in result["examples"][:show]:
        print(f"{example['name']}\n  ref: {example['reference']}\n  hyp: {example['hypothesis']}")
        if "first_pass" in example and example["first_pass"] != example["hypothesis"]:
            print(f"  1st: {example['first_pass']}")
    band = "8 kHz mu-law" if result["telephone"] else "16 kHz"
    if precision != "float32":
        band += f", {precision}"
    if result["tilt_db_per_octave"]:
        band += f", tilted {result['tilt_db_per_octave']:+g} dB/octave"
    decoder = result["decoder"]
    second_pass = ""
    if "final_model" in result:
        decoder += f" + second pass {result['final_model']}"
        second_pass = (
            f"  second pass: {result['second_pass_share'] * 100:.0f}% of finals, RTF {result['second_pass_rtf']:.3f}"
            f"; first pass alone WER {result['first_pass_wer'] * 100:.1f}%  CER {result['first_pass_cer'] * 100:.1f}%"
        )
    print(
        f"{result['utterances']} utterances, {result['audio_seconds']:.0f} s ({band}, {decoder}): "
        f"WER {result['wer'] * 100:.1f}%  CER {result['cer'] * 100:.1f}%  RTF {result['real_time_factor']:.3f}"
        f"  (decoder {result['decode_us_per_frame']:.0f} us/frame)" + second_pass
    )
    return 0
