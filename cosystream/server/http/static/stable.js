// The interim as a caption shows it: the longest prefix of its words each of which has stood unchanged (the
// same word after the same words) for HOLD_MS, and never fewer words than were on show: a revised word
// already on screen is replaced at once rather than blanked. A beam search's interim may revise its newest
// words ("the can" -> "the cat"); holding them back until they have lasted hides most revisions, at the
// cost of showing each word HOLD_MS later. An interim whose stability is 1 (greedy decoding: it only grows) is
// shown whole at once. The same rule as StableInterim in clients/caption.py (docs/CLIENTS.md); a test
// feeds both the same interims and compares what they show.

export const HOLD_MS = 400; // measured with benchmarks/flicker.py (docs/CLIENTS.md)

export class StableInterim {
  constructor(holdMs = HOLD_MS) {
    this.holdMs = holdMs;
    this.words = [];
    this.sinceMs = []; // per word: when it took its current form (non-decreasing)
    this.onShow = 0; // words on show when the interim came: they stay on show
  }

  settled(nowMs) {
    const settledMs = nowMs - this.holdMs;
    let count = 0;
    while (count < this.words.length && this.sinceMs[count] <= settledMs) count++;
    return Math.max(count, this.onShow);
  }

  /** A new interim at `nowMs`; words it keeps keep their age. */
  update(text, nowMs, stability = 0) {
    const words = text.split(/\s+/).filter(Boolean);
    this.onShow = Math.min(this.settled(nowMs), words.length);
    let kept = 0;
    while (kept < Math.min(words.length, this.words.length) && words[kept] === this.words[kept]) kept++;
    if (stability >= 1) {
      this.sinceMs = words.map(() => -Infinity); // it only grows: every word counts as settled
    } else {
      this.sinceMs = [...this.sinceMs.slice(0, kept), ...words.slice(kept).map(() => nowMs)];
    }
    this.words = words;
  }

  /** The words to show at `nowMs`. */
  shown(nowMs) {
    return this.words.slice(0, this.settled(nowMs)).join(" ");
  }

  /** When the next held word is due to be shown (null: none is held). */
  nextRevealMs(nowMs) {
    const next = this.settled(nowMs);
    return next < this.words.length ? this.sinceMs[next] + this.holdMs : null;
  }

  reset() {
    this.words = [];
    this.sinceMs = [];
    this.onShow = 0;
  }
}
