"""hama (a 2.2 M-parameter Conformer CTC over IPA phones, on PyPI) on the accuracy sets: a lighter second
pass, or a teacher for the streaming model?

For each test set (a directory of NAME.wav + NAME.txt, as ``cosystream eval`` and ``benchmarks/accuracy.py``
take; that benchmark's ``--real --prompts`` fetch the real-speech sets into ``.cache/accuracy``), per set:

* the phone error rate against the reference's phones from hama's own G2P (the same 189 symbols as its
  recognizer; word boundaries, stress and length marks and lone combining diacritics dropped on both
  sides), and against espeak-ng's (``espeak-ng -q --ipa -v en-us``, cut into hama's symbols by longest
  match): hama's recognizer repeats its G2P's mistakes, so the first flatters it and the second charges it
  with the two G2Ps' disagreements;
* WER and CER of the English text its phones-to-text model writes, fed 8 words at a time (longer inputs
  pass that model's 192-token limit), scored as ``cosystream eval`` scores (``normalize``);
* the real-time factor of the recognizer, and of the recognizer and the text model together (hama runs one
  thread; the first call, a warm-up, left out).

hama is a benchmark-only dependency: ``pip install hama==1.7.0`` (22.6 MB wheel, numpy only).

    python -m benchmarks.hama .cache/accuracy/pocketsphinx-recordings .cache/accuracy/asterisk-prompts-16k \\
        .cache/accuracy/asterisk-prompts-8k --json hama.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import numpy as np

from cosystream.app.evaluate import edit_distance, load_set, normalize
from cosystream.v1.client import HelpFormatter

HAMA = "hama==1.7.0"
MARKS = set("ˈˌːˑ")  # stress and length
TEXT_WORDS = 8  # words per call of the phones-to-text model


def phone(token: str) -> str:
    """``token`` without stress or length marks; "" for a lone combining diacritic."""
    token = "".join(c for c in token if c not in MARKS)
    return "" if all(unicodedata.category(c) == "Mn" for c in token) else token


def espeak_phones(text: str, symbols: set[str]) -> list[str]:
    ipa = subprocess.run(
        ["espeak-ng", "-q", "--ipa", "-v", "en-us", text], capture_output=True, text=True, check=True
    ).stdout
    ipa = "".join(c for c in ipa if c not in MARKS and c not in "_-").replace("dʒ", "d͡ʒ").replace("tʃ", "t͡ʃ")
    phones = []
    for word in ipa.split():
        i = 0
        while i < len(word):
            n = next((n for n in (3, 2) if word[i : i + n] in symbols), 1)
            phones.append(word[i : i + n])
            i += n
    return [p for p in map(phone, phones) if p]


def measure(test_set: Path) -> dict:
    import hama

    asr, g2p, p2g = hama.ASRModel(), hama.G2PModel(), hama.P2GModel()
    asr.transcribe_waveform(np.zeros(16000, np.float32), 16000)  # (warm-up)
    symbols = {t for t in asr.decoder_tokens if not t.startswith("<")}
    totals = dict.fromkeys(("phone_errors", "phones", "espeak_errors", "espeak_phones", "audio_s"), 0.0)
    totals |= dict.fromkeys(("word_errors", "words", "char_errors", "chars", "asr_s", "text_s"), 0.0)
    samples, utterances = [], load_set(test_set)
    for utterance in utterances:
        started = time.perf_counter()
        result = asr.transcribe_waveform(utterance.audio, 16000)
        recognized = time.perf_counter()
        words = [w for w in result.word_phoneme_text.split(" | ") if w.strip()]
        text = " ".join(
            p2g.predict(" | ".join(words[i : i + TEXT_WORDS])).text for i in range(0, len(words), TEXT_WORDS)
        )
        written = time.perf_counter()
        reference = [a.phoneme for a in g2p.predict(utterance.reference.lower()).alignments if a.phoneme.strip()]
        reference = [p for p in map(phone, reference) if p]
        heard = [p for p in map(phone, result.phonemes) if p]
        espeak = espeak_phones(utterance.reference, symbols)
        ref_text, hyp_text = normalize(utterance.reference), normalize(text)
        for key, value in (
            ("phone_errors", edit_distance(reference, heard)),
            ("phones", len(reference)),
            ("espeak_errors", edit_distance(espeak, heard)),
            ("espeak_phones", len(espeak)),
            ("word_errors", edit_distance(ref_text.split(), hyp_text.split())),
            ("words", len(ref_text.split())),
            ("char_errors", edit_distance(list(ref_text), list(hyp_text))),
            ("chars", len(ref_text)),
            ("audio_s", len(utterance.audio) / 16000),
            ("asr_s", recognized - started),
            ("text_s", written - recognized),
        ):
            totals[key] += value
        if len(samples) < 3:
            samples.append({"reference": ref_text, "text": hyp_text, "phones": result.word_phoneme_text})
    return {
        "set": test_set.name,
        "utterances": len(utterances),
        "per": totals["phone_errors"] / totals["phones"],
        "per_vs_espeak": totals["espeak_errors"] / totals["espeak_phones"],
        "wer": totals["word_errors"] / totals["words"],
        "cer": totals["char_errors"] / totals["chars"],
        "rtf_asr": totals["asr_s"] / totals["audio_s"],
        "rtf_asr_and_text": (totals["asr_s"] + totals["text_s"]) / totals["audio_s"],
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("sets", nargs="+", type=Path, help="test sets: directories of NAME.wav + NAME.txt")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    try:
        import hama  # noqa: F401
    except ImportError:
        raise SystemExit(f"this benchmark needs hama: pip install {HAMA}") from None
    results = [measure(path) for path in args.sets]
    if args.json:
        Path(args.json).write_text(json.dumps(results, ensure_ascii=False, indent=1))
    print(f"\n{'set':<28} {'utts':>5} {'PER':>6} {'PER (espeak)':>13} {'WER':>6} {'CER':>6} {'RTF asr/+text':>14}")
    for r in results:
        print(
            f"{r['set']:<28} {r['utterances']:>5} {r['per']:>6.1%} {r['per_vs_espeak']:>13.1%} {r['wer']:>6.1%} "
            f"{r['cer']:>6.1%} {r['rtf_asr']:>7.3f}/{r['rtf_asr_and_text']:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
