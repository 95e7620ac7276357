"""jaxmoe's own checkpoints: Orbax training steps and parameter trees (manager.py,
restore.py), the tokenizer each holds (tokenizer_item.py), atomic staging (staging.py) and
the path checks that keep a received checkpoint's metadata inside it (safe_paths.py).
Conversions to and from other formats live above, in jaxmoe/conversions/."""
