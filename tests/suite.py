"""What the test suite runs on: SmolLM2-135M, for speed (the default preset has its own
real-model tests). `tests/conftest.py` puts it into the session's environment; a test that
loads settings from an environment of its own adds `SUITE_ENV`. And what the session's shared
fixtures of tests/conftest.py give (`TrainedHeads`)."""

from dataclasses import dataclass
from pathlib import Path

SUITE_ENV = {
    "SELFRAG_MODEL__PRESET": "smollm2",
    # `selfrag ask` would calibrate first (minutes); tests that want it turn it on.
    "SELFRAG_MODEL__CALIBRATE_ON_FIRST_USE": "false",
}

WIKI_PASSAGES = 200
"""Wikipedia records beside the Normans paragraphs in the session's `indexed_home`: distractors
for its retrieval. No test asks about them, and each costs its embedding in the session's
setup."""

# How far a cosine of two embeddings may move when a text is embedded in another batch (other
# texts beside it, another length): the embedder's weights are float16, and llama.cpp rounds a
# matmul's inputs to float16 on some kernel paths and not others, as the batch's shape and the
# CPU's backend choose. So such a cosine is exact to float16's epsilon, 2**-10, not to the last
# bits of a float32: 1e-4 failed on an AVX2-only machine (1.23e-4); measured moves reach about
# 1e-4 on the x64, AVX2 and AVX-512 backends alike (notes/hardening.md).
EMBEDDING_COSINE_TOLERANCE = 2.0**-10


@dataclass(frozen=True)
class TrainedHeads:
    """One `selfrag train` run: the home it trained on, the heads file and what it printed."""

    home: Path
    path: Path
    printed: str
