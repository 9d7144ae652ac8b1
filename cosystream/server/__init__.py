"""gRPC serving: the servicer and its sessions, the engine client, the frontend process, and the Google / Riva adapters."""
