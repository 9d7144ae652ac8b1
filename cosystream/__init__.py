"""cosystream: a real-time, low-latency streaming speech engine."""

__version__ = "0.1.0"
