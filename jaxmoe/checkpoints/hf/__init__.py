"""Hugging Face checkpoints: import (importer.py), export (exporter.py), the shared name and
config table (names.py) and tokenizer export (tokenizer.py)."""
