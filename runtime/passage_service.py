"""The one owner of a process's passage store, as Serve's `Retriever` deployment and the batch
jobs' store actor run it: search (batched per step), the index version and readiness, with the
store's failures mapped to the errors of `schemas.errors` (503 while a server does not answer,
500 `misconfigured` with the reason for an index that cannot serve)."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from selfrag.infra.home_identity import home_id
from selfrag.pipeline.protocols import Passage
from selfrag.runtime.model_artefacts import open_embedder
from selfrag.runtime.system import open_store
from selfrag.schemas.documents import DocumentInfo, Removal
from selfrag.schemas.errors import DependencyDown, Misconfigured
from selfrag.schemas.health import ServedIndex
from selfrag.schemas.settings import Settings

if TYPE_CHECKING:
    from selfrag.infra.embeddings.embedder import SentenceEmbedder
    from selfrag.infra.store.qdrant_store import QdrantStore

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class PassageService:
    """The one owner of a process's passage store: Qdrant search (dense, or hybrid dense +
    BM25), its failures mapped to the errors clients see. Serve's `Retriever` deployment and
    the batch jobs' store actor are this class.

    A Qdrant server that does not answer at start-up does not stop the replica: it reports
    not ready, answers 503, and connects on a later call once the server is back. An index
    that cannot serve (no collection, built by another embedder or with vectors of another
    size) is permanent until someone acts: the replica reports not ready and answers 500
    `misconfigured` with the reason, never a 503 a client would retry forever. An embedded
    store that cannot be opened otherwise (its folder locked) is a start-up error.
    """

    # A store that failed its check at open is opened again at most this often: an embedded
    # open reads the whole collection, too slow to repeat on every request.
    RECHECK_S = 10.0

    def __init__(self, settings: Settings) -> None:
        settings.home.mkdir(parents=True, exist_ok=True)
        self._settings = settings
        self._lock = threading.Lock()
        self._embedder: SentenceEmbedder | None = None
        self._opened: QdrantStore | None = None
        self._refused: tuple[float, str] | None = None  # (until when, the 500's detail)
        self._down = False
        try:
            # Opens (and checks) the store now, when it can, and loads the embedder: not on
            # the first question.
            self._searching(lambda store: store.search("warm up", 1))
        except DependencyDown:
            if settings.retrieval.qdrant_url is None:
                raise  # an embedded store that does not open is a start-up error
            log.warning("the Qdrant server does not answer yet; will connect when it does")
        except Misconfigured:
            pass  # logged by _store; every call answers 500 with the reason

    def _open(self) -> QdrantStore:
        """The store, opened on first use with the embedder of the settings (loaded after the
        chat model chose the process's llama.cpp build, as `LocalRuntime.embedder` is); a
        failed open is not kept: the next call tries again."""
        with self._lock:
            if self._opened is None:
                if self._embedder is None:
                    self._embedder = open_embedder(self._settings)
                self._opened = open_store(self._settings, self._embedder)
            return self._opened

    def _store(self) -> QdrantStore:
        """The open store with an index that fits the embedder; DependencyDown (503) when
        the server does not answer, Misconfigured (500) when the index cannot serve."""
        # Imported here: qdrant-client is slow to import, a cost other replicas need not pay.
        from selfrag.infra.store.qdrant_store import (
            IndexMissing,
            StoreMisconfigured,
            StoreUnavailable,
        )

        if self._refused is not None and time.monotonic() < self._refused[0]:
            raise Misconfigured(self._refused[1])
        try:
            store = self._open()  # a failed open is not kept: each call tries again
            store.require_index()
        except StoreUnavailable as exc:
            # The detail (it names the server) goes to the log, once per outage.
            (log.debug if self._down else log.warning)("passage store: %s", exc)
            self._down = True
            raise DependencyDown("the passage store does not answer") from exc
        except StoreMisconfigured as exc:
            if self._refused is None:
                log.error("passage store: %s", exc)
            # A missing collection is checked again on every call (one small request to an
            # open store); a store refused at open is reopened only after RECHECK_S.
            wait = 0.0 if isinstance(exc, IndexMissing) else self.RECHECK_S
            detail = f"the passage index cannot be used: {public_reason(exc)}"
            self._refused = (time.monotonic() + wait, detail)
            raise Misconfigured(detail) from None
        self._refused = None
        self._down = False
        return store

    def search_many(self, queries: list[str], k: int) -> list[list[Passage]]:
        """A step's searches in one call (one per live hypothesis that retrieves), embedded
        and sent to the store as one batch."""
        return self._searching(lambda store: store.search_many(queries, k))

    def search(self, query: str, k: int) -> list[Passage]:
        return self._searching(lambda store: store.search(query, k))

    def _searching(self, search: Callable[[QdrantStore], _T]) -> _T:
        """`search` on the open store, its failures mapped to the errors clients see."""
        from selfrag.infra.store.qdrant_store import StoreMisconfigured

        store = self._store()
        try:
            return search(store)
        except ValueError:
            raise
        except StoreMisconfigured as exc:  # a collection that appeared since, and does not fit
            log.error("passage store: %s", exc)
            raise Misconfigured(f"the passage index cannot be used: {public_reason(exc)}") from None
        except Exception as exc:
            # Store down (server gone, connection refused, closed client): a 503 for this
            # request; the Qdrant client reconnects by itself once the server answers again.
            raise DependencyDown(
                f"the passage store does not answer: {type(exc).__name__}"
            ) from None

    def index_version(self) -> str:
        store = self._store()
        try:
            return store.index_version()
        except Exception as exc:
            raise DependencyDown(
                f"the passage store does not answer: {type(exc).__name__}"
            ) from None

    def documents(self) -> list[DocumentInfo]:
        """The indexed documents."""
        return self._searching(lambda store: store.documents())

    def remove(self, refs: list[str]) -> Removal:
        """Remove the documents `refs` name (ids, or files or folders indexed)."""
        return self._searching(lambda store: store.remove(refs))

    def ready(self) -> bool:
        try:
            return self._store().ready()
        except (DependencyDown, Misconfigured):
            return False

    def served(self) -> ServedIndex:
        """The home and collection this store is of."""
        return ServedIndex(
            home_id=home_id(self._settings.home), collection=self._settings.retrieval.collection
        )

    def count(self) -> int:
        """Passages in the index."""
        return self._searching(lambda store: store.count())

    def close(self) -> None:
        with self._lock:
            store, self._opened = self._opened, None
        if store is not None:
            store.close()


# An absolute path (`/data/...`) or a URL (`http://...`) in a message.
_LOCATION = re.compile(r"(?<![\w.-])/[\w.~-]|://")


def public_reason(exc: BaseException) -> str:
    """An index error's reason as a client may see it: without a folder or server it names
    (a reason that names one is replaced by a generic one; the caller logs the detail)."""
    from selfrag.infra.store.qdrant_store import IndexMissing

    if isinstance(exc, IndexMissing):
        return "no passages are indexed: run `selfrag index PATH` with these settings first"
    text = str(exc)
    if _LOCATION.search(text):
        return "its description is unreadable or does not fit these settings (see the server log)"
    return text
