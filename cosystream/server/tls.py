"""TLS on the gRPC and HTTP ports, with certificates picked up from disk when they change (no restart).

``grpc.dynamic_ssl_server_credentials`` asks a fetcher for a new certificate configuration at every TLS
handshake; :class:`ReloadingCredentials` is that fetcher. It compares the files' (mtime, size, inode) with
those last read (one ``stat`` per file per new connection), and re-reads them only when they changed, so a
certificate renewed by cert-manager (a Secret volume swaps a symlink: every file changes at once) or by
certbot serves the next connection. Connections already open keep the certificate they were made with.

A pair that cannot be used (half written, a key that does not match the certificate) is not switched to:
the old one stays in use, the reason is logged once, and the files are tried again when they change next.
At start-up the same problems raise :class:`TlsError`, whose message is one line.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass

import grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """PEM files: the server's certificate chain and key; ``client_ca_path`` set: clients must present a
    certificate signed by one of these CAs (mTLS)."""

    cert_path: str
    key_path: str
    client_ca_path: str | None = None


class TlsError(ValueError):
    """A certificate, key or CA file that cannot be used; the message says which and why (one line)."""


@dataclass(frozen=True, slots=True)
class _Loaded:
    key: bytes
    chain: bytes
    client_ca: bytes | None


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise TlsError(f"{what} {path}: {err.strerror or err}") from None


def _no_password() -> bytes:
    raise TlsError("encrypted")


def load(config: TlsConfig) -> _Loaded:
    """Read and check the files: PEM, a key that matches the certificate, a CA file with certificates."""
    chain = _read(config.cert_path, "TLS certificate")
    key = _read(config.key_path, "TLS key")
    client_ca = None if config.client_ca_path is None else _read(config.client_ca_path, "TLS client CA")
    if b"-----BEGIN CERTIFICATE-----" not in chain:
        raise TlsError(
            f"TLS certificate {config.cert_path}: no PEM certificate in it (-----BEGIN CERTIFICATE-----)"
        )
    if b"PRIVATE KEY-----" not in key:
        raise TlsError(f"TLS key {config.key_path}: no PEM private key in it (-----BEGIN PRIVATE KEY-----)")
    if b"ENCRYPTED" in key:
        raise TlsError(
            f"TLS key {config.key_path}: the key is encrypted; give it unencrypted "
            "(openssl pkey -in KEY -out PLAIN.key), readable by this user only"
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(config.cert_path, config.key_path, password=_no_password)
    except (ssl.SSLError, TlsError) as err:
        reason = getattr(err, "reason", None) or str(err)
        raise TlsError(
            f"TLS certificate {config.cert_path} with key {config.key_path}: cannot be used ({reason}); "
            "is the key the certificate's?"
        ) from None
    if client_ca is not None:
        try:
            context.load_verify_locations(cadata=client_ca.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as err:
            reason = getattr(err, "reason", None) or str(err)
            raise TlsError(
                f"TLS client CA {config.client_ca_path}: no usable PEM certificate ({reason})"
            ) from None
    # What was checked is what gets served: a file replaced between the reads above is caught next time.
    if (_read(config.cert_path, "TLS certificate"), _read(config.key_path, "TLS key")) != (chain, key):
        raise TlsError(f"TLS certificate {config.cert_path}: changed while it was read")
    return _Loaded(key, chain, client_ca)


def _signature(config: TlsConfig) -> tuple:
    """What tells a changed file: (mtime, size, inode) of each; None for one that cannot be stat'ed."""
    signature = []
    for path in (config.cert_path, config.key_path, config.client_ca_path):
        if path is None:
            continue
        try:
            st = os.stat(path)
            signature.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            signature.append(None)
    return tuple(signature)


def _certificate_configuration(loaded: _Loaded):
    return grpc.ssl_server_certificate_configuration(
        [(loaded.key, loaded.chain)], root_certificates=loaded.client_ca
    )


class ReloadingCredentials:
    """Server credentials whose certificate follows the files. Raises :class:`TlsError` if they cannot be
    used now."""

    def __init__(self, config: TlsConfig):
        self.config = config
        self._signature = _signature(config)
        self._initial = load(config)
        self._lock = threading.Lock()  # gRPC may call the fetcher from its own threads
        self.reloads = 0  # certificate switches since start-up

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            _certificate_configuration(self._initial),
            self._fetch,
            require_client_authentication=self.config.client_ca_path is not None,
        )

    def _fetch(self):
        """gRPC's fetcher, at each handshake: a new configuration when the files changed, else None."""
        try:
            with self._lock:
                signature = _signature(self.config)
                if signature == self._signature:
                    return None
                self._signature = signature  # tried once per change, good or bad
                try:
                    loaded = load(self.config)
                except TlsError as err:
                    log.error("TLS files changed but cannot be used, keeping the current certificate: %s", err)
                    return None
                self.reloads += 1
                log.info("TLS certificate reloaded from %s", self.config.cert_path)
                return _certificate_configuration(loaded)
        except Exception:  # never into gRPC's handshake
            log.exception("TLS certificate reload failed; keeping the current certificate")
            return None


class ReloadingSSLContext:
    """The HTTP port's TLS: an ``ssl.SSLContext`` whose certificate follows the files as the gRPC port's
    does. At each handshake (its SNI callback, called with or without a server name) the files' signature
    is compared with the last one read; a changed, usable pair becomes the context of this and the next
    connections. Raises :class:`TlsError` if the files cannot be used now."""

    def __init__(self, config: TlsConfig):
        self.config = config
        self._signature = _signature(config)
        load(config)
        self.context = self._make()  # what the listening socket holds
        self._current = self.context
        self._lock = threading.Lock()
        self.reloads = 0

    def _make(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.config.cert_path, self.config.key_path, password=_no_password)
        if self.config.client_ca_path is not None:
            context.load_verify_locations(cafile=self.config.client_ca_path)
            context.verify_mode = ssl.CERT_REQUIRED
        context.sni_callback = self._on_handshake
        return context

    def _on_handshake(self, sock: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        try:
            with self._lock:
                signature = _signature(self.config)
                if signature != self._signature:
                    self._signature = signature
                    try:
                        load(self.config)
                        self._current = self._make()
                        self.reloads += 1
                        log.info("TLS certificate reloaded for the HTTP port from %s", self.config.cert_path)
                    except (TlsError, ssl.SSLError, OSError) as err:
                        log.error("TLS files changed but cannot be used, keeping the current certificate: %s", err)
                current = self._current
            if current is not context:
                sock.context = current
        except Exception:  # never into the handshake
            log.exception("TLS certificate reload failed; keeping the current certificate")
        return None
