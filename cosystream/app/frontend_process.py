"""The entry point of a spawned frontend process (frontends 1..N-1 of ``cosystream serve``).

A module of its own, so that unpickling the target of the spawned process imports only the frontend: the
supervisor's module imports the engine, and with it torch, which a frontend never needs (it costs ~1.3 s
of start-up and ~200 MB resident per frontend). ``scripts/check_layers.py`` checks that importing this
module loads no torch.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import replace

from cosystream.engine.prctl import exit_with_parent, set_process_name
from cosystream.frontend.quota import TokenSessions
from cosystream.logs import configure as configure_logs
from cosystream.server.frontend import Frontend, FrontendConfig


def frontend_main(
    config: FrontendConfig,
    address: str | list[str],
    authkey: bytes,
    log_level: str,
    log_format: str,
    index: int = 1,
    token_sessions: TokenSessions | None = None,
) -> None:
    """Run one frontend until SIGTERM, then drain (started with SIGHUP blocked, see ``supervisor``'s doc)."""
    exit_with_parent()
    set_process_name(f"cs-frontend-{index}")
    configure_logs(log_level, log_format)

    config = replace(config, stream=replace(config.stream, frontend_index=index))

    async def run() -> None:
        frontend = Frontend(config, address, authkey, token_sessions=token_sessions)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, frontend.reload_tokens)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
        await frontend.start()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, lambda: None)  # the supervisor forwards SIGTERM
        await stop.wait()
        await frontend.drain()

    asyncio.run(run())
