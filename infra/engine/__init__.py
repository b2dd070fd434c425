"""The model engine: llama.cpp (its batched calls, batches, KV slots and groups, prefix staging,
threads, vocabulary; its CPU builds and process-wide initialisation in `cpu_builds/`) and vLLM."""
