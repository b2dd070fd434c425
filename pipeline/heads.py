"""Learned reflection heads: each reflection group as extra rows of the output matrix.

A group's label probabilities are `softmax(W_g · h)` over the group's labels, where `h` is the
model's final hidden state (after the output norm) at the position where the group is read.
There is no bias term on purpose: a row of `W_g` is then exactly one more row of the output
matrix, so a model file whose vocabulary carries the reflection tokens with these rows
(`selfrag train --export-gguf`) yields the same within-group probabilities through its own
softmax. Rows are float16 values, the precision of such an output matrix.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

GROUP_LABELS: dict[str, tuple[str, ...]] = {
    "retrieve": ("yes", "no", "continue"),
    "relevance": ("relevant", "irrelevant"),
    "support": ("full", "partial", "none"),
    "utility": ("1", "2", "3", "4", "5"),
}


HALF_MAX = 65504.0


class HeadsError(ValueError):
    """Heads that do not fit the model or are malformed."""


def half_precision(values: Sequence[float]) -> tuple[float, ...]:
    """`values` rounded to the nearest float16 (clamped to its range)."""
    n = len(values)
    clamped = [min(max(v, -HALF_MAX), HALF_MAX) for v in values]
    return struct.unpack(f"{n}e", struct.pack(f"{n}e", *clamped))


@dataclass(frozen=True)
class GroupHead:
    """One reflection group: a weight row per label over the hidden state."""

    labels: tuple[str, ...]
    rows: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if len(self.labels) != len(self.rows) or not self.rows:
            raise HeadsError(f"{len(self.labels)} labels but {len(self.rows)} weight rows")
        if len({len(r) for r in self.rows}) != 1:
            raise HeadsError("the weight rows of a group differ in length")

    @property
    def hidden_size(self) -> int:
        return len(self.rows[0])

    def logits(self, hidden: Sequence[float]) -> list[float]:
        """W·h, with h rounded to float16 as llama.cpp does when it multiplies the (float16)
        output matrix, so these logits equal an exported model's own."""
        if len(hidden) != self.hidden_size:
            raise HeadsError(
                f"a hidden state of {len(hidden)} values for heads of size {self.hidden_size}"
            )
        h = half_precision(hidden)
        return [math.fsum(w * x for w, x in zip(row, h, strict=True)) for row in self.rows]

    def probabilities(self, hidden: Sequence[float]) -> dict[str, float]:
        """softmax(W·h) over this group's labels."""
        z = self.logits(hidden)
        top = max(z)
        e = [math.exp(v - top) for v in z]
        total = sum(e)
        return {label: v / total for label, v in zip(self.labels, e, strict=True)}


@dataclass(frozen=True)
class ReflectionHeads:
    """The four groups' heads for one model file (named by its SHA-256)."""

    model_sha256: str
    groups: Mapping[str, GroupHead]

    def __post_init__(self) -> None:
        if set(self.groups) != set(GROUP_LABELS):
            raise HeadsError(
                f"heads must cover the groups {sorted(GROUP_LABELS)}, got {sorted(self.groups)}"
            )
        for name, head in self.groups.items():
            if head.labels != GROUP_LABELS[name]:
                raise HeadsError(f"group {name!r} has labels {head.labels}")
        if len({h.hidden_size for h in self.groups.values()}) != 1:
            raise HeadsError("the groups' heads differ in hidden size")

    @property
    def hidden_size(self) -> int:
        return next(iter(self.groups.values())).hidden_size

    def check_model(self, model_sha256: str, hidden_size: int | None) -> None:
        """Refuse heads trained on another model file or for another hidden size."""
        if model_sha256 != self.model_sha256:
            raise HeadsError(
                f"these reflection heads were trained for the model file sha256:"
                f"{self.model_sha256}, not for sha256:{model_sha256}; run `selfrag train` "
                "for this model"
            )
        if hidden_size is not None and hidden_size != self.hidden_size:
            raise HeadsError(
                f"heads of hidden size {self.hidden_size} for a model of hidden size {hidden_size}"
            )
