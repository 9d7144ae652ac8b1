"""English text for the training corpus: public-domain fortune files, normalized to the model's alphabet.

Sources (Debian packages, installed under ``/usr/share/games/fortunes``):

* ``fortunes-min`` (the ``fortunes`` file) and ``fortunes`` (the other data files), BSD fortune(6)
  data; see ``/usr/share/doc/fortunes*/copyright``. The offensive collection (``fortunes-off``) is not used.
* For the language model only: WordNet 3.0's usage examples (``wordnet-base``, ``/usr/share/wordnet``;
  the WordNet 3.0 licence, a permissive BSD-style one: ``/usr/share/doc/wordnet-base/copyright``).

Normalization: lower case; numbers, ordinals, years, decimals, money and percentages spelled out; ``&`` ->
"and"; everything outside ``a-z``, apostrophe and space is removed. Sentences with code, URLs or other
material that does not read as speech are dropped rather than mangled.
"""

from __future__ import annotations

import re
from pathlib import Path

FORTUNE_DIR = Path("/usr/share/games/fortunes")
WORDNET_DIR = Path("/usr/share/wordnet")  # Debian wordnet-base
# Files that are not prose (ascii art, translations, code) are skipped.
SKIP_FILES = {"ascii-art", "art", "translate-me", "perl", "linux", "debian", "computers", "linuxcookie", "zippy"}
ALPHABET = set(" 'abcdefghijklmnopqrstuvwxyz")

_ONES = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
]
_TENS = ["zero", "ten", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_ORD = {
    "one": "first",
    "two": "second",
    "three": "third",
    "five": "fifth",
    "eight": "eighth",
    "nine": "ninth",
    "twelve": "twelfth",
}


def number_words(n: int) -> str:
    """Cardinal number in words, ``0 <= n < 10**12``."""
    if n < 20:
        return _ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return _TENS[tens] + ("" if ones == 0 else " " + _ONES[ones])
    if n < 1000:
        hundreds, rest = divmod(n, 100)
        return _ONES[hundreds] + " hundred" + ("" if rest == 0 else " and " + number_words(rest))
    for size, name in ((10**9, "billion"), (10**6, "million"), (1000, "thousand")):
        if n >= size:
            high, rest = divmod(n, size)
            tail = "" if rest == 0 else (" and " if rest < 100 else " ") + number_words(rest)
            return number_words(high) + " " + name + tail
    raise ValueError(n)


def ordinal_words(n: int) -> str:
    words = number_words(n).split()
    last = words[-1]
    if last in _ORD:
        last = _ORD[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return " ".join([*words[:-1], last])


def year_words(n: int) -> str:
    high, low = divmod(n, 100)
    if low == 0:
        return number_words(high) + " hundred"
    if low < 10:
        return number_words(high) + " oh " + number_words(low)
    return number_words(high) + " " + number_words(low)


def _number_token(match: re.Match[str]) -> str:
    text = match.group(0)
    money = text.startswith("$")
    text = text.lstrip("$")
    percent = text.endswith("%")
    text = text.rstrip("%")
    ordinal = re.fullmatch(r"(\d+)(st|nd|rd|th)", text)
    if ordinal:
        return " " + ordinal_words(int(ordinal.group(1))) + " "
    text = text.replace(",", "")
    if "." in text:
        whole, frac = text.split(".", 1)
        words = number_words(int(whole or "0")) + " point " + " ".join(_ONES[int(d)] for d in frac)
    else:
        value = int(text)
        if value >= 10**12:
            return " "
        if 1100 <= value <= 1999 or (2010 <= value <= 2099 and not money and "," not in match.group(0)):
            words = year_words(value)
        else:
            words = number_words(value)
    if money:
        words += " dollars"
    if percent:
        words += " percent"
    return " " + words + " "


_NUMBER = re.compile(r"\$?\d[\d,]*(\.\d+)?(st|nd|rd|th)?%?")
_BAD = re.compile(r"[{}<>=_/\\|@#~^*`\[\]]|https?:|www\.|\.com|\t")
_ABBREV = {
    "mr.": "mister",
    "mrs.": "missus",
    "dr.": "doctor",
    "st.": "saint",
    "vs.": "versus",
    "etc.": "et cetera",
    "e.g.": "for example",
    "i.e.": "that is",
    "jr.": "junior",
    "sr.": "senior",
    "mt.": "mount",
}


def normalize(sentence: str) -> str | None:
    """One raw sentence -> normalized text, or None if it should not be used."""
    if _BAD.search(sentence):
        return None
    text = sentence.replace("\u2019", "'").replace("`", "'").lower()
    for short, long in _ABBREV.items():
        text = text.replace(short, long)
    text = text.replace("&", " and ").replace("+", " plus ")
    text = _NUMBER.sub(_number_token, text)
    text = re.sub(r"[-\u2013\u2014:;,.!?\"()]", " ", text)
    # Apostrophes only inside words (don't, o'clock); quotes around words are dropped.
    text = re.sub(r"(?<![a-z])'|'(?![a-z])", " ", text)
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
