"""Using a trained model: scoring (evaluate.py), decoding with a KV cache (decode.py, beam
search), generation tasks, lm-evaluation-harness, and routing analysis (routing_*.py)."""
