"""What ``serve`` says once it is ready: the ports it really bound, with their hosts, what each one lets in,
and a first command that works against this server."""

from __future__ import annotations

import time

from cosystream.app.banner import startup_lines
from cosystream.server.frontend import FrontendConfig
from cosystream.server.http import HttpConfig
from cosystream.server.tls import TlsConfig
from tests.servers import Served


def test_the_lines_say_what_is_open_to_whom():
    open_config = FrontendConfig(host="0.0.0.0", http=HttpConfig(host="0.0.0.0", port=8080))
    lines = startup_lines(open_config, 50052, "127.0.0.1", 9090)
    text = "\n".join(lines)
    assert "gRPC on every interface:50052 (plaintext; no tokens: anyone who reaches the port may stream" in text
    assert "Admin service off" in text
    assert "http://localhost:8080/" in text and "its own origin" in text
    assert "metrics on http://127.0.0.1:9090/metrics" in text
    assert lines[-1].endswith("cosystream transcribe FILE.wav --server localhost:50052")

    admin = startup_lines(FrontendConfig(host="127.0.0.1", admin=True), 50051, "127.0.0.1", 0)
    assert "Admin service ON for anyone" in admin[0] and not any("metrics" in line for line in admin)

    secured = FrontendConfig(
        host="10.0.0.5", tls=TlsConfig("c.pem", "k.pem", "ca.pem"), auth_tokens="/etc/tokens", admin=True
    )
    lines = startup_lines(secured, 443, "127.0.0.1", 9090)
    assert "(mTLS; tokens from /etc/tokens required; Admin service for admin tokens only)" in lines[0]
    assert lines[-1].endswith(
        "--server 10.0.0.5:443 --ca-cert CA.pem --client-cert C.pem --client-key K.pem --token TOKEN"
    )


def test_serve_names_its_real_ports_and_hosts():
    with Served("--metrics-host", "127.0.0.1") as server:
        deadline = time.monotonic() + 10
        while not any("try it" in line for line in server.log) and time.monotonic() < deadline:
            time.sleep(0.05)
        text = "".join(server.log)
    assert f"--server 127.0.0.1:{server.port}" in text, text
    assert "--server localhost:50051" not in text
    assert f"metrics on http://127.0.0.1:{server.metrics_port}/metrics" in text, text
    assert f"http://127.0.0.1:{server.http_port}/" in text, text
