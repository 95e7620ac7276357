"""`jaxmoe convert t5x SRC DST`: a T5X T5.1.1 checkpoint -> a jaxmoe checkpoint + its config.

The architecture is read off the tensor shapes:
vocabulary and width from `token_embedder/embedding [V, D]`, layer counts from the
`layers_<i>` names, FFN width from `mlp/wi_0 [D, F]` (gated GELU, T5.1.1) or `mlp/wi`
(ungated ReLU: T5 v1.0, Switch Base), an untied output layer from `decoder/logits_dense`
(without it the logits come from the embedding, scaled by 1/sqrt(D)), MoE layers
(Flaxformer's MoeLayer: Switch Transformer and other token-choice MoE checkpoints) from
`mlp/router/...` and `mlp/expert/...` (moe.py), heads from the relative-bias table
`relpos_bias/rel_embedding [H, buckets]`, head width = query width / H, key/value heads from
the key width (GQA-uptrained checkpoints convert too). Flags cover the rest (max distance,
or heads when no table exists). Every tensor is checked against the model that config
builds before anything is written, so a bad checkpoint fails in one line naming the tensor.

Arrays are then read, reshaped ([D, H*dh] -> [D, H, dh], out [H*dh, D] -> [H, dh, D]) and
cast one at a time, and handed to Orbax's partial save in groups of about
G = max(256 MiB, largest tensor, total / 64). Peak memory is a few G (the group plus Orbax's
copies while it writes; measured ~200 MiB + 2.5 G), never the whole model; an inline legacy
msgpack file is also held by the reader. Of the optimizer state only `step` is read: the
stored config records it (`source.step`) beside T5.1.1's pre-training recipe, so uptraining
(configs/uptrain_gqa.py) continues T5X's schedule from that step. `--keep_optimizer` also
converts T5X's Adafactor moments (optimizer.py) into an `opt_state` item.
"""

import os
import re
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import orbax.checkpoint.experimental.v1 as ocp_v1
from ml_collections import ConfigDict

from jaxmoe.checkpoints.dtypes import output_dtype
from jaxmoe.checkpoints.finite import check_finite
from jaxmoe.checkpoints.manager import CheckpointError, write_config
from jaxmoe.checkpoints.staging import refuse_existing, staged_directory
from jaxmoe.checkpoints.trees import flatten, unflatten
from jaxmoe.config.loading import with_overrides
from jaxmoe.config.schema import JobConfig, typed
from jaxmoe.conversions.t5x.moe import SWITCH_RECIPE, infer_moe, t5x_moe_name
from jaxmoe.conversions.t5x.reader import TensorTable, open_t5x
from jaxmoe.models.spec import abstract_params
from jaxmoe.models.stack import unrolled_config

_GROUP_BYTES = 256 << 20
_MAX_GROUPS = 64  # Orbax's partial save slows down with each call; keep the calls few
_EMBEDDING = "token_embedder/embedding"
_LAYER = re.compile(r"(encoder|decoder)/layers_(\d+)/")
_LOGITS = "decoder/logits_dense/kernel"

# jaxmoe parameter path -> T5X name. Top-level parameters:
_TOP_NAMES = {
    ("token_embed", "embedding"): _EMBEDDING,
    ("encoder_relpos", "rel_embedding"): "encoder/relpos_bias/rel_embedding",
    ("encoder_norm", "scale"): "encoder/encoder_norm/scale",
    ("decoder_relpos", "rel_embedding"): "decoder/relpos_bias/rel_embedding",
    ("decoder_norm", "scale"): "decoder/decoder_norm/scale",
    ("lm_head",): _LOGITS,
}
# Per-layer modules: jaxmoe name -> T5X name, for each stack.
_ENCODER_MODULES = {
    "attn_norm": "pre_attention_layer_norm",
    "attn": "attention",
    "ffn_norm": "pre_mlp_layer_norm",
    "ffn": "mlp",
}
_DECODER_MODULES = {
    "self_attn_norm": "pre_self_attention_layer_norm",
    "self_attn": "self_attention",
    "cross_attn_norm": "pre_cross_attention_layer_norm",
    "cross_attn": "encoder_decoder_attention",
    "ffn_norm": "pre_mlp_layer_norm",
    "ffn": "mlp",
}
_LAYER_MODULES = {
    "encoder_layers": ("encoder", _ENCODER_MODULES),
    "decoder_layers": ("decoder", _DECODER_MODULES),
}
_KERNELS = ("query", "key", "value", "out", "wi_0", "wi_1", "wi", "wo")


