"""selfrag: Self-RAG inference — reflection-scored retrieval-augmented generation, served at scale.

The repository's top-level folders are this package's subpackages: `selfrag.schemas` (public
types), `selfrag.pipeline` (the algorithm), `selfrag.infra` (engine and storage adapters),
`selfrag.runtime` (wiring), `selfrag.actors` (Ray Serve) and `selfrag.jobs` (batch, evaluation,
training); `selfrag.api` is the Python API (`from selfrag import SelfRAG`), and `selfrag.cli`
and `selfrag.ray_app` are the entry points.
"""

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from selfrag.api import SelfRAG

__all__ = ["SelfRAG", "__version__"]

try:
    __version__ = version("selfrag")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str) -> Any:
    # Lazy, so `import selfrag.schemas` does not load the engine and store adapters.
    if name == "SelfRAG":
        from selfrag.api import SelfRAG

        return SelfRAG
    raise AttributeError(f"module 'selfrag' has no attribute {name!r}")
