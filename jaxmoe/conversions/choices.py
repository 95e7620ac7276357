"""Values the conversion commands' flags take, in a module that imports nothing: the CLI
builds its parsers (and answers `--help`) without starting JAX."""

METHODS = ("mean", "first", "random")  # `convert gqa --method`: how KV heads are pooled
DEFAULT_MAX_SHARD_SIZE = "5GB"  # `export hf --max_shard_size`: save_pretrained's default