def t5x_name(path: tuple[str, ...], expert: bool = False) -> str:
    """The T5X name of the jaxmoe parameter at `path`, e.g. ('decoder_layers', '0',
    'self_attn', 'key') -> 'decoder/layers_0/self_attention/key/kernel'. `expert`: the
    FFN kernel belongs to an MoE layer (stacked experts under `mlp/expert`)."""
    if path in _TOP_NAMES:
        return _TOP_NAMES[path]
    if len(path) == 4 and path[0] in _LAYER_MODULES:
        stack, modules = _LAYER_MODULES[path[0]]
        index, module, param = path[1:]
        moe_param = module == "ffn" and (expert or param in ("router", "router_bias"))
        if moe_param and (name := t5x_moe_name(stack, index, param)):
            return name
        if module in modules and (param in _KERNELS or param == "scale"):
            leaf = f"{param}/kernel" if param in _KERNELS else param
            return f"{stack}/layers_{index}/{modules[module]}/{leaf}"
    raise CheckpointError(f"jaxmoe parameter {'/'.join(path)} has no T5X counterpart")


def t5x_shape(path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """The T5X shape of a jaxmoe parameter: attention kernels keep heads merged."""
    if path[-1] in ("query", "key", "value"):  # [D, H, dh] -> [D, H*dh]
        return (shape[0], shape[1] * shape[2])
    if path[-1] == "out":  # [H, dh, D] -> [H*dh, D]
        return (shape[0] * shape[1], shape[2])
    return tuple(shape)


def _shape(table: TensorTable, name: str, src, why: str) -> tuple[int, int]:
    """The shape of 2-D tensor `name`, which the inference needs."""
    if name not in table:
        raise CheckpointError(f"{src}: missing parameter {name} (needed for {why})")
    shape = table.shape(name)
    if len(shape) != 2:
        raise CheckpointError(f"{src}: tensor {name} has shape {list(shape)}, expected 2-D")
    return shape


def _divide(total: int, part: int, what: str) -> int:
    if part <= 0 or total % part:
        raise CheckpointError(f"{what}: {total} is not divisible by {part}")
    return total // part


def infer_model(
    table: TensorTable,
    src,
    *,
    num_heads: int | None = None,
    head_dim: int | None = None,
    relpos_max_distance: int = 128,
) -> dict:
    """The `model.*` values of a T5.1.1 checkpoint, inferred from its tensor shapes; "moe"
    holds the `model.moe.*` values (num_experts 0 for a dense checkpoint)."""
    names = table.names()
    indices = {"encoder": set(), "decoder": set()}
    for name in names:
        if match := _LAYER.match(name):
            indices[match.group(1)].add(int(match.group(2)))
    layers = {stack: max(found, default=-1) + 1 for stack, found in indices.items()}
    for stack, count in layers.items():
        if not count:
            raise CheckpointError(
                f"{src}: no {stack}/layers_<i>/... tensors: not a T5 encoder-decoder checkpoint"
            )
        if len(indices[stack]) != count:  # a layers_999999999 would build 10**9 layers
            raise CheckpointError(
                f"{src}: {stack} layers are numbered up to layers_{count - 1} but only "
                f"{len(indices[stack])} of them have tensors"
            )
    moe = infer_moe(table, src, layers)
    vocab, d_model = _shape(table, _EMBEDDING, src, "the vocabulary and width")
    gated, ffn_dim = _ffn_form(table, src, layers["encoder"], moe)

    tables = [f"{stack}/relpos_bias/rel_embedding" for stack in layers]
    relpos = next((name for name in tables if name in table), None)
    if relpos is None:
        raise CheckpointError(
            f"{src}: no relpos_bias/rel_embedding table to read the head count and buckets from"
        )
    table_heads, buckets = _shape(table, relpos, src, "the head count")
    if num_heads is not None and num_heads != table_heads:
        raise CheckpointError(
            f"{src}: --num_heads={num_heads} but {relpos} {list(table.shape(relpos))} has "
            f"{table_heads} heads"
        )
    heads = table_heads
    query = "encoder/layers_0/attention/query/kernel"
    width = _shape(table, query, src, "model.head_dim")[1]
    if head_dim is None:
        head_dim = _divide(width, heads, f"{src}: {query} {[d_model, width]} over {heads} heads")
    elif heads * head_dim != width:
        raise CheckpointError(
            f"{src}: {query} is {[d_model, width]} but --head_dim={head_dim} x {heads} heads "
            f"needs width {heads * head_dim}"
        )

    def kv_heads(name: str) -> int:
        key_width = _shape(table, name, src, "the key/value head count")[1]
        return _divide(key_width, head_dim, f"{src}: {name} width vs head_dim={head_dim}")

    encoder_kv = kv_heads("encoder/layers_0/attention/key/kernel")
    return {
        "arch": "encoder_decoder",
        "vocab_size": vocab,
        "d_model": d_model,
        "num_layers": layers["decoder"],
        "num_encoder_layers": layers["encoder"],
        "num_heads": heads,
        "num_kv_heads": kv_heads("decoder/layers_0/self_attention/key/kernel"),
        "encoder_num_kv_heads": 0 if encoder_kv == heads else encoder_kv,
        "head_dim": head_dim,
        "ffn_dim": ffn_dim,
        # T5.1.1 and Switch XXL: gated GELU; T5 v1.0 and Switch Base / Large / C: ReLU.
        "activation": "gelu" if gated else "relu",
        "ffn_gated": gated,
        "norm_eps": 1e-6,
        "rope_theta": 0.0,
        "tie_embeddings": _LOGITS not in table,
        "relpos_buckets": buckets,
        "relpos_max_distance": relpos_max_distance,
        "moe": moe,
    }


def _ffn_form(table: TensorTable, src, num_layers: int, moe: dict) -> tuple[bool, int]:
    """(gated, dense FFN width) from the encoder's first dense FFN (`wi_0` gated, `wi`
    not) and the experts, which must agree: jaxmoe's model.ffn_gated holds for every FFN.
    With an MoE in every layer the dense width is the experts' (no dense layer uses it)."""
    prefixes = []
    dense = next(
        (i for i in range(num_layers) if not moe["num_experts"] or (i + 1) % moe["every"]), None
    )
    if dense is not None:
        prefixes.append(f"encoder/layers_{dense}/mlp")
    if moe["num_experts"]:
        prefixes.append(f"encoder/layers_{moe['every'] - 1}/mlp/expert")
    forms = {}
    for prefix in prefixes:
        if f"{prefix}/wi_0/kernel" in table:
            forms[prefix] = True
        elif f"{prefix}/wi/kernel" in table:
            forms[prefix] = False
        else:
            raise CheckpointError(
                f"{src}: missing parameter {prefix}/wi_0/kernel (or wi/kernel; needed for the "
                "FFN width)"
            )
    if len(set(forms.values())) > 1:
        form = {True: "gated (wi_0, wi_1)", False: "ungated (wi)"}
        (a, a_gated), (b, b_gated) = forms.items()
        raise CheckpointError(
            f"{src}: {b} is {form[b_gated]} but {a} is {form[a_gated]}; jaxmoe's "
            "model.ffn_gated applies to every FFN"
        )
    gated = next(iter(forms.values()))
    if dense is None:
        return gated, moe["ffn_dim"]
    name = f"{prefixes[0]}/{'wi_0' if gated else 'wi'}/kernel"
    return gated, _shape(table, name, src, "model.ffn_dim")[1]


# T5.1.1's pre-training recipe in T5X (its gin defaults), by section: T5X's Adafactor (decay
# 0.8, update clipping 1.0, parameter scaling, no momentum), lr = 1 / sqrt(max(step, 10k)),
# no weight decay or global clipping, no dropout, span corruption 15% / mean span 3,
# output-logit z-loss 1e-4. Batch and lengths stay jaxmoe's (T5.1.1: 2048 sequences of 512
# encoder / 114 decoder tokens).
T5_1_1_RECIPE = {
    "optimizer": {
        "name": "t5x_adafactor",
        "schedule": "t5x_rsqrt",
        "learning_rate": 1.0,
        "warmup_steps": 10_000,
        "weight_decay": 0.0,
        "grad_clip_norm": 0.0,
        "decay_rate": 0.8,
        "clipping_threshold": 1.0,
        "momentum": 0.0,
    },
    "model": {"dropout_rate": 0.0},
    "train": {"logits_z_loss": 1e-4},
    "data": {"noise_density": 0.15, "mean_noise_span": 3.0},
}


def t5_1_1_recipe(config: ConfigDict) -> ConfigDict:
    """A config file's `config` with T5_1_1_RECIPE set (ConfigDict.update: section by
    section)."""
    config.update(T5_1_1_RECIPE)
    return config


def build_config(model_values: dict, overrides=(), source_step: int = 0) -> JobConfig:
    """The full jaxmoe config of a converted checkpoint: the inferred model (a dense FFN, or
    MoE layers with Switch's routing options for a Flaxformer MoE checkpoint), T5.1.1's
    recipe, the T5X step it stopped at (`source.step`), the defaults for the rest, then the
    user's `--config.*` overrides."""
    moe = {"num_experts": 0, **model_values.get("moe", {})}
    if moe["num_experts"]:
        moe |= SWITCH_RECIPE
    values = {section: dict(keys) for section, keys in T5_1_1_RECIPE.items()}
    values["model"] |= {**model_values, "moe": moe}
    values["source"] = {"format": "t5x", "step": int(source_step)}
    return with_overrides(typed(values), overrides)


def plan_conversion(table: TensorTable, model_cfg, src) -> list[tuple[tuple[str, ...], str, tuple]]:
    """[(jaxmoe path, T5X name, jaxmoe shape)] for every parameter, after checking that the
    checkpoint holds exactly these tensors with the shapes the config needs."""
    expected = {
        path: tuple(leaf.shape)
        for path, leaf in flatten(abstract_params(unrolled_config(model_cfg))).items()
    }
    plan = [
        (path, t5x_name(path, expert=len(shape) == 3 and path[2:3] == ("ffn",)), shape)
        for path, shape in expected.items()
    ]
    known = {name for _, name, _ in plan}
    problems = [
        f"unknown parameter {name} {list(table.shape(name))} (no counterpart in the "
        f"inferred T5.1.1 model)"
        for name in table.names()
        if name not in known
    ]
    for path, name, shape in plan:
        want = t5x_shape(path, shape)
        if name not in table:
            problems.append(f"missing parameter {name}: jaxmoe {'/'.join(path)} needs {list(want)}")
        elif table.shape(name) != want:
            problems.append(
                f"tensor {name} has shape {list(table.shape(name))} but the model config "
                f"({_model_summary(model_cfg)}) needs {list(want)}"
            )
        elif not _is_float(table.dtype(name)):
            problems.append(f"tensor {name} has dtype {table.dtype(name)}, not floating point")
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise CheckpointError(f"{src}: {problems[0]}{more}")
    return plan


def _model_summary(m) -> str:
    return (
        f"d_model={m.d_model}, heads={m.num_heads}x{m.head_dim}, kv_heads={m.num_kv_heads}, "
        f"ffn_dim={m.ffn_dim}, vocab={m.vocab_size}, experts={m.moe.num_experts}"
    )


def _is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype == np.dtype(ml_dtypes.bfloat16)


def _groups(plan, itemsize: int) -> list[list]:
    """Consecutive runs of the plan holding about one group budget of bytes each."""
    sizes = [int(np.prod(shape)) * itemsize for _, _, shape in plan]
    budget = max(_GROUP_BYTES, max(sizes), -(-sum(sizes) // _MAX_GROUPS))
    groups, current, used = [], [], 0
    for item, size in zip(plan, sizes, strict=True):
        if current and used + size > budget:
            groups.append(current)
            current, used = [], 0
        current.append(item)
        used += size
    return [*groups, current] if current else groups


def convert_t5x(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    dtype: str = "float32",
    num_heads: int | None = None,
    head_dim: int | None = None,
    relpos_max_distance: int = 128,
    overrides=(),
    keep_optimizer: bool = False,
) -> JobConfig:
    """Converts T5X checkpoint `src` into a new jaxmoe checkpoint directory `dst`
    (`params` + `config`, what `jaxmoe eval --checkpoint DST` reads; `opt_state` with
    `keep_optimizer`, which `train.init_optimizer` restores). Returns the config."""
    out_dtype = output_dtype(dtype)
    dst = refuse_existing(dst)
    table = open_t5x(src)
    values = infer_model(
        table,
        src,
        num_heads=num_heads,
        head_dim=head_dim,
        relpos_max_distance=relpos_max_distance,
    )
    config = build_config(values, overrides, source_step=table.step or 0)
    plan = plan_conversion(table, config.model, src)
    opt_state = None
    if keep_optimizer:
        from jaxmoe.conversions.t5x.optimizer import adafactor_state

        opt_state = adafactor_state(table, config, plan, src)
        # Uptraining from DST continues these moments.
        config = config.replace(train=config.train.replace(init_optimizer=True))

    with staged_directory(dst) as staging:  # DST never holds half a checkpoint
        for group in _groups(plan, out_dtype.itemsize):
            arrays = {
                path: check_finite(table.read(name), f"{src}: tensor {name}")
                .reshape(shape)
                .astype(out_dtype, copy=False)
                for path, name, shape in group
            }
            ocp_v1.partial.save(staging / "orbax", unflatten(arrays))
            del arrays  # before the next group is read
        ocp_v1.partial.finalize(staging / "orbax")
        _tree_directory(staging / "orbax").rename(staging / "params")
        shutil.rmtree(staging / "orbax")
        if opt_state is not None:
            with ocp.StandardCheckpointer() as checkpointer:
                checkpointer.save(staging / "opt_state", opt_state)
        write_config(staging, config)  # with a copy of a tokenizer named by data.tokenizer
    return config


def _tree_directory(checkpoint: Path) -> Path:
    """The saved pytree inside an Orbax v1 checkpoint (named `state` by Orbax 0.12), which
    jaxmoe checkpoints hold as `params`, where `StandardCheckpointer` restores it from."""
    trees = [d for d in checkpoint.iterdir() if (d / "_METADATA").is_file()]
    if len(trees) != 1:
        raise CheckpointError(
            f"{checkpoint}: expected one saved tree from Orbax's partial save, found "
            f"{sorted(d.name for d in trees)} (an Orbax layout this converter does not know)"
        )
    return trees[0]
