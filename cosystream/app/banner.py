"""What ``serve`` says once it is ready: where each port listens, what is open to whom, and how to try it.

An operator reads these lines to know what the server exposes (tokens off means anyone who reaches a port
may use it; ``--admin`` without tokens means anyone may load models), and a new user reads the last one to
know what to type next, with the port and options this server really has.
"""

from __future__ import annotations

from cosystream.server.frontend import FrontendConfig

_ANY_ADDRESS = ("", "0.0.0.0", "::", "[::]")


def _shown(host: str) -> str:
    """An address as a client would name it (every interface: ``localhost`` works from this machine)."""
    if host in _ANY_ADDRESS:
        return "localhost"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _listen(host: str) -> str:
    return "every interface" if host in _ANY_ADDRESS else host


def startup_lines(config: FrontendConfig, port: int, metrics_host: str, metrics_port: int) -> list[str]:
    """The lines after ``cosystream serving on port N``: each surface, who may use it, and a first command."""
    tls = config.tls
    security = "plaintext" if tls is None else ("mTLS" if tls.client_ca_path else "TLS")
    if config.auth_tokens:
        who = f"tokens from {config.auth_tokens} required"
        admin = "Admin service for admin tokens only"
    else:
        who = "no tokens: anyone who reaches the port may stream"
        admin = (
            "Admin service ON for anyone who reaches the port (--admin)"
            if config.admin
            else "Admin service off (--admin, or an admin token, turns it on)"
        )
    lines = [f"gRPC on {_listen(config.host)}:{port} ({security}; {who}; {admin})"]
    if config.http is not None:
        http = config.http
        scheme = "https" if tls else "http"
        if config.auth_tokens:
            browsers = "tokens or client secrets required"
        else:
            origins = ", ".join(http.allowed_origins)
            if "*" in http.allowed_origins:
                browsers = "no tokens: browser pages of any origin may use it"
            else:
                browsers = (
                    "no tokens: browser pages of its own origin" + (f" and {origins}" if origins else "") + " only"
                )
        lines.append(
            f"HTTP API and captioning page on {scheme}://{_shown(http.host)}:{http.port}/ "
            f"(listening on {_listen(http.host)}; {browsers})"
        )
    if metrics_port:
        lines.append(
            f"metrics on http://{_shown(metrics_host)}:{metrics_port}/metrics (listening on {_listen(metrics_host)}; "
            "no authentication)"
        )
    flags = (
        ""
        if tls is None
        else (" --ca-cert CA.pem" + (" --client-cert C.pem --client-key K.pem" if tls.client_ca_path else ""))
    )
    flags += " --token TOKEN" if config.auth_tokens else ""
    lines.append(
        f"try it, in another terminal: cosystream transcribe FILE.wav --server {_shown(config.host)}:{port}{flags}"
    )
    return lines
