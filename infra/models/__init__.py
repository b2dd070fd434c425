"""Model files: presets, downloads and joins, GGUF export, the reflection heads on disk."""
