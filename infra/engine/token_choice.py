"""How a generating sequence picks its next token from the logits: greedily, or drawn with a
temperature and nucleus (`Sampling`), and the model's own log-probability of the pick."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from selfrag.infra.engine.llama_batch import greedy_logprob
from selfrag.pipeline.protocols import Sampling


class TokenChooser:
    """The next-token choice of one generating sequence.

    Greedy without `sampling` (or at temperature 0). Sampled otherwise, from a generator of
    its own: seeded by the request's seed and its prompt, so that a sequence's draws do not
    depend on which other sequences share its batch.
    """

    def __init__(self, sampling: Sampling | None, prompt: Sequence[int]) -> None:
        self._sampling = sampling if sampling is not None and sampling.temperature > 0 else None
        self._rng: np.random.Generator | None = None
        if self._sampling is not None:
            seed = self._sampling.seed
            if seed is None:
                self._rng = np.random.default_rng()
            else:
                digest = zlib.crc32(np.asarray(prompt, dtype=np.int64).tobytes())
                self._rng = np.random.default_rng([seed, digest])

    def choose(self, logits: npt.NDArray[np.float32]) -> tuple[int, float]:
        """The next token and the model's log-probability of it (untempered)."""
        if self._sampling is None or self._rng is None:
            token = int(np.argmax(logits))
            return token, greedy_logprob(logits, token)
        values = logits.astype(np.float64)
        values -= values.max()
        log_z = float(np.log(np.exp(values).sum()))
        weights = np.exp(values / self._sampling.temperature)
        weights /= weights.sum()
        if self._sampling.top_p < 1.0:
            order = np.argsort(-weights, kind="stable")
            mass = np.cumsum(weights[order])
            keep = int(np.searchsorted(mass, self._sampling.top_p)) + 1
            kept = order[:keep]
            token = int(kept[_draw(weights[kept], self._rng)])
        else:
            token = _draw(weights, self._rng)
        return token, float(values[token] - log_z)


def _draw(weights: npt.NDArray[np.float64], rng: np.random.Generator) -> int:
    """An index drawn with probability proportional to `weights`."""
    cumulative = np.cumsum(weights)
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return min(index, len(weights) - 1)
