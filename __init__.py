"""selfrag: Self-RAG inference — reflection-scored retrieval-augmented generation, served at scale.

The repository's top-level folders are this package's subpackages: `selfrag.schemas` (public
types), `selfrag.pipeline` (the algorithm), `selfrag.infra` (engine and storage adapters),
`selfrag.runtime` (wiring), `selfrag.actors` (Ray Serve) and `selfrag.jobs` (batch, evaluation,
training); `selfrag.api` is the Python API (`from selfrag import SelfRAG`), and `selfrag.cli`
and `selfrag.ray_app` are the entry points.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from selfrag.api import SelfRAG

__all__ = ["SelfRAG", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy, so `import selfrag.schemas` does not load the engine and store adapters, and no
    # command pays for importlib.metadata (a tenth of a second) unless it asks the version.
    if name == "SelfRAG":
        from selfrag.api import SelfRAG

        return SelfRAG
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("selfrag")
        except PackageNotFoundError:  # a source tree that was never installed
            return "0+unknown"
    raise AttributeError(f"module 'selfrag' has no attribute {name!r}")
