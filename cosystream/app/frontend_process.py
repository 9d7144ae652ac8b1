"""The entry point of a spawned frontend process (every frontend of ``cosystream serve``).

A module of its own, so that unpickling the target of the spawned process imports only the frontend: the
supervisor's module imports the engine, and with it torch, which a frontend never needs (it costs ~1.3 s
of start-up and ~200 MB resident per frontend). ``scripts/check_layers.py`` checks that importing this
module loads no torch.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from dataclasses import replace
from multiprocessing.connection import Connection

from cosystream.frontend.quota import TokenSessions
from cosystream.logs import configure as configure_logs
from cosystream.prctl import exit_with_parent, set_process_name
from cosystream.secondpass.whisper import ModelError
from cosystream.server.auth import TokenFileError
from cosystream.server.frontend import Frontend, FrontendConfig
from cosystream.server.tls import TlsError

# What a frontend that cannot serve raises, with a message that says why: a tokens or TLS file that changed
# since the CLI read it, a second-pass model that cannot load, a port or socket it cannot bind, a missing extra.
_CANNOT_SERVE = (TokenFileError, TlsError, ModelError, OSError, ImportError)


def frontend_main(
    config: FrontendConfig,
    address: str | list[str],
    authkey: bytes,
    log_level: str,
    log_format: str,
    index: int = 1,
    token_sessions: TokenSessions | None = None,
    ready: Connection | None = None,
) -> None:
    """Run one frontend until SIGTERM, then drain (started with SIGHUP blocked, see ``supervisor``'s doc).
    ``ready``: where to say, once serving, the ``(gRPC port, HTTP port)`` bound, or, when it cannot serve,
    why (one line; it then exits 1)."""
    exit_with_parent()
    set_process_name(f"cs-frontend-{index}")
    configure_logs(log_level, log_format)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the supervisor forwards SIGTERM

    config = replace(config, stream=replace(config.stream, frontend_index=index))

    async def run() -> None:
        try:
            frontend = Frontend(config, address, authkey, token_sessions=token_sessions)
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGHUP, frontend.reload_tokens)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
            port = await frontend.start()
        except _CANNOT_SERVE as err:
            if ready is None:
                raise
            ready.send(f"frontend {index}: {err}")
            sys.exit(1)
        if ready is not None:
            ready.send((port, frontend.http_port))
            ready.close()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await frontend.drain()

    asyncio.run(run())
