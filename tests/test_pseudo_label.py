"""``training.pseudo_label``: real recordings cut as the server cuts streams, labelled by the packaged Whisper,
written as training shards the trainer reads; real webrtcvad, real espeak-ng speech, the real second-pass
model."""

from __future__ import annotations

import json
import wave
from pathlib import Path

import numpy as np
import pytest
import soxr

from tests.speech import needs_espeak, silence, speech
from tests.test_second_pass import needs_whisper

FIRST = "please call me back at five o'clock tomorrow"
SECOND = "we will meet again next week"
UNSURE = "the weather is nice today"  # (the packaged tiny.en: "but weather is...", log-probability about -0.5)


def write_wav(path: Path, audio: np.ndarray, rate_hz: int) -> None:
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate_hz)
        out.writeframes((np.clip(audio, -1, 1 - 1 / 32768) * 32768).astype("<i2").tobytes())


@needs_espeak
def test_a_recording_is_cut_into_the_utterances_a_stream_of_it_would_have():
    from training.pseudo_label import utterances

    first, second = speech(FIRST), speech(SECOND)
    audio = np.concatenate([silence(0.5), first, silence(1.2), second, silence(1.0)])
    pcm = (audio * 32768).astype(np.int16)
    found = utterances(pcm)
    assert len(found) == 2, [len(u) for u in found]
    for utterance, spoken in zip(found, (first, second), strict=True):
        # the speech, with the pre-roll before it and the trailing silence the endpointer waits for
        assert len(spoken) - 1600 <= len(utterance) <= len(spoken) + 0.2 * 16000 + 0.5 * 16000 + 1600
    assert utterances(np.zeros(48000, np.int16)) == []
    # speech running to the end of the file is an utterance too (the stream's end finalizes it)
    assert len(utterances((np.concatenate([silence(0.5), first]) * 32768).astype(np.int16))) == 1


@needs_espeak
def test_recordings_become_shards_of_whispers_text_and_the_trainer_reads_them(tmp_path):
    needs_whisper()
    from training.corpus import load_shard
    from training.data import Corpus, load_eval
    from training.pseudo_label import main

    recordings = tmp_path / "recordings"
    recordings.mkdir()
    audio = np.concatenate(
        [silence(0.5), speech(FIRST), silence(1.2), speech(UNSURE), silence(1.2), speech(SECOND), silence(1.0)]
    )
    write_wav(recordings / "call.wav", soxr.resample(audio, 16000, 22050), 22050)  # (resampled on the way in)
    write_wav(recordings / "hold.wav", silence(3.0), 16000)  # nothing said: nothing labelled
    (recordings / "notes.wav").write_bytes(b"not audio at all " * 100)
    corpus = tmp_path / "corpus"
    summary_path = tmp_path / "summary.json"
    assert (
        main(
            [
                "--audio",
                str(recordings),
                "--out",
                str(corpus),
                "--min-logprob",
                "-0.3",
                "--json",
                str(summary_path),
            ]
        )
        == 0
    )

    summary = json.loads(summary_path.read_text())
    assert summary["files"] == 2 and summary["unreadable"] == [str(recordings / "notes.wav")]
    # the sentence Whisper was least sure of (it mishears it) is dropped: not sure enough to teach it
    assert summary["utterances"] == 3 and summary["kept"] == 2, summary
    assert summary["dropped"] == {"low_confidence": 1}, summary
    assert summary["shards"] == ["shard_pl_00000.npz"] and 0 < summary["real_time_factor"] < 5
    pcm, offsets, texts, voices = load_shard(corpus / "train" / "shard_pl_00000.npz")
    assert pcm.dtype == np.int16 and len(texts) == 2 and offsets[-1] == len(pcm)
    assert texts == [SECOND, FIRST]  # Whisper's text in the streaming models' alphabet, the shorter first
    assert voices == [f"pseudo:{recordings / 'call.wav'}"] * 2
    assert not (corpus / "eval").exists()

    trainer = Corpus(corpus)
    assert trainer.refresh() == ["shard_pl_00000.npz"]
    assert [text for _, text in (trainer.get("shard_pl_00000.npz", i) for i in range(2))] == texts

    # More recordings later: the next shard, the first untouched.
    assert main(["--audio", str(recordings / "call.wav"), "--out", str(corpus)]) == 0
    assert sorted(p.name for p in (corpus / "train").iterdir()) == ["shard_pl_00000.npz", "shard_pl_00001.npz"]

    # A held-out group of real speech: what training reports per group, and what eval_set exports.
    held_out = ["--audio", str(recordings / "call.wav"), "--out", str(corpus), "--min-logprob", "-0.3"]
    assert main([*held_out, "--held-out", "calls"]) == 0
    groups = load_eval(corpus)
    assert list(groups) == ["calls"] and groups["calls"][1] == [SECOND, FIRST]
    assert len(list((corpus / "train").iterdir())) == 2  # (nothing more for training)
    for taken in ("calls", "../escape"):
        with pytest.raises(SystemExit):
            main([*held_out, "--held-out", taken])
