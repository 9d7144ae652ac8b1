"""A pronunciation lexicon from espeak-ng, for models whose output units are phonemes instead of letters.

``python -m training.phonemes --out runs/lexicon.tsv`` writes one line per word: the word, a tab, and its
phonemes as *units*, one character each (the model's vocabulary is ``<blank>``, the word separator
``" "`` and these characters). espeak-ng's phoneme names ("aI", "tS", "3:") become single characters so
that a unit string can be handled like a spelling (greedy decoding, edit distance, the beam search's
lexicon trie); ``--names`` also writes the unit -> espeak-ng name table.

Words are pronounced one at a time, in isolation, with the ``en-us`` voice, by libespeak-ng through ctypes
(the same library the corpus voices use). Stress, syllable and pause marks are dropped, and so are
espeak-ng's variant marks on vowels ("@2", "I2", "a#"), which name the same sound in different spelling
contexts; a few sounds that only foreign words use are merged into the nearest English one.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from cosystream.decoding.g2p import Espeak
from cosystream.decoding.lexicon import read_spellings as read_lexicon
from cosystream.decoding.lm import NgramLm


def unit_table(names: Iterable[str]) -> dict[str, str]:
    """espeak-ng name -> one character: one-character names stay as they are (except the word separator and
    the apostrophe), longer ones get letters from U+0100 on, in sorted order (so the table is stable)."""
    names = sorted(set(names))
    table: dict[str, str] = {}
    taken: set[str] = set()
    for name in names:
        if len(name) == 1 and name not in " '":
            table[name] = name
            taken.add(name)
    code = 0x100
    for name in names:
        if name in table:
            continue
        while chr(code) in taken:
            code += 1
        table[name] = chr(code)
        taken.add(chr(code))
    return table


__all__ = [
    "Espeak",
    "build",
    "lexicon_lines",
    "read_lexicon",
    "to_units",
    "unit_table",
    "vocabulary",
    "write_lexicon",
]


def build(words: Iterable[str], voice: str = "en-us") -> tuple[dict[str, str], dict[str, str]]:
    """(word -> unit string, unit -> espeak-ng name) for ``words``; words espeak-ng gives nothing for are
    left out."""
    espeak = Espeak(voice)
    prons = {w: espeak.phonemes(w) for w in sorted(set(words))}
    prons = {w: p for w, p in prons.items() if p}
    table = unit_table(n for p in prons.values() for n in p)
    lexicon = {w: "".join(table[n] for n in p) for w, p in prons.items()}
    return lexicon, {u: n for n, u in table.items()}


def lexicon_lines(lexicon: dict[str, str]) -> list[str]:
    """The lexicon file's lines, ``word<TAB>units``, sorted by word."""
    return [f"{word}\t{lexicon[word]}\n" for word in sorted(lexicon)]


def write_lexicon(lexicon: dict[str, str], path: str | Path) -> None:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(lexicon_lines(lexicon))


def vocabulary(lexicon: dict[str, str]) -> list[str]:
    """The model vocabulary for ``lexicon``: blank, word separator, then its units in sorted order."""
    return ["<blank>", " ", *sorted({u for units in lexicon.values() for u in units})]


def to_units(text: str, lexicon: dict[str, str]) -> str:
    """``text``'s words as unit strings, space separated (words the lexicon lacks are dropped)."""
    return " ".join(lexicon[w] for w in text.split() if w in lexicon)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, default=Path("data/corpus"), help="its sentences.json")
    p.add_argument("--lm", type=Path, default=Path("cosystream/models/default/lm.arpa.gz"))
    p.add_argument("--voice", default="en-us")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--names", type=Path, help="also write the unit -> espeak-ng name table (JSON)")
    args = p.parse_args(argv)

    words: set[str] = set()
    sentences = json.loads((args.corpus / "sentences.json").read_text())
    for part in sentences.values():
        for s in part:
            words.update(s.split())
    lm = NgramLm.load(args.lm)
    words.update(w for w in lm.words if lm.known(w))
    lexicon, names = build(words, args.voice)
    write_lexicon(lexicon, args.out)
    if args.names:
        args.names.write_text(json.dumps(names, indent=1, ensure_ascii=False) + "\n")
    counts = Counter(u for units in lexicon.values() for u in units)
    print(f"{len(lexicon)} words, {len(counts)} units -> {args.out}")
    for unit, n in counts.most_common():
        print(f"  {unit} {names[unit]:>4} {n}")


if __name__ == "__main__":
    main()
