"""The passage embedder (MiniLM through llama.cpp's BERT support) and its tokenizer."""
