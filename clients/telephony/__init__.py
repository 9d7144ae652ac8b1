"""Telephony ingress for cosystream: SIP/RTP calls (and Asterisk AudioSocket connections) transcribed
through the public gRPC API, one JSON line per result. The command line is ``clients/telephony_gateway.py``.

Modules, from the wire up: :mod:`.sip` and :mod:`.sdp` (messages), :mod:`.rtp` (packets, jitter
buffer, ports), :mod:`.asr` (one cosystream session), :mod:`.call` (one call's media and clock),
:mod:`.uas` (SIP signalling), :mod:`.audiosocket`, :mod:`.security` (``--allow``, digest
authentication, what they refused), :mod:`.output` (JSON lines, webhook), :mod:`.gateway` (wiring).
"""

from .config import GatewayConfig
from .gateway import Gateway
from .output import CallInfo, ResultSink, WebhookPoster

__all__ = ["CallInfo", "Gateway", "GatewayConfig", "ResultSink", "WebhookPoster"]
