"""Engine output to text: greedy CTC, the lexicon-constrained beam search, the word n-gram LM, and their config."""
