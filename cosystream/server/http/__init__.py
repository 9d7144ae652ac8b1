"""The HTTP port: OpenAI-shaped APIs and the captioning page (``app.py``). Its settings are here so that
a server with the port off never imports aiohttp."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HTTP_PORT = 8080
"""``cosystream serve``'s HTTP port (``--http-port``; 0 there turns the port off)."""
MIB = 1 << 20
"""The unit of ``--max-upload-mb``: OpenAI's "25 MB" upload limit is 25 MiB (26214400 bytes)."""


@dataclass(frozen=True, slots=True)
class HttpConfig:
    host: str = "0.0.0.0"
    port: int = DEFAULT_HTTP_PORT  # 0: any free port
    max_upload_bytes: int = 25 * MIB  # a larger file is refused with 413 (OpenAI's limit, 25 MiB)
    idle_timeout_s: float = 30.0  # a connection with no request this long is closed (none yet, or kept alive)
    # Without tokens the port answers its own pages only: Origins (beside its own) and Host names (beside
    # localhost, the machine's name, the bound address and any IP address) that it answers too. "*": any.
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    max_upload_audio_s: float = 3600.0  # a longer file is refused with 400 before it is decoded (its header says)
    ws_idle_timeout_s: float = 60.0  # a Realtime WebSocket with no event either way this long: error, close 1000
    media_webhook: str = ""  # POST every message of the telephony WebSockets here too (media_streams.py)
