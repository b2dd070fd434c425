"""Values sealed for storage outside the process (Redis): each carries its key, the caller's
binding and a SHA-256 over them and itself, so a read refuses a damaged, truncated or
misplaced value (`RejectedEntry`). The seal is no signature: whoever can write can forge it."""

from __future__ import annotations

import hashlib
import struct

# A sealed value: magic (format 1), label length, payload length, SHA-256 over the label and
# the payload; then the label (the Redis key, a NUL, the caller's binding), then the payload.
_SEAL_MAGIC = b"SRC\x01"
_SEAL_HEAD = struct.Struct("<4sIQ32s")


class RejectedEntry(Exception):
    """A value read from Redis that is not used; `reason` is a `RedisCounters` field suffix."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def seal(label: bytes, payload: bytes) -> bytes:
    """`payload` sealed with `label`: a header with both lengths and their SHA-256, then both."""
    digest = hashlib.sha256(label)
    digest.update(payload)
    head = _SEAL_HEAD.pack(_SEAL_MAGIC, len(label), len(payload), digest.digest())
    return b"".join((head, label, payload))


def unseal(label: bytes, raw: bytes) -> bytes:
    """The payload of `raw` if it was sealed with `label`; raises RejectedEntry otherwise."""
    if len(raw) < _SEAL_HEAD.size or raw[:4] != _SEAL_MAGIC:
        raise RejectedEntry("malformed", "not a sealed selfrag entry")
    _, label_len, payload_len, expected = _SEAL_HEAD.unpack_from(raw)
    if _SEAL_HEAD.size + label_len + payload_len != len(raw):
        raise RejectedEntry(
            "malformed", f"lengths in its header do not add up to its {len(raw)} bytes"
        )
    view = memoryview(raw)
    stored_label = view[_SEAL_HEAD.size : _SEAL_HEAD.size + label_len]
    payload = view[_SEAL_HEAD.size + label_len :]
    digest = hashlib.sha256(stored_label)
    digest.update(payload)
    if digest.digest() != expected:
        raise RejectedEntry("checksum", "its SHA-256 does not match its content")
    # After the checksum: a mismatch then means a whole entry stored under the wrong key (or,
    # for KV states, for other prefix tokens), not a damaged one.
    if stored_label != label:
        raise RejectedEntry("mismatch", "it was stored for another key or other tokens")
    return payload.tobytes()


def seal_label(key: str, bind: bytes) -> bytes:
    """The label a value is sealed with: its Redis key, a NUL, the caller's binding."""
    return key.encode() + b"\0" + bind
