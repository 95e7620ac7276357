"""The JSON files Hugging Face keeps beside a tokenizer (tokenizer_config.json,
generation_config.json), read for both tokenizer kinds (tokenizer.py, hf_tokenizer.py)."""

import json
import os

from jaxmoe.storage.received import read_text


def read_json_object(path: str, culprit: str) -> dict:
    """A tokenizer's JSON side file; a one-line ValueError naming data.tokenizer if bad."""
    try:
        values = json.loads(read_text(path, os.path.basename(path)))
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


CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers >= 4.43 saves the template


def chat_template(folder: str, config: dict, culprit: str) -> str | None:
    """The tokenizer's chat template, as transformers finds it: chat_template.jinja beside it,
    else tokenizer_config.json's `chat_template` (`config`: a string, or a list of named
    templates of which "default" is used); None without one."""
    path = os.path.join(folder, CHAT_TEMPLATE_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"data.tokenizer={culprit!r}: chat_template is not a template string")
    return value or None
