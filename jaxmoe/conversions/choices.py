"""Values the conversion commands' flags take, in a module that imports nothing: the CLI
builds its parsers (and answers `--help`) without starting JAX."""

METHODS = ("mean", "first", "random")  # `convert gqa --method`: how KV heads are pooled
DEFAULT_MAX_SHARD_SIZE = "5GB"  # `export hf --max_shard_size`: save_pretrained's default
# `convert hf`: every config.json model_type the importer reads (conversions/hf/names.py's
# SUPPORTED_MODEL_TYPES; tests/test_cli_help.py keeps the two equal), as --help names them.
HF_FAMILIES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "mixtral": "Mixtral",
    "qwen2": "Qwen2",
    "qwen2_moe": "Qwen2-MoE",
    "qwen3_moe": "Qwen3-MoE",
    "olmoe": "OLMoE",
    "deepseek_v2": "DeepSeek-V2",
    "deepseek_v3": "DeepSeek-V3",
    "gpt_oss": "GPT-OSS",
    "t5": "T5 v1.1",
    "jaxmoe_moe": "jaxmoe's own `export hf`",
}
