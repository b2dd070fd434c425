"""The key/value part of a GGUF file's header, read sequentially from an open file. Errors
surface as `struct.error` (or the read's own); `infra.models.model_files` turns them into
`ModelFileError`."""

from __future__ import annotations

import os
import struct
from typing import BinaryIO

# GGUF metadata value types: id -> struct format of a scalar (string=8 and array=9 aside).
_GGUF_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_GGUF_STRING = 8
_GGUF_ARRAY = 9


def read_key_values(fh: BinaryIO, keys: set[str], *, arrays: bool) -> dict[str, object]:
    """The values of `keys`, `fh` standing just after the header's version: scalars and
    strings, and arrays (as lists) when `arrays`; an array's key is left out otherwise. Stops
    once all are read."""
    found: dict[str, object] = {}
    left = set(keys)
    unpack(fh, "<Q")  # tensor count
    (n_kv,) = unpack(fh, "<Q")
    for _ in range(n_kv):
        if not left:
            break
        name = _read_string(fh)
        (vtype,) = unpack(fh, "<I")
        if name not in left:
            _skip_value(fh, vtype)
            continue
        left.discard(name)
        if vtype != _GGUF_ARRAY:
            found[name] = _read_value(fh, vtype)
        elif arrays:
            found[name] = _read_array(fh)
        else:
            _skip_value(fh, vtype)
    return found


def unpack(fh: BinaryIO, fmt: str) -> tuple:
    size = struct.calcsize(fmt)
    data = fh.read(size)
    if len(data) != size:
        raise struct.error("unexpected end of file")
    return struct.unpack(fmt, data)


def _read_string(fh: BinaryIO) -> str:
    (length,) = unpack(fh, "<Q")
    data = fh.read(length)
    if len(data) != length:
        raise struct.error("unexpected end of file")
    return data.decode("utf-8")


def _read_array(fh: BinaryIO) -> list[object]:
    (item_type, count) = unpack(fh, "<IQ")
    if item_type == _GGUF_STRING:
        return [_read_string(fh) for _ in range(count)]
    if item_type in _GGUF_SCALARS:
        return list(unpack(fh, f"<{count}{_GGUF_SCALARS[item_type][1:]}"))
    raise struct.error(f"GGUF array of value type {item_type} is not read here")


def _read_value(fh: BinaryIO, vtype: int) -> object:
    if vtype == _GGUF_STRING:
        return _read_string(fh)
    if vtype in _GGUF_SCALARS:
        return unpack(fh, _GGUF_SCALARS[vtype])[0]
    raise struct.error(f"unknown GGUF value type {vtype}")


def _skip_value(fh: BinaryIO, vtype: int) -> None:
    if vtype == _GGUF_STRING:
        (length,) = unpack(fh, "<Q")
        fh.seek(length, os.SEEK_CUR)
    elif vtype == _GGUF_ARRAY:
        (item_type, count) = unpack(fh, "<IQ")
        if item_type in _GGUF_SCALARS:
            fh.seek(struct.calcsize(_GGUF_SCALARS[item_type]) * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_value(fh, item_type)
    elif vtype in _GGUF_SCALARS:
        fh.seek(struct.calcsize(_GGUF_SCALARS[vtype]), os.SEEK_CUR)
    else:
        raise struct.error(f"unknown GGUF value type {vtype}")
