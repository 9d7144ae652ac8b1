"""Clients of a cosystream server. Each uses only the public gRPC API (``cosystream.v1``) and runs as a script."""
