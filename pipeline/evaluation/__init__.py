"""Evaluation: QA metrics and the baselines Self-RAG is compared with."""
