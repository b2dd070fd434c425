"""llama.cpp's process-wide initialisation: `llama_backend_init` once, with its log (and
ggml's) sent to `logging`, errors only: it reports every tensor it loads at INFO level."""

from __future__ import annotations

import ctypes
import logging
import threading

logger = logging.getLogger(__name__)

_init_lock = threading.Lock()
_initialised = False
_GGML_LOG_ERROR = 4
_GGML_LOG_CONT = 5
_last_log_level = 0


def _route_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # llama.cpp reports every tensor it loads at INFO level; only errors are worth showing.
    global _last_log_level
    if level != _GGML_LOG_CONT:
        _last_log_level = level
    if _last_log_level == _GGML_LOG_ERROR:
        logger.error("llama.cpp: %s", text.decode("utf-8", errors="replace").rstrip())


_log_callback = None


def route_llama_log() -> None:
    """Send llama.cpp's and ggml's log to `logging` (errors only) from now on."""
    global _log_callback
    import llama_cpp

    if _log_callback is None:
        _log_callback = llama_cpp.llama_log_callback(_route_log)
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))


def init_llama() -> None:
    """`llama_backend_init` once per process, with llama.cpp's log sent to `logging`."""
    global _initialised
    import llama_cpp

    with _init_lock:
        if _initialised:
            return
        route_llama_log()
        llama_cpp.llama_backend_init()
        _initialised = True
