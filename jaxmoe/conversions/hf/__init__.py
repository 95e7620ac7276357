"""Hugging Face checkpoints: import (importer.py), export (exporter.py), the shared name
table and HF config import (names.py), config.json export (export_config.py) and tokenizer
export (tokenizer.py)."""
