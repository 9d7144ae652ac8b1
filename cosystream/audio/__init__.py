"""Audio on the CPU: wire codecs, resampling to 16 kHz, 10 ms framing, WAV headers, VAD and endpointing."""
