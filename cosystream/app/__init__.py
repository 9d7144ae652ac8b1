"""The application: the command line, the process supervisor, the in-process server, the naive baseline, transcribe and eval."""
