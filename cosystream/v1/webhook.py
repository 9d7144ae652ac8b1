"""Results POSTed to a webhook as JSON: the telephony gateway's ``--webhook`` and the server's
``serve --media-webhook`` (the telephony WebSockets' messages).

Messages are POSTed in order, one at a time, from one task of the running event loop with one aiohttp
session (kept-alive connections). A slow or failing webhook never holds up a call: beyond
``max_queued`` messages waiting, new ones are dropped and counted; failures are logged, never retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import aiohttp

log = logging.getLogger(__name__)


class WebhookPoster:
    def __init__(self, url: str, timeout_s: float = 5.0, max_queued: int = 1000):
        self.url = url
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(max_queued)
        self._task: asyncio.Task | None = None
        self.posted = 0
        self.dropped = 0
        self.failed = 0

    def start(self) -> None:
        """Start posting (on the running loop); :meth:`post` starts it too."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._post_all(), name="webhook")

    def post(self, message: dict) -> None:
        self.start()
        try:
            self._queue.put_nowait(json.dumps(message).encode())
        except asyncio.QueueFull:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 100 == 0:
                log.warning("webhook %s is behind: %d messages dropped", self.url, self.dropped)

    async def stop(self, grace_s: float = 5.0) -> None:
        """POST what is queued (for up to ``grace_s``), then stop."""
        if self._task is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._queue.join(), grace_s)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None

    async def _post_all(self) -> None:
        headers = {"Content-Type": "application/json", "User-Agent": "cosystream"}
        async with aiohttp.ClientSession(timeout=self.timeout, headers=headers) as session:
            while True:
                body = await self._queue.get()
                try:
                    async with session.post(self.url, data=body) as response:
                        await response.read()
                        if response.status >= 400:
                            raise aiohttp.ClientResponseError(
                                response.request_info, (), status=response.status, message=response.reason or ""
                            )
                    self.posted += 1
                except (aiohttp.ClientError, TimeoutError, OSError) as err:
                    self.failed += 1
                    if self.failed <= 20 or self.failed % 1000 == 0:
                        log.warning(
                            "media webhook %s: %s (%d failed)", self.url, err or type(err).__name__, self.failed
                        )
                finally:
                    self._queue.task_done()
