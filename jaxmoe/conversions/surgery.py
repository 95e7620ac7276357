"""Checkpoint surgery: multi-head -> grouped-query attention, dense -> MoE (sparse upcycling).

`jaxmoe convert gqa SRC DST --num_kv_heads G [--method mean|first|random]`
  (Ainslie et al. 2023) H query heads keep their projections; the key/value projections
  [D, K, d] are pooled into G contiguous groups (query head h reads KV head h // (H/G)):
  `mean` averages each group's heads, `first` keeps its first head, `random` draws fresh
  ones (the paper's ablation). Decoder self-attention (and, for an encoder-decoder,
  cross-attention) is converted; the encoder only with --include_encoder, as in the paper.
`jaxmoe convert upcycle SRC DST --num_experts E [--every K]`
  (Komatsuzaki et al. 2023) each dense FFN of an MoE slot becomes E copies of itself plus a
  fresh router. The gate is set to combine weights that sum to one (renormalize=True,
  single_weight="one"), so every token gets the dense FFN's output: the upcycled model
  starts exactly at the dense model's function whatever the router says.

SRC is a training workdir, a step directory or a converted (params-only) checkpoint. The
work happens on a mesh over all devices along `fsdp` (parameters sharded, not replicated),
and DST (params + updated config) appears atomically, like the other converters' output;
a converted SRC's own tokenizer folder is copied into DST (stored_tokenizer.py).
"""

import logging
import math
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxmoe.checkpoints.finite import check_finite
from jaxmoe.checkpoints.manager import (
    CheckpointError,
    resolve_checkpoint,
    save_params,
)
from jaxmoe.checkpoints.restore import restore_on_mesh
from jaxmoe.checkpoints.staging import refuse_existing, staged_directory
from jaxmoe.checkpoints.stored_tokenizer import TOKENIZER_DIR, inherited_tokenizer
from jaxmoe.checkpoints.trees import flatten, unflatten
from jaxmoe.config.schema import JobConfig
from jaxmoe.config.stored import read_config
from jaxmoe.conversions.choices import METHODS
from jaxmoe.models.layers import fan_in_init
from jaxmoe.models.spec import model_spec
from jaxmoe.models.stack import layer_layouts, stack_layers, unrolled_config
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.options import MeshOptions

log = logging.getLogger(__name__)

# The mesh conversions run on: every device along fsdp, so no device holds a full copy.
_CONVERT_MESH = MeshOptions(data=1, fsdp=-1)
_EXPERT_KERNELS = ("wi_0", "wi_1", "wi", "wo")
UPCYCLE_INITS = ("copy", "random")  # convert upcycle --init


# --- GQA: pooling key/value heads ------------------------------------------------------


