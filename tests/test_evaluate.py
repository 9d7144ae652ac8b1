"""``cosystream eval``: scoring, test-set loading and the end-to-end command."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from cosystream.app.evaluate import edit_distance, evaluate, normalize, telephone, tilt
from tests.speech import needs_espeak


def test_edit_distance():
    assert edit_distance([], []) == 0
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance(["the", "cat", "sat"], ["the", "cat", "sat"]) == 0
    assert edit_distance(["the", "cat", "sat"], ["a", "cat", "sat", "down"]) == 2


def test_normalize():
    assert normalize("Hello, World!  It's 'quoted' -- well-known.") == "hello world it's quoted well known"


def test_telephone_band_keeps_length_and_removes_high_frequencies():
    rate = 16000
    t = np.arange(rate) / rate
    audio = (0.3 * np.sin(2 * np.pi * 300 * t) + 0.3 * np.sin(2 * np.pi * 6000 * t)).astype(np.float32)
    narrow = telephone(audio)
    assert abs(len(narrow) - len(audio)) <= 2
    spectrum = np.abs(np.fft.rfft(narrow[:rate]))
    assert spectrum[6000] < 0.05 * spectrum[300]


def test_tilt_moves_each_octave_by_its_gain():
    """+6 dB per octave: 2 kHz gains 6 dB and 500 Hz loses 6 dB against 1 kHz; 0 leaves the audio alone."""
    rate = 16000
    t = np.arange(rate) / rate
    audio = sum(0.1 * np.sin(2 * np.pi * f * t) for f in (500, 1000, 2000)).astype(np.float32)
    assert tilt(audio, 0.0) is audio
    spectrum = np.abs(np.fft.rfft(tilt(audio, 6.0)))
    assert 20 * np.log10(spectrum[2000] / spectrum[1000]) == pytest.approx(6.0, abs=0.3)
    assert 20 * np.log10(spectrum[1000] / spectrum[500]) == pytest.approx(6.0, abs=0.3)
    assert len(tilt(audio, -6.0)) == len(audio)


@needs_espeak
def test_eval_command_on_a_directory(tmp_path):
    texts = ["the boy was there when the sun rose", "please call me back tomorrow"]
    for i, text in enumerate(texts):
        subprocess.run(["espeak-ng", "-w", str(tmp_path / f"u{i}.wav"), text], check=True)
        (tmp_path / f"u{i}.txt").write_text(text.upper() + "\n")
    result = evaluate(None, tmp_path)
    assert result["utterances"] == 2 and result["audio_seconds"] > 2
    assert [e["reference"] for e in result["examples"]] == texts
    assert result["wer"] >= 0 and result["cer"] >= 0 and 0 < result["real_time_factor"] < 1
    out = tmp_path / "scores.json"
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "cosystream",
            "--log-level",
            "ERROR",
            "eval",
            str(tmp_path),
            "--json",
            str(out),
            "--tilt",
            "-6",
            "--final-model",
            "off",  # (as serve takes it: the streaming model's finals alone)
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    assert "2 utterances" in completed.stdout and "tilted -6 dB/octave" in completed.stdout
    scores = json.loads(out.read_text())
    assert scores["utterances"] == 2 and scores["tilt_db_per_octave"] == -6.0 and "final_model" not in scores


def test_eval_reports_a_missing_set(tmp_path):
    with pytest.raises(ValueError, match="no WAV files"):
        evaluate(None, tmp_path)
