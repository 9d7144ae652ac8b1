"""English text for the training corpus: public-domain fortune files, normalized to the model's alphabet.

Sources (Debian packages, installed under ``/usr/share/games/fortunes``):

* ``fortunes-min`` (the ``fortunes`` file) and ``fortunes`` (the other data files), BSD fortune(6)
  data; see ``/usr/share/doc/fortunes*/copyright``. The offensive collection (``fortunes-off``) is not used.
* For the language model only: WordNet 3.0's usage examples (``wordnet-base``, ``/usr/share/wordnet``;
  the WordNet 3.0 licence, a permissive BSD-style one: ``/usr/share/doc/wordnet-base/copyright``).

Normalization (``cosystream/decoding/text.py``, shared with the server's second pass): lower case; numbers,
ordinals, years, decimals, money and percentages spelled out; ``&`` -> "and"; everything outside ``a-z``,
apostrophe and space is removed. Sentences with code, URLs or other material that does not read as speech
are dropped rather than mangled.
"""

from __future__ import annotations

import re
from pathlib import Path

from cosystream.decoding.text import ALPHABET, number_words, spell_out, unpunctuate

__all__ = ["fortune_sentences", "normalize", "number_words", "wordnet_examples"]

FORTUNE_DIR = Path("/usr/share/games/fortunes")
WORDNET_DIR = Path("/usr/share/wordnet")  # Debian wordnet-base
# Files that are not prose (ascii art, translations, code) are skipped.
SKIP_FILES = {"ascii-art", "art", "translate-me", "perl", "linux", "debian", "computers", "linuxcookie", "zippy"}

_BAD = re.compile(r"[{}<>=_/\\|@#~^*`\[\]]|https?:|www\.|\.com|\t")


def normalize(sentence: str) -> str | None:
    """One raw sentence -> normalized text, or None if it should not be used."""
    if _BAD.search(sentence):
        return None
    text = unpunctuate(spell_out(sentence))
    if any(c not in ALPHABET for c in text):
        return None
    words = text.split()
    if not 3 <= len(words) <= 26 or any(len(w) > 16 for w in words):
        return None
    return " ".join(words)


def fortune_sentences(directory: Path = FORTUNE_DIR) -> list[str]:
    """All usable normalized sentences, deduplicated, in a deterministic order."""
    out: dict[str, None] = {}
    for path in sorted(directory.iterdir()):
        if "." in path.name or path.is_dir() or path.name in SKIP_FILES:
            continue
        raw = path.read_text(encoding="utf-8", errors="replace")
        for entry in raw.split("\n%\n"):
            lines = []
            for line in entry.splitlines():
                stripped = line.strip()
                # Attribution lines and dialogue markup ("-- Mark Twain", "A:") end the prose.
                if stripped.startswith("--") or stripped.startswith("\u2014"):
                    break
                lines.append(stripped)
            body = " ".join(lines)
            body = re.sub(r"\s+", " ", body)
            for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'(])", body):
                norm = normalize(sentence)
                if norm:
                    out[norm] = None
    return list(out)


def wordnet_examples(directory: Path = WORDNET_DIR) -> list[str]:
    """WordNet 3.0's usage examples (the quoted phrases in its glosses, e.g. "she was able to program her
    computer"), normalized, deduplicated, in a deterministic order. Text for the language model only."""
    out: dict[str, None] = {}
    for pos in ("noun", "verb", "adj", "adv"):
        for line in (directory / f"data.{pos}").read_text(encoding="latin-1").splitlines():
            if line.startswith("  ") or "|" not in line:  # the licence header
                continue
            for example in re.findall(r'"([^"]+)"', line.split("|", 1)[1]):
                norm = normalize(example)
                if norm:
                    out[norm] = None
    return list(out)


if __name__ == "__main__":
    sents = fortune_sentences()
    print(len(sents), sum(len(s.split()) for s in sents))
    for s in sents[:: max(1, len(sents) // 30)]:
        print(s)
