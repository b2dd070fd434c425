"""Shared fixtures: the evaluation data beside the checkout, a session-wide indexed home, the
suite's model and Redis; and the `real` marker, put on every test that uses a fixture that
starts a real component (tests/real.py)."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.real import real, uses_real_component
from tests.redis_proc import RedisProcess, redis_or_skip
from tests.suite import SUITE_ENV, WIKI_PASSAGES, TrainedHeads

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# The suite's model is SmolLM2-135M, for speed: every real-model test that does not name a
# model runs on it (and so do the commands they start, which inherit the environment). The
# default preset (Qwen2.5-Coder-0.5B) has real-model tests of its own (test_model_presets).
for _name, _value in SUITE_ENV.items():
    os.environ.setdefault(_name, _value)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The `real` marker on every test that uses a fixture marked `@real` (before `-m`
    selects by markers)."""
    for item in items:
        if uses_real_component(item):
            item.add_marker(pytest.mark.real)


def pytest_configure(config: pytest.Config) -> None:
    """In a run that leaves the real tests out (`-m "not real"`, the fast lane), loading a
    llama.cpp model or starting Ray in this process fails the test that does it: it uses a
    real component without a fixture that says so."""
    if "not real" not in (config.option.markexpr or ""):
        return
    import llama_cpp
    import ray

    def refuse(what: str):
        def refused(*args: object, **kwargs: object) -> None:
            raise AssertionError(
                f"{what} in a test without the real marker: take a fixture marked @real "
                "(tests/real.py), e.g. llama_model"
            )

        return refused

    llama_cpp.llama_model_load_from_file = refuse("a llama.cpp model loaded")
    ray.init = refuse("Ray started")


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
@real
def llama_model() -> Path:
    """The suite's model file (SmolLM2), for a test that loads a llama.cpp model (this one or
    the MiniLM embedder), or runs a command that does, and uses no other real fixture."""
    from selfrag.infra.models.model_files import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
@real
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
def indexed_corpus(
    normans_squad: Path, shared_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[str]:
    """The files `indexed_home` holds: as a command's `--corpus`, nothing new to index. The
    Normans paragraphs and the first WIKI_PASSAGES records of the wiki sample."""
    with (shared_data / "wiki_sample_1000.jsonl").open() as f:
        records = list(itertools.islice(f, WIKI_PASSAGES))
    wiki = tmp_path_factory.mktemp("data") / "wiki_sample.jsonl"
    wiki.write_text("".join(records))
    return [str(normans_squad), str(wiki)]


@pytest.fixture(scope="session")
@real
def indexed_home(tmp_path_factory: pytest.TempPathFactory, indexed_corpus: list[str]) -> Path:
    """A data folder indexed once per session: the Normans paragraphs and WIKI_PASSAGES
    Wikipedia passages (`indexed_corpus`), through the real CLI, embedder and embedded
    Qdrant."""
    from selfrag.cli import main

    home = tmp_path_factory.mktemp("home")
    # Not calibrated: abstention stays off, as the tests on it expect.
    assert (
        main(["--home", str(home), "index", "--no-progress", "--no-calibrate", *indexed_corpus])
        == 0
    )
    return home


@pytest.fixture(scope="session")
@real
def trained_heads(indexed_home: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainedHeads:
    """Reflection heads trained once per session by `selfrag train` on the indexed home, with
    the served model as its own critic: `--critic-mode add` keeps the constructed labels, so
    every group has both labels whatever this small model says."""
    from selfrag.cli import main

    out = tmp_path_factory.mktemp("heads") / "heads.json"
    args = ["--home", str(indexed_home), "train", "--passages", "12", "--seed", "3"]
    args += ["--out", str(out), "--no-progress", "--critic", "smollm2", "--critic-mode", "add"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(args) == 0
    return TrainedHeads(indexed_home, out, printed.getvalue())


@pytest.fixture
@real
def ray_tmp() -> Iterator[Path]:
    """A temporary folder of its own (`RAY_TMPDIR`) for a Ray instance the test starts, in a
    child process: the machine's /tmp/ray and any other Ray are left alone. Short, as Ray's
    socket paths under it must fit the 107 bytes of a Unix socket name."""
    folder = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
@real
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
@real
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
