"""BM25-style sparse vectors for hybrid search.

Documents carry the BM25 term-frequency part, queries carry 1.0 per distinct term, and Qdrant
multiplies in the IDF (`Modifier.IDF` on the sparse vector), so the dot product is a BM25 score.
Everything here is deterministic across processes and machines: changing the tokenizer, the
hash or the parameters changes stored vectors, so bump `SCHEME` whenever any of them changes.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from hashlib import blake2b

SCHEME = "bm25-blake2b31-v1"
K1 = 1.2
B = 0.75
# Qdrant computes IDF but not the corpus average length, so length normalisation uses a fixed
# value: passages of 100-150 words average about 64 tokens once stop words are dropped
# (measured on the SQuAD + Wikipedia sample corpus).
AVERAGE_LENGTH = 64.0

_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*")
STOP_WORDS = frozenset(
    """
    a an and are as at be been being but by can could did do does for from had has have he her
    hers him his how i if in into is it its itself me my of on or our ours she should so than
    that the their theirs them then there these they this those to too was we were what when
    where which who whom why will with would you your yours s t
    """.split()
)


@dataclass(frozen=True)
class SparseVec:
    """Sorted unique `indices` and their `values`, as `qdrant_client.models.SparseVector` takes."""

    indices: list[int]
    values: list[float]

    def __len__(self) -> int:
        return len(self.indices)


def tokenize(text: str) -> list[str]:
    """Lowercased word tokens (letters and digits, inner apostrophes kept) minus stop words."""
    tokens = []
    for match in _WORD.finditer(text.lower()):
        # "Normandy's" and "Normandy’s" should both match "normandy".
        token = match.group().replace("’", "'")
        if token.endswith("'s"):
            token = token[:-2]
        if token and token not in STOP_WORDS:
            tokens.append(token)
    return tokens


def token_index(token: str) -> int:
    """A stable index in [0, 2^31) for `token` (Python's hash() is salted per process)."""
    digest = blake2b(token.encode("utf-8"), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


def document_vector(
    text: str, *, k1: float = K1, b: float = B, average_length: float = AVERAGE_LENGTH
) -> SparseVec:
    """BM25 term-frequency weights `tf*(k1+1) / (tf + k1*(1-b+b*len/avg))` of `text`."""
    tokens = tokenize(text)
    counts = _index_counts(tokens)
    norm = k1 * (1.0 - b + b * len(tokens) / average_length)
    indices = sorted(counts)
    return SparseVec(indices, [counts[i] * (k1 + 1.0) / (counts[i] + norm) for i in indices])


def query_vector(text: str) -> SparseVec:
    """1.0 for every distinct query term; empty when the query has only stop words."""
    indices = sorted(_index_counts(tokenize(text)))
    return SparseVec(indices, [1.0] * len(indices))


def _index_counts(tokens: list[str]) -> Counter[int]:
    # Counting by index merges hash collisions, which Qdrant requires (unique indices).
    return Counter(token_index(token) for token in tokens)
