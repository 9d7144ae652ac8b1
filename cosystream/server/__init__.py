"""gRPC frontend: audio decoding, VAD and endpointing, CTC text, and the servicer."""
