"""Sessions without a transport: audio in, plain results out, the engine slot, quotas and snapshots.

What every transport (gRPC, HTTP / WebSocket, the Google / Riva adapters) shares. Nothing here imports gRPC,
protobuf or the generated wire API, nor torch (``scripts/check_layers.py`` enforces both): the server maps
the session's results (``results.py``) to its messages.
"""
