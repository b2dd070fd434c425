"""selfrag: Self-RAG inference — reflection-scored retrieval-augmented generation, served at scale.

The repository's top-level folders are this package's subpackages: `selfrag.schemas` (public
types), `selfrag.pipeline` (the algorithm), `selfrag.infra` (engine and storage adapters),
`selfrag.runtime` (wiring), `selfrag.actors` (Ray Serve) and `selfrag.jobs` (batch, evaluation,
training); `selfrag.cli` and `selfrag.ray_app` are the entry points.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("selfrag")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
