"""Shared fixtures: the evaluation data beside the checkout and a session-wide indexed home."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.redis_proc import RedisProcess, redis_or_skip
from tests.suite import SUITE_ENV

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# The suite's model is SmolLM2-135M, for speed: every real-model test that does not name a
# model runs on it (and so do the commands they start, which inherit the environment). The
# default preset (Qwen2.5-Coder-0.5B) has real-model tests of its own (test_model_presets).
for _name, _value in SUITE_ENV.items():
    os.environ.setdefault(_name, _value)


_SELFRAG_LOGGER = logging.getLogger("selfrag")
_SELFRAG_LOGGER_AT_START = (
    list(_SELFRAG_LOGGER.handlers),
    _SELFRAG_LOGGER.level,
    _SELFRAG_LOGGER.propagate,
)


@pytest.fixture(autouse=True)
def selfrag_logger_as_at_start() -> Iterator[None]:
    """The `selfrag` logger's handlers, level and propagation as they were when the suite
    started, and every selfrag logger enabled, before and after each test: a replica's logging
    set up in this process (`adopt_serve_logging`, in a test or a module's fixture), or another
    library's logging configuration, would otherwise keep records from later tests' caplog."""

    def reset() -> None:
        handlers, level, propagate = _SELFRAG_LOGGER_AT_START
        _SELFRAG_LOGGER.handlers[:] = handlers
        _SELFRAG_LOGGER.setLevel(level)
        _SELFRAG_LOGGER.propagate = propagate
        # A library's logging.config (disable_existing_loggers) turns ours off for good.
        for name, logger in list(logging.Logger.manager.loggerDict.items()):
            if name.startswith("selfrag") and isinstance(logger, logging.Logger):
                logger.disabled = False

    reset()
    yield
    reset()


@pytest.fixture
def no_selfrag_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No SELFRAG_ setting of this session's in the environment, but the suite's own."""
    for name in list(os.environ):
        if name.startswith("SELFRAG_") and name not in SUITE_ENV:
            monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "squad_v2_small.json").exists():
        pytest.fail(f"evaluation data not found at {SHARED_DATA} (see README)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def normans_squad(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SQuAD file reduced to the "Normans" article (the tuning split)."""
    data = json.loads((shared_data / "squad_v2_small.json").read_text())
    data["data"] = [a for a in data["data"] if a["title"] == "Normans"]
    path = tmp_path_factory.mktemp("data") / "normans.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="session")
def normans_api_home(tmp_path_factory: pytest.TempPathFactory, normans_squad: Path) -> Path:
    """A home holding only the Normans paragraphs, indexed once per session through the
    Python API (`SelfRAG.index`); modules open it one at a time (the store is one process's)."""
    from selfrag import SelfRAG

    home = tmp_path_factory.mktemp("api-home")
    with SelfRAG.open(home=home, model={"n_threads": 1}) as rag:
        [report] = rag.index(normans_squad)
        assert report.passages > 0 and not report.errors
        assert rag.count() == report.passages
    return home


@pytest.fixture(scope="session")
def indexed_corpus(normans_squad: Path, shared_data: Path) -> list[str]:
    """The files `indexed_home` holds: as a command's `--corpus`, nothing new to index."""
    return [str(normans_squad), str(shared_data / "wiki_sample_1000.jsonl")]


@pytest.fixture(scope="session")
def indexed_home(tmp_path_factory: pytest.TempPathFactory, indexed_corpus: list[str]) -> Path:
    """A data folder indexed once per session: the Normans paragraphs + 1,000 Wikipedia
    passages, through the real CLI, embedder and embedded Qdrant."""
    from selfrag.cli import main

    home = tmp_path_factory.mktemp("home")
    # Not calibrated: abstention stays off, as the tests on it expect.
    assert (
        main(["--home", str(home), "index", "--no-progress", "--no-calibrate", *indexed_corpus])
        == 0
    )
    return home


@pytest.fixture(scope="module")
def redis_server() -> Iterator[tuple[str, RedisProcess | None]]:
    """A real redis-server for this module (its own process, so tests may kill it)."""
    url, proc = redis_or_skip()
    yield url, proc
    if proc is not None:
        proc.kill()


@pytest.fixture
def redis_url(redis_server: tuple[str, RedisProcess | None]) -> str:
    """The module's redis-server, running (a test may have killed it) and empty."""
    url, proc = redis_server
    if proc is not None and not proc.running:
        proc.start()
    redis.Redis.from_url(url).flushdb()
    return url


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """A private Ray instance for this module's Ray Data runs (or the one already started in
    this process); a `selfrag serve` child starts its own."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        if started:
            ray.shutdown()
