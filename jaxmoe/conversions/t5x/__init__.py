"""T5X checkpoints: reading them tensor by tensor (reader.py; T5X's Orbax-manager ones
through Orbax: ocdbt.py), converting them into jaxmoe (convert.py) with their Adafactor
state (optimizer.py), and writing jaxmoe models as T5X checkpoints (exporter.py)."""
