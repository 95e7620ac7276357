"""The JSON files Hugging Face keeps beside a tokenizer (tokenizer_config.json,
generation_config.json), read for both tokenizer kinds (tokenizer.py, hf_tokenizer.py)."""

import json
import os


def read_json_object(path: str, culprit: str) -> dict:
    """A tokenizer's JSON side file; a one-line ValueError naming data.tokenizer if bad."""
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"data.tokenizer={culprit!r}: cannot read {path}: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"data.tokenizer={culprit!r}: {path} is not a JSON object")
    return values


def generation_eos_ids(folder: str, culprit: str) -> list[int]:
    """The `eos_token_id` (an id or a list of ids) of `folder`/generation_config.json, or []."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return []
    value = read_json_object(path, culprit).get("eos_token_id")
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"data.tokenizer={culprit!r}: {path}: eos_token_id={value!r}")
    return ids
