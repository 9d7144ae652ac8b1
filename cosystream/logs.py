"""Log set-up shared by every process: plain text, or one JSON object per line (``--log-format json``).

Records about a session carry ``session_id`` (passed as ``extra={"session_id": ...}``), which the JSON
format emits as its own field, so a log pipeline can follow one stream across processes.
"""

from __future__ import annotations

import json
import logging

TEXT_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "process": record.processName,
            "logger": record.name,
            "message": record.getMessage(),
        }
        session_id = getattr(record, "session_id", None)
        if session_id is not None:
            entry["session_id"] = session_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure(level: str, fmt: str = "text") -> None:
    """Every record at ``level`` (one of ``LEVELS``, any case) or above to stderr, as text or JSON lines; the
    processes a server starts are handed the same two settings."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
