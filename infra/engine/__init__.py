"""The model engine: llama.cpp (its CPU builds, batches, KV groups, threads, vocabulary) and
vLLM."""
