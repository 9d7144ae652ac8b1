"""The HTTP port: OpenAI-shaped APIs and the captioning page (``app.py``). Its settings are here so that
a server with the port off never imports aiohttp."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HttpConfig:
    host: str = "0.0.0.0"
    port: int = 0  # 0: any free port
    max_upload_bytes: int = 25 << 20  # a larger file is refused with 413 (OpenAI's limit is 25 MB)
    ws_idle_timeout_s: float = 60.0  # a Realtime WebSocket with no client event this long: error, then close 1000
