"""Parameter groups: which part of the model a parameter belongs to, by where it sits (its
path in the parameter tree). `train.freeze` / `train.trainable` (training/freezing.py) and
`train.lora.targets` (models/lora.py) name parameters by these groups:

- `router`: an MoE layer's router (its weights, bias and selection bias);
- `experts`: an MoE layer's experts (their kernels and biases);
- `shared_experts`: an MoE layer's shared experts and their gate;
- `dense_ffn`: the FFN of a dense layer;
- `attention`: self- and cross-attention (q/k/v/out, their biases and norms, T5's
  relative-position tables, MLA's projections);
- `norms`: the block and final RMSNorm scales;
- `embeddings`: the input embedding (the output layer too when tied);
- `head`: the untied output layer.
"""

GROUPS = (
    "router",
    "experts",
    "shared_experts",
    "dense_ffn",
    "attention",
    "norms",
    "embeddings",
    "head",
)
_ATTENTION = ("attn", "self_attn", "cross_attn", "encoder_relpos", "decoder_relpos")
_ROUTER = ("router", "router_bias", "selection_bias")


def parse_groups(text: str, key: str) -> tuple[str, ...]:
    """The groups of a comma list (`train.freeze` / `train.trainable`); ValueError naming
    the key for an unknown one."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        raise ValueError(f"{key}={text!r}: unknown group {unknown[0]!r} ({' | '.join(GROUPS)})")
    return names


def group_of(path: tuple[str, ...], moe_ffns: set[tuple[str, ...]]) -> str:
    """The group of the parameter at `path`; `moe_ffns`: the paths of the MoE FFN modules."""
    parts = tuple(str(p) for p in path)
    for i, part in enumerate(parts):
        if parts[: i + 1] in moe_ffns:
            child = parts[i + 1]
            if child in ("shared", "shared_gate"):
                return "shared_experts"
            return "router" if child in _ROUTER else "experts"
        if part in _ATTENTION:
            return "attention"
    if parts[0] == "lm_head":
        return "head"
    if parts[-1] == "embedding":
        return "embeddings"
    if parts[-1] == "scale":
        return "norms"
    return "dense_ffn"


def moe_ffn_paths(paths) -> set[tuple[str, ...]]:
    """The paths of the MoE FFN modules among parameter `paths` (those holding a router)."""
    return {p[: p.index("router")] for p in paths if "router" in p}
