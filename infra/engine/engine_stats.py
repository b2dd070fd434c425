"""The work counters of a `LlamaEngine` (`LlamaEngine.stats`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields


@dataclass
class EngineStats:
    """Work counters since the engine was created (or `reset_stats`)."""

    prefill_tokens: int = 0
    """Prompt tokens decoded (the shared prefix of a batch counts once)."""
    cached_tokens: int = 0
    """Prompt tokens found in a slot's KV cache from an earlier call and not decoded again."""
    shared_tokens: int = 0
    """Prompt tokens a sequence received by copying the batch's shared prefix (seq_cp)."""
    generated_tokens: int = 0
    """Tokens produced by `generate` (stop and end-of-generation tokens included)."""
    decode_calls: int = 0
    """`llama_decode` calls, prefill chunks and generation steps together."""
    decode_steps: int = 0
    """Generation steps: `llama_decode` calls that advance every live sequence by one token."""
    batch_sizes: Counter[int] = field(default_factory=Counter)
    """How many `llama_decode` calls carried each number of distinct sequences."""
    kv_restores: int = 0
    """Reusable prefixes restored from the prefix-state store instead of decoded."""
    kv_restored_tokens: int = 0
    """Prompt tokens those restores supplied."""
    kv_saves: int = 0
    """Reusable prefix states computed here and put into the store."""
    kv_misses: int = 0
    """Store lookups that found no state (the prefix was decoded, then saved)."""
    kv_restore_failures: int = 0
    """Stored states llama.cpp rejected (corrupt, foreign); the prefix was recomputed."""

    def reset(self) -> None:
        """Every counter back to zero, in place (the batch decoder and the prefix stager hold
        this object)."""
        for f in fields(self):
            setattr(self, f.name, Counter() if f.name == "batch_sizes" else 0)

    def copy(self) -> EngineStats:
        return EngineStats(
            kv_restores=self.kv_restores,
            kv_restored_tokens=self.kv_restored_tokens,
            kv_saves=self.kv_saves,
            kv_misses=self.kv_misses,
            kv_restore_failures=self.kv_restore_failures,
            prefill_tokens=self.prefill_tokens,
            cached_tokens=self.cached_tokens,
            shared_tokens=self.shared_tokens,
            generated_tokens=self.generated_tokens,
            decode_calls=self.decode_calls,
            decode_steps=self.decode_steps,
            batch_sizes=Counter(self.batch_sizes),
        )
