"""The engine: sessions, the step scheduler and the tick loop that drives the runtime."""