def pool_kv_heads(kernel_DKd, num_groups: int, method: str, key=None):
    """[D, K, d] -> [D, G, d] over G contiguous groups of K/G heads.

    mean: the group's average; first: its first head; random: a fresh draw with the
    initialiser of `Attention` (needs `key`).
    """
    d_model, kv_heads, head_dim = kernel_DKd.shape
    if method == "random":
        return fan_in_init((0,))(key, (d_model, num_groups, head_dim), kernel_DKd.dtype)
    grouped_DGSd = kernel_DKd.reshape(d_model, num_groups, kv_heads // num_groups, head_dim)
    if method == "mean":
        return jnp.mean(grouped_DGSd, axis=2)
    if method == "first":
        return grouped_DGSd[:, :, 0]
    raise ValueError(f"--method={method!r} is not one of {list(METHODS)}")


def gqa_targets(model_cfg, include_encoder: bool) -> list[tuple[str, str, int]]:
    """(layer stack, attention module, current KV heads) for each attention to convert."""
    if model_cfg.arch != "encoder_decoder":
        if include_encoder:
            raise ValueError("--include_encoder needs an encoder: model.arch is 'decoder'")
        return [("layers", "attn", model_cfg.num_kv_heads)]
    targets = [
        ("decoder_layers", "self_attn", model_cfg.num_kv_heads),
        ("decoder_layers", "cross_attn", model_cfg.num_kv_heads),
    ]
    if include_encoder:
        encoder_kv = model_cfg.encoder_num_kv_heads or model_cfg.num_heads
        targets.append(("encoder_layers", "attn", encoder_kv))
    return targets


def check_num_kv_heads(model_cfg, num_kv_heads: int, method: str, include_encoder: bool):
    """One-line errors for a group count the model cannot take."""
    if model_cfg.attention == "mla":
        raise ValueError(
            "model.attention='mla': latent attention has no key/value heads to pool (each "
            "head's keys and values are rebuilt from one shared latent); GQA conversion "
            "applies to model.attention='gqa' checkpoints"
        )
    if method not in METHODS:
        raise ValueError(f"--method={method!r} is not one of {list(METHODS)}")
    heads = model_cfg.num_heads
    if num_kv_heads < 1 or heads % num_kv_heads:
        raise ValueError(
            f"--num_kv_heads={num_kv_heads} does not divide model.num_heads={heads} "
            f"(query heads must split into equal groups)"
        )
    targets = gqa_targets(model_cfg, include_encoder)
    if method != "random" and {kv for _, _, kv in targets} == {num_kv_heads}:
        raise ValueError(
            f"--num_kv_heads={num_kv_heads}: the checkpoint already has {num_kv_heads} KV "
            f"heads wherever they would be pooled (model.num_kv_heads="
            f"{model_cfg.num_kv_heads}), so DST would equal SRC; give fewer (1 = MQA)"
        )
    if method == "random":
        return
    for stack, module, kv_heads in targets:
        if kv_heads % num_kv_heads:
            key = "encoder_num_kv_heads" if stack == "encoder_layers" else "num_kv_heads"
            raise ValueError(
                f"--num_kv_heads={num_kv_heads} does not divide the checkpoint's "
                f"model.{key}={kv_heads} ({stack}.*.{module}: only whole groups of existing "
                f"KV heads can be pooled; --method=random can widen)"
            )


def gqa_params(
    params: dict, model_cfg, num_kv_heads: int, method="mean", include_encoder=False, seed=0
) -> dict:
    """A copy of `params` with each converted attention's key/value (and their biases)
    pooled to G heads."""
    check_num_kv_heads(model_cfg, num_kv_heads, method, include_encoder)
    out = dict(params)
    base_key = jax.random.key(seed)
    counter = 0
    for stack, module, _ in gqa_targets(model_cfg, include_encoder):
        out[stack] = dict(out[stack])
        for layer in sorted(out[stack], key=int):
            attention = dict(out[stack][layer][module])
            for name in ("key", "value"):
                counter += 1
                key = jax.random.fold_in(base_key, counter)
                attention[name] = pool_kv_heads(attention[name], num_kv_heads, method, key)
                bias = attention.get(f"{name}_bias")  # [K, d] (model.qkv_bias): as a [1, K, d]
                if bias is not None:
                    attention[f"{name}_bias"] = (
                        jnp.zeros((num_kv_heads, bias.shape[1]), bias.dtype)  # the init
                        if method == "random"
                        else pool_kv_heads(bias[None], num_kv_heads, method)[0]
                    )
            out[stack][layer] = {**out[stack][layer], module: attention}
    return out


def gqa_config(config: JobConfig, num_kv_heads: int, include_encoder: bool) -> JobConfig:
    heads = {"num_kv_heads": num_kv_heads}
    if include_encoder:
        heads["encoder_num_kv_heads"] = num_kv_heads
    return config.replace(model=config.model.replace(**heads))


# --- Upcycling: dense FFN -> MoE ---------------------------------------------------------


def upcycle_config(
    config: JobConfig,
    num_experts: int,
    every: int = 1,
    gating: str | None = None,
    init: str = "copy",
) -> JobConfig:
    """The MoE config of an upcycled dense model; one-line errors for impossible requests.
    Copies (`init="copy"`) combine with weights summing to one; random experts keep the
    config's combine rule (weights the router's probabilities, which it learns through)."""
    m = config.model
    if m.moe.num_experts:
        raise ValueError(
            f"the checkpoint is already a mixture of experts (model.moe.num_experts="
            f"{m.moe.num_experts}); upcycling takes a dense checkpoint"
        )
    if num_experts < 2:
        raise ValueError(f"--num_experts={num_experts} must be >= 2")
    layers = m.num_layers
    if every < 1 or every > layers:
        raise ValueError(f"--every={every} must be in [1, model.num_layers={layers}]")
    gate = m.moe.gate
    gate = gate.replace(
        gating=gating or gate.gating,
        top_k=min(gate.top_k, num_experts),
        max_k=min(gate.max_k, num_experts),
    )
    if init == "copy":
        # Combine weights that sum to one for every gate: identical experts then add up to
        # the dense FFN exactly (renormalize covers multi-expert tokens, single_weight the
        # others). Random experts have no function to keep.
        gate = gate.replace(renormalize=True, single_weight="one")
    moe = m.moe.replace(num_experts=num_experts, every=every, ffn_dim=m.ffn_dim, gate=gate)
    config = config.replace(model=m.replace(moe=moe))
    if moe.capacity_factor > 0 and init == "copy":
        log.warning(
            "model.moe.capacity_factor=%s drops tokens: the upcycled model matches the dense "
            "one only where no expert overflows",
            moe.capacity_factor,
        )
    return config


def upcycle_params(
    params: dict, abstract_moe_params: dict, seed: int = 0, init: str = "copy"
) -> dict:
    """MoE parameters from dense ones: expert kernels tiled E times (`init="copy"`), or
    drawn as a fresh MoE layer draws them (`init="random"`: the adaptive-gating paper's MoE
    models from dense ones), and fresh routers.

    abstract_moe_params: the upcycled model's parameter shapes (leaves with .shape). Every
    other parameter must exist in `params` with the same shape.
    """
    if init not in UPCYCLE_INITS:
        raise ValueError(f"--init={init!r} is not one of {' | '.join(UPCYCLE_INITS)}")
    dense = flatten(params)
    base_key = jax.random.key(seed)
    out, used = {}, set()
    for index, (path, leaf) in enumerate(sorted(flatten(abstract_moe_params).items())):
        name = ".".join(path)
        shape = tuple(leaf.shape)
        if path in dense and tuple(dense[path].shape) == shape:
            out[path] = dense[path]
        elif path[-1] in _EXPERT_KERNELS and path in dense:
            source_shape = tuple(dense[path].shape)
            if source_shape != shape[1:]:
                raise CheckpointError(
                    f"{name}: dense FFN kernel of shape {source_shape} cannot become experts "
                    f"of shape {shape}"
                )
            if init == "random":  # the initialiser of MoE layer experts (models/moe/layer.py)
                key = jax.random.fold_in(base_key, index)
                out[path] = fan_in_init((1,))(key, shape, dense[path].dtype)
            else:
                out[path] = jnp.broadcast_to(dense[path], shape)
        elif path[-1] == "router":
            # The initialiser of a fresh MoE router (unit-variance logits for unit-RMS x):
            # with combine weights summing to one it does not change the function.
            key = jax.random.fold_in(base_key, index)
            out[path] = fan_in_init((0,))(key, shape, leaf.dtype)
            continue
        else:
            found = tuple(dense[path].shape) if path in dense else "missing"
            raise CheckpointError(
                f"{name}: the MoE model needs shape {shape}, checkpoint has {found}"
            )
        used.add(path)
    unused = sorted(".".join(p) for p in set(dense) - used)
    if unused:
        raise CheckpointError(f"parameters the MoE model does not use: {', '.join(unused[:4])}")
    return unflatten(out)


# --- Reading and writing checkpoints -----------------------------------------------------


def _restore(src: str):
    """(stored config, params with per-layer paths on the conversion mesh, mesh)."""
    config = read_config(src)
    mesh = make_mesh(_CONVERT_MESH)
    spec = model_spec(unrolled_config(config.model), mesh)
    params = restore_on_mesh(src, spec, mesh, layer_layouts(config.model))
    for path, leaf in flatten(params).items():  # counted on the devices, never gathered
        check_finite(leaf, f"{src}: parameter {'.'.join(path)}")
    return config, params, mesh


def _write(src: str, dst: str, params: dict, config: JobConfig, mesh) -> None:
    """Check params against the model `config` builds, then write DST atomically (with a
    copy of SRC's own tokenizer folder, if it has one and `config` uses it)."""
    # Only parameters are written: uptraining the result starts a fresh optimizer state (a
    # kept T5X Adafactor state would not fit pooled K/V kernels, see configs/uptrain_gqa.py).
    config = config.replace(train=config.train.replace(init_optimizer=False))
    if config.model.scan_layers:  # converters work per layer; a scanned model stores stacks
        params = stack_layers(params, config.model)
    spec = model_spec(config.model, mesh)
    want = flatten(spec.abstract_params)
    got = flatten(params)
    for path, leaf in want.items():
        if path not in got or tuple(got[path].shape) != tuple(leaf.shape):
            found = tuple(got[path].shape) if path in got else "missing"
            raise CheckpointError(f"{'.'.join(path)}: model needs {tuple(leaf.shape)}, got {found}")
    params = jax.device_get(params)  # save_params writes host arrays
    inherited = inherited_tokenizer(config.data.tokenizer, resolve_checkpoint(src))
    if inherited:
        config = config.replace(data=config.data.replace(tokenizer=inherited[1]))
    with staged_directory(dst) as staging:  # DST never holds half a checkpoint
        save_params(str(staging), params, config)
        if inherited:
            shutil.copytree(inherited[0], staging / TOKENIZER_DIR)


def _check_dst(src: str, dst: str) -> None:
    target = refuse_existing(dst)
    if Path(str(resolve_checkpoint(src))).absolute() == target:
        raise CheckpointError(f"{target}: DST is the source checkpoint")


def _check_fits_host(config: JobConfig, num_experts: int) -> None:
    """The upcycled parameters are gathered on the host whole before they are written
    (`_write`): refuse an expert count whose parameters would not fit in its RAM, before
    any is made, instead of a crash (or the OOM killer) after the restore."""
    from jaxmoe.models.spec import abstract_params

    leaves = flatten(abstract_params(unrolled_config(config.model))).values()
    need = sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in leaves)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > host:
        raise ValueError(
            f"--num_experts={num_experts}: the upcycled parameters would take "
            f"{need / 2**30:,.1f} GiB, more than this host's {host / 2**30:,.1f} GiB of RAM"
        )


