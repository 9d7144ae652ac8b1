"""English text in the streaming models' alphabet: lower case ``a-z``, apostrophe and space, numbers spelled out.

The training corpus (``training/text.py``) is normalized with these rules, so a model's output follows them;
text from elsewhere (the second pass's Whisper output: digits, punctuation, capitals) is put into the same
form with :func:`spoken_form` before it stands in for a model's transcript.
"""

from __future__ import annotations

import re

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


def number_token(match: re.Match[str]) -> str:
    """One match of :data:`NUMBER` (``$5``, ``3rd``, ``1984``, ``2.5%``) in words, with a space either side."""
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


NUMBER = re.compile(r"\$?\d[\d,]*(\.\d+)?(st|nd|rd|th)?%?")

ABBREVIATIONS = {
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


def spell_out(text: str) -> str:
    """Lower case, abbreviations and numbers in words, ``&`` and ``+`` as words: the steps shared by the
    corpus's normalizer and :func:`spoken_form`; punctuation is left for them."""
    text = text.replace("\u2019", "'").replace("`", "'").lower()
    for short, long in ABBREVIATIONS.items():
        text = text.replace(short, long)
    text = text.replace("&", " and ").replace("+", " plus ")
    return NUMBER.sub(number_token, text)


def unpunctuate(text: str) -> str:
    """Punctuation to spaces; apostrophes kept only inside words (don't, o'clock), quotes around words
    dropped."""
    text = re.sub(r"[-\u2013\u2014:;,.!?\"()]", " ", text)
    return re.sub(r"(?<![a-z])'|'(?![a-z])", " ", text)


def spoken_form(text: str) -> str:
    """Any English text in the models' alphabet: spelled out (:func:`spell_out`), unpunctuated, anything
    else outside the alphabet dropped, single spaces."""
    text = unpunctuate(spell_out(text))
    return " ".join("".join(c for c in text if c in ALPHABET).split())
