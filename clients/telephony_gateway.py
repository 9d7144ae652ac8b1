"""Telephony gateway: answers SIP calls (UDP, G.711 over RTP) and transcribes each one with cosystream.

Every call is one REALTIME cosystream session; each result is one JSON line on stdout (or ``--jsonl``)
and, with ``--webhook``, POSTed as JSON:

    {"call_id": "...", "from": "sip:alice@example.com", "to": "sip:asr@gw", "utterance_index": 0,
     "start_ms": 480, "end_ms": 2310, "text": "...", "is_final": true}

    python clients/telephony_gateway.py --server localhost:50051 --sip-port 5060 --rtp-ports 10000-10999

Logs go to stderr. SIGINT/SIGTERM hang up every call (each flushes its last final) and exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
from pathlib import Path

from cosystream.v1.client import HelpFormatter

if __package__ in (None, ""):  # run as a script: make `clients` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

try:
    from clients.telephony import Gateway, GatewayConfig, ResultSink, WebhookPoster
    from clients.telephony.config import LOOPBACK, parse_networks, parse_port_range
    from cosystream.v1.client import (
        DEFAULT_SERVER,
        Connection,
        add_connection_args,
        connection_from_args,
        read_phrases,
        server_address,
    )
except ModuleNotFoundError as err:  # not the Python cosystream is installed in: say which, not a traceback
    sys.exit(
        f"telephony_gateway: {err}: run it with cosystream's Python (`. .venv/bin/activate` in the checkout, "
        "made by `make serve`), or install it there: pip install -e '.[clients]'"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument(
        "--server",
        default=DEFAULT_SERVER,
        type=server_address,
        help="cosystream gRPC address, host[:port] (default %(default)s)",
    )
    parser.add_argument(
        "--bind", default="0.0.0.0", help="address for SIP, RTP and AudioSocket (default %(default)s)"
    )
    parser.add_argument(
        "--sip-port", type=int, default=5060, help="SIP port, UDP and TCP (default %(default)s; 0: any)"
    )
    parser.add_argument("--sip-tls-cert", default="", help="PEM certificate (chain) for SIP over TLS")
    parser.add_argument("--sip-tls-key", default="", help="its private key (PEM)")
    parser.add_argument("--sip-tls-port", type=int, default=5061, help="SIP over TLS port (default %(default)s)")
    parser.add_argument("--rtp-ports", default="10000-20000", help="RTP port range LO-HI (default %(default)s)")
    parser.add_argument("--max-calls", type=int, default=32, help="concurrent calls (default %(default)s)")
    parser.add_argument("--jsonl", type=Path, help="append result lines to this file instead of stdout")
    parser.add_argument("--webhook", help="also POST each result line as JSON to this URL")
    parser.add_argument("--interim-results", action="store_true", help="also output interim (non-final) results")
    parser.add_argument(
        "--phrases",
        type=Path,
        help="words and phrases to expect on every call (names, products), boosted: one per line, optionally a "
        "tab and a boost (0 < boost <= 20)",
    )
    parser.add_argument(
        "--vocabulary",
        default="",
        metavar="NAME",
        help="a named vocabulary the server holds (serve --vocabulary NAME=FILE), boosted on every call",
    )
    parser.add_argument(
        "--rtp-timeout-s", type=float, default=20.0, help="hang up after this long without usable RTP"
    )
    parser.add_argument(
        "--rtp-source",
        choices=["learn", "sdp"],
        default="learn",
        help="learn: take a call's RTP from the SDP's address, or learn it from the first packets in sequence"
        " from a source inside --allow, then lock to it (a NAT, a multi-homed phone; as Asterisk's strictrtp);"
        " sdp: only from the SDP's address and port (default %(default)s)",
    )
    parser.add_argument("--jitter-ms", type=int, default=60, help="reordering window of the jitter buffer")
    parser.add_argument("--ring-ms", type=int, default=0, help="ring this long before answering")
    parser.add_argument(
        "--audiosocket-port", type=int, help="also accept Asterisk AudioSocket connections on this TCP port"
    )
    parser.add_argument(
        "--ari-rtp-port",
        type=int,
        help="also take Asterisk ARI externalMedia RTP (ulaw/alaw) on this UDP port: a call per source",
    )
    # Who may call (docs/SECURITY.md); --max-calls above caps how many at once.
    parser.add_argument(
        "--allow",
        action="append",
        metavar="CIDR",
        help="answer SIP and AudioSocket only from this network (an address is one host); repeatable"
        " (default: 127.0.0.0/8 and ::1, this host only)",
    )
    parser.add_argument("--sip-user", default="", help="require SIP digest authentication of INVITEs as this user")
    parser.add_argument(
        "--sip-password", default="", help="the digest password (other local users may see it in ps; see the next)"
    )
    parser.add_argument(
        "--sip-password-file", type=Path, help="read the digest password from this file's first line"
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    # How the gateway reaches cosystream (--server): --tls, --ca-cert, --client-cert/--client-key, --token.
    add_connection_args(parser)
    return parser.parse_args(argv)


def asr_connection_from_args(args: argparse.Namespace) -> Connection:
    """TLS and token for the channel to cosystream (``ValueError``, one line, for a file it cannot read or a
    token it would send in clear to another host)."""
    connection = connection_from_args(args)
    connection.credentials(args.server)
    return connection


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    rtp_min, rtp_max = parse_port_range(args.rtp_ports)
    return GatewayConfig(
        server=args.server,
        bind=args.bind,
        sip_port=args.sip_port,
        rtp_port_min=rtp_min,
        rtp_port_max=rtp_max,
        max_calls=args.max_calls,
        interim_results=args.interim_results,
        phrases=read_phrases(args.phrases) if args.phrases else (),
        vocabulary=args.vocabulary,
        rtp_timeout_s=args.rtp_timeout_s,
        rtp_source=args.rtp_source,
        jitter_ms=args.jitter_ms,
        ring_ms=args.ring_ms,
        audiosocket_port=args.audiosocket_port,
        ari_rtp_port=args.ari_rtp_port,
        sip_tls_cert=args.sip_tls_cert,
        sip_tls_key=args.sip_tls_key,
        sip_tls_port=args.sip_tls_port,
        **access_from_args(args),
    )


def access_from_args(args: argparse.Namespace) -> dict:
    """The GatewayConfig fields of --allow, --sip-user, --sip-password(-file)."""
    password = args.sip_password
    if args.sip_password_file is not None:
        if password:
            raise ValueError("give --sip-password or --sip-password-file, not both")
        try:
            password = args.sip_password_file.read_text(encoding="utf-8").splitlines()[0]
        except (OSError, IndexError) as err:
            raise ValueError(f"cannot read a password from {args.sip_password_file}: {err}") from None
    return {
        "allow": parse_networks(args.allow) if args.allow else LOOPBACK,
        "sip_user": args.sip_user,
        "sip_password": password,
    }


async def serve(config: GatewayConfig, jsonl: Path | None, webhook_url: str | None) -> None:
    webhook = WebhookPoster(webhook_url) if webhook_url else None
    with contextlib.ExitStack() as stack:
        stream = stack.enter_context(jsonl.open("a", encoding="utf-8")) if jsonl else sys.stdout
        gateway = Gateway(config, ResultSink(stream, webhook))
        await gateway.start()
        loop = asyncio.get_running_loop()
        stopping: list[asyncio.Task] = []
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, lambda: stopping or stopping.append(loop.create_task(gateway.stop())))
        await gateway.wait_stopped()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = dataclasses.replace(config_from_args(args), asr_connection=asr_connection_from_args(args))
    except ValueError as err:
        sys.exit(f"telephony_gateway: {err}")
    try:
        asyncio.run(serve(config, args.jsonl, args.webhook))
    except OSError as err:  # a busy or unusable SIP, RTP or AudioSocket port
        sys.exit(
            f"telephony_gateway: cannot listen on {args.bind}: {err.strerror or err} (--sip-port picks another)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
