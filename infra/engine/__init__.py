"""The model engine: llama.cpp (its batched calls, batches, KV groups, threads, vocabulary;
its CPU builds in `cpu_builds/`) and vLLM."""
