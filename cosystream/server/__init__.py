"""The transports: the gRPC servicer, HTTP / WebSocket, the Google / Riva adapters and the frontend server, over
the sessions of ``cosystream.frontend``."""
