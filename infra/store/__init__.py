"""The passage store: Qdrant (embedded, Edge or a server) with dense and BM25 vectors."""
