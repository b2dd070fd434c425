"""Caches: the two-tier (in-process, Redis) store, the query cache and the passage KV states."""
