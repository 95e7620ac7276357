"""Orbax checkpoints (manager.py), checkpoint surgery (surgery.py: GQA pooling, sparse
upcycling), and conversion to and from T5X (t5x/) and Hugging Face (hf/)."""
