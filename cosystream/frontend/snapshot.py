"""A session's state as a signed blob, so that another server (a replica with the same key) can go on with it.

A drain hands its resumable sessions over at their next utterance boundary, and a client may ask for one at
any time (``Control.SNAPSHOT``). Between utterances a session has no model state worth carrying (the model's
caches and the decoder are reset at every utterance's start) and every final for its audio has been sent, so
a snapshot is the session's config and its positions: the input offset to go on from (a 10 ms frame
boundary, a pre-roll before what was consumed, so a word that starts right after it is not clipped), the
frame that offset is in the stream's timeline (result times go on from it), the utterances and responses so
far (indexes go on from them), the model version, and whose session it is (the token name). It is signed
with HMAC-SHA256 under a key the operators share across replicas (``serve --resume-key-file``) and expires
after the resume window. A blob that is not one of ours or was changed: INVALID_ARGUMENT; expired, another
model version, or another token's: FAILED_PRECONDITION, with the reason.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

VERSION = 1
MIN_KEY_BYTES = 32


class SnapshotError(ValueError):
    """A blob that cannot be resumed; ``tampered``: not ours, or changed (else expired, or for another server)."""

    def __init__(self, message: str, tampered: bool = False):
        super().__init__(message)
        self.tampered = tampered


def read_key(path: str | Path) -> bytes:
    """The shared key from ``path`` (at least 32 bytes; surrounding whitespace ignored). Raises ``ValueError``
    (one line) for a file that cannot be used."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as err:
        raise ValueError(f"--resume-key-file {path}: {err.strerror or err}") from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(
            f"--resume-key-file {path}: {len(key)} bytes; a key needs at least {MIN_KEY_BYTES} "
            "(e.g. `head -c 32 /dev/urandom | base64 > resume.key`, the same file on every replica)"
        )
    return key


@dataclass(frozen=True, slots=True)
class Snapshot:
    config: bytes  # the stream's StreamingConfig as the client sent it (serialized; resume fields cleared)
    model: str  # the model's name and version the session ran
    model_version: str
    offset_samples: int  # the input sample to go on from (a frame boundary)
    frame: int  # the 10 ms frame that offset is, in the stream's timeline
    utterances: int  # utterances begun so far: the next one's index
    responses: int  # responses sent so far: the next one is this + 1
    token: str | None  # the auth token's name that opened it (None: no authentication)
    expires_s: float  # (time.time()) after this it is refused

    def seal(self, key: bytes) -> bytes:
        fields = asdict(self)
        fields["config"] = base64.b64encode(self.config).decode()
        body = json.dumps({"v": VERSION, **fields}, separators=(",", ":"), sort_keys=True).encode()
        return body + b"." + base64.urlsafe_b64encode(hmac.digest(key, body, hashlib.sha256))

    @classmethod
    def open(cls, blob: bytes, key: bytes, now_s: float | None = None) -> Snapshot:
        """The snapshot ``blob`` holds; raises :class:`SnapshotError` saying why it cannot be used."""
        body, dot, mac = blob.rpartition(b".")
        try:
            given = base64.urlsafe_b64decode(mac)
        except ValueError:
            given = b""
        if not dot or not hmac.compare_digest(given, hmac.digest(key, body, hashlib.sha256)):
            raise SnapshotError(
                "resume_snapshot is not a snapshot of a server sharing this one's --resume-key-file, or it was "
                "changed",
                tampered=True,
            )
        fields = json.loads(body)
        if fields.pop("v", None) != VERSION:
            raise SnapshotError("resume_snapshot is of another version of cosystream: open a new stream")
        fields["config"] = base64.b64decode(fields["config"])
        snapshot = cls(**fields)
        if (time.time() if now_s is None else now_s) > snapshot.expires_s:
            raise SnapshotError("resume_snapshot has expired (its resume window passed): open a new stream")
        return snapshot
