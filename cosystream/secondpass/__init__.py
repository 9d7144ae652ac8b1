"""The second pass: a real-speech Whisper model re-transcribes each finished utterance, in a worker process,
and its text becomes the utterance's final (``serve --final-model``). Imports neither torch nor grpc."""
