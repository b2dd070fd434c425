"""Reading corpora: safe file access, document formats, structure-aware passages."""
