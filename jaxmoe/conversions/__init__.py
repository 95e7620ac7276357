"""Conversions between jaxmoe checkpoints and other formats or shapes: T5X and Hugging Face
in both directions (`convert t5x|hf`, `export t5x|hf`) and checkpoint surgery (`convert
gqa|upcycle`). This package sits above checkpoints/ and training/: it reads and writes
checkpoints with their tools, and nothing below it imports it."""
