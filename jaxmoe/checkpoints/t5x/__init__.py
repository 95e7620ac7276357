"""T5X checkpoints: reading them tensor by tensor (reader.py), converting them into jaxmoe
(convert.py) with their Adafactor state (optimizer.py)."""