def convert_gqa(
    src: str,
    dst: str,
    num_kv_heads: int,
    method: str = "mean",
    include_encoder: bool = False,
    seed: int = 0,
) -> JobConfig:
    """Write DST: SRC with KV heads pooled into `num_kv_heads` groups. Returns DST's config."""
    _check_dst(src, dst)
    config = read_config(src)
    check_num_kv_heads(config.model, num_kv_heads, method, include_encoder)
    config, params, mesh = _restore(src)
    new_params = gqa_params(params, config.model, num_kv_heads, method, include_encoder, seed)
    new_config = gqa_config(config, num_kv_heads, include_encoder)
    _write(src, dst, new_params, new_config, mesh)
    return new_config


def convert_upcycle(
    src: str,
    dst: str,
    num_experts: int,
    every: int = 1,
    gating: str | None = None,
    seed: int = 0,
    init: str = "copy",
) -> JobConfig:
    """Write DST: dense SRC with every `every`-th FFN made `num_experts` experts (copies of
    it, or random with `init="random"`)."""
    _check_dst(src, dst)
    new_config = upcycle_config(read_config(src), num_experts, every, gating, init)
    _check_fits_host(new_config, num_experts)
    _, params, mesh = _restore(src)
    moe_spec = model_spec(unrolled_config(new_config.model), mesh)
    new_params = upcycle_params(params, moe_spec.abstract_params, seed, init)
    _write(src, dst, new_params, new_config, mesh)
    return new_config
