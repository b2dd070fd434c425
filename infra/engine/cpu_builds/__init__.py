"""llama.cpp's CPU builds: which backend library this CPU runs (the variants a portable build
ships, each probed with the model in a child process), loaded before any model is, and the
library's process-wide initialisation (`llama_init`)."""
