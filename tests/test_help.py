"""The help pages: every flag says what it does and shows its default, and a default stated in a help text
is the one its config object really has."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cosystream.app.cli import build_parser
from cosystream.app.supervisor import RestartPolicy
from cosystream.audio.endpointing import EndpointingConfig
from cosystream.frontend.host import StreamOptions
from cosystream.server.frontend import FrontendConfig
from cosystream.server.http import MIB, HttpConfig

ROOT = Path(__file__).resolve().parent.parent


def commands(parser: argparse.ArgumentParser, name: str = "cosystream"):
    """(name, parser) for the command and every subcommand under it."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                yield from commands(subparser, f"{name} {sub}")


def flag_help(parser: argparse.ArgumentParser, flag: str) -> str:
    for line in re.split(r"\n  (?=-)", parser.format_help()):
        if line.startswith(flag + " ") or line.startswith(flag + "\n") or line.startswith(flag + ","):
            return " ".join(line.split())
    raise AssertionError(f"{flag} is not in the help")


def test_every_flag_has_help_and_shows_its_default():
    for name, parser in commands(build_parser()):
        text = parser.format_help()
        for action in parser._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            flag = action.option_strings[-1]
            assert action.help, f"{name} {flag} has no help text"
            if action.default not in (None, False, [], argparse.SUPPRESS):
                assert "default" in flag_help(parser, flag), f"{name} {flag}: no default shown in\n{text}"


@pytest.mark.parametrize(
    ("flag", "default"),
    [
        ("--idle-timeout-s", StreamOptions().idle_timeout_s),
        ("--drain-grace-s", FrontendConfig().drain_grace_s),
        ("--keepalive-s", FrontendConfig().keepalive_s),
        ("--keepalive-timeout-s", FrontendConfig().keepalive_timeout_s),
        ("--min-client-ping-s", FrontendConfig().min_client_ping_s),
        ("--resume-window-s", StreamOptions().resume_window_s),
        ("--realtime-burst-s", StreamOptions().realtime_burst_s),
        ("--admit-lag-ms", StreamOptions().admit_lag_s * 1000),
        ("--admit-late-ms", StreamOptions().admit_late_s * 1000),
        ("--admit-cpu", StreamOptions().admit_cpu),
        ("--max-failures", RestartPolicy().max_failures),
        ("--restart-window-s", RestartPolicy().window_s),
        ("--silence-ms", EndpointingConfig().silence_ms),
        ("--max-utterance-ms", EndpointingConfig().max_utterance_ms),
        ("--max-upload-mb", HttpConfig().max_upload_bytes / MIB),
        ("--max-upload-audio-s", HttpConfig().max_upload_audio_s),
        ("--ws-idle-timeout-s", HttpConfig().ws_idle_timeout_s),
    ],
)
def test_a_default_stated_in_the_help_is_the_configs(flag, default):
    serve = dict(commands(build_parser()))["cosystream serve"]
    text = flag_help(serve, flag)
    stated = re.search(r"default:? (?:the )?([0-9.]+)", text)
    assert stated, text
    assert float(stated.group(1)) == pytest.approx(default), text


def test_the_top_level_help_names_what_serve_serves():
    top = build_parser().format_help()
    assert "run the gRPC server" not in top and "HTTP" in top


@pytest.mark.parametrize(
    "script", ["clients/latency_probe.py", "clients/telephony_gateway.py", "clients/caption.py"]
)
def test_clients_show_their_defaults(script):
    done = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("(default:") >= 3, done.stdout
    assert "(default: None)" not in done.stdout and "(default: False)" not in done.stdout
