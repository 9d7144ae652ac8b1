"""Google Cloud Speech-to-Text v1 and NVIDIA Riva streaming protocols, served beside ``cosystream.v1``.

Each adapter maps its protocol's streams onto the native servicer (see ``bridge.py``) and uses the message
classes of that protocol's official client wheel, so each is on only where its wheel is installed
(``pip install 'cosystream[compat]'``).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

import grpc

from cosystream.server.servicer import CosyStreamServicer

log = logging.getLogger(__name__)

# (adapter module, the client-wheel module it needs, the wheel's name on PyPI)
ADAPTERS = (
    ("google_recognize", "google.cloud.speech_v1", "google-cloud-speech"),
    ("riva_asr", "riva.client.proto.riva_asr_pb2", "nvidia-riva-client"),
)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def add_compat_services(servicer: CosyStreamServicer, server: grpc.aio.Server) -> list[str]:
    """Register every adapter whose client wheel is installed on ``server``; returns the service names they
    serve."""
    names = []
    for adapter, needs, wheel in ADAPTERS:
        if not _installed(needs):
            log.info("%s protocol off: %s is not installed", adapter, wheel)
            continue
        try:
            module = importlib.import_module(f"{__name__}.{adapter}")
        except Exception:  # an installed but incompatible wheel must not take the native API down with it
            log.warning("%s protocol off: importing it with %s failed", adapter, wheel, exc_info=True)
            continue
        served = module.add_to_server(servicer, server)
        for name in (served,) if isinstance(served, str) else served:
            names.append(name)
            log.info("serving %s", name)
    return names
