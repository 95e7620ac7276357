"""LoRA adapters (Hu et al. 2021) beside the weights they adapt (`train.lora`).

An adapted weight W of a module (`query`, `wo`, ...) gets two parameters beside it:
`<name>_lora_a` A [*lead, *in, r] and `<name>_lora_b` B [*lead, r, *out], where `in` are
W's input axes (those a projection contracts), `out` its output axes and `lead` its
leading axes that are not products (an MoE layer's `expert` axis: one adapter per expert;
a scanned stack's `layers` axis). A and B carry W's logical axis names on the axes they
share with it (the rank axis has none), so they are sharded like W: expert adapters over
the expert axis. The adapted weight is W + (alpha / r) A B. A starts as PEFT's (uniform in
+-1/sqrt(fan_in)), B at zero: the model starts as its base.

How the forward pass uses them, without ever writing a merged checkpoint:
- dense projections (attention, MLA, dense and shared-expert FFNs): x W + s (drop(x) A) B,
  two thin products beside the base one (layers.lora_project); `train.lora.dropout` drops the
  adapter's input in training, as PEFT does;
- expert stacks and the router: the weight W + s A B is formed per layer in the compute
  dtype (layers.adapted_weight) and handed to the unchanged dispatch, exchange and gate code.
  The input of an expert's adapter cannot be dropped apart from its base product then
  (PEFT refuses lora_dropout on its expert parameters for the same reason).

Targets (`train.lora.targets`): a comma list of parameter groups (models/param_groups.py:
attention, dense_ffn, experts, shared_experts, router) and/or glob patterns matched against
the per-layer path of a weight (`layers/3/attn/query`, `*/ffn/wo`) or its name (`query`).
Only the matrices of ADAPTED_INPUTS can be adapted; MTP modules are not.
"""

import fnmatch
import hashlib
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.models.layers import LORA_A, LORA_B, dropout_module

# The weights an adapter can sit beside, with the number of input axes a projection
# contracts (after any leading expert / layers axes).
ADAPTED_INPUTS = {
    "query": 1, "key": 1, "value": 1, "out": 2,  # attention (GQA and MLA)
    "q_down": 1, "q_up": 1, "kv_down": 1, "kv_up": 1,  # MLA
    "wi": 1, "wi_0": 1, "wi_1": 1, "wo": 1,  # dense FFNs and expert stacks
    "router": 1,
}  # fmt: skip
_LEAD_AXES = ("layers", "expert")
ADAPTABLE_GROUPS = ("attention", "dense_ffn", "experts", "shared_experts", "router")
# Groups whose adapters are merged into the weight in the forward pass (no separate input).
MERGED_GROUPS = ("experts", "router")


def is_adapter(path) -> bool:
    """Whether the parameter at `path` (a tuple of keys, or its last key) is an adapter."""
    name = str(path[-1] if isinstance(path, tuple) else path)
    return name.endswith(LORA_A) or name.endswith(LORA_B)


def adapted_name(path) -> str:
    """The weight an adapter leaf adapts (`query` for `query_lora_a`)."""
    name = str(path[-1])
    return name.removesuffix(LORA_A).removesuffix(LORA_B)


def _matches(target: str, group: str, path: str, name: str) -> bool:
    if target in ADAPTABLE_GROUPS:
        return group == target
    return fnmatch.fnmatchcase(path, target) or fnmatch.fnmatchcase(name, target)


def _pa_uniform(fan_in: int):
    """PEFT's lora_A init, kaiming_uniform(a=sqrt(5)): uniform in +-1/sqrt(fan_in)."""
    bound = 1.0 / math.sqrt(fan_in)
    return lambda key, shape: jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def attach_adapters(block: nnx.Module, lora, rngs: nnx.Rngs, prefix: str) -> int:
    """Adds the adapters of `lora.targets` to the weights of one decoder block, in place;
    `lora` is the train.lora section (training/lora_options.py), `prefix` the block's
    per-layer path (`layers/3`). Returns how many weights got one. Called when the block
    is built, before a scanned stack stacks its layers."""
    from jaxmoe.models.moe.layer import MoE

    modules = [
        (tuple(str(p) for p in path), node)
        for path, node in nnx.iter_graph(block)
        if isinstance(node, nnx.Module)
    ]  # listed before any is changed
    count = 0
    for parts, module in modules:
        for name, contract in ADAPTED_INPUTS.items():
            weight = getattr(module, name, None)
            if not isinstance(weight, nnx.Param):
                continue
            group = _group(block, parts, name, MoE)
            where = "/".join((prefix, *parts, name))
            if not any(_matches(t, group, where, name) for t in lora.target_list()):
                continue
            if lora.dropout and group in MERGED_GROUPS:
                raise ValueError(
                    f"train.lora.dropout={lora.dropout}: {where} ({group}) is adapted by "
                    "adding to the weight, so its input cannot be dropped alone; set "
                    "train.lora.dropout=0 or leave it out of train.lora.targets"
                )
            _add_adapter(module, name, weight, contract, lora, rngs, where)
            count += 1
        if any(hasattr(module, n + LORA_A) for n in ADAPTED_INPUTS):
            module.lora_scale = lora.scale  # type: ignore[attr-defined]
            if lora.dropout and not hasattr(module, "lora_dropout"):
                module.lora_dropout = dropout_module(lora.dropout, rngs, False)  # type: ignore[attr-defined]
    return count


def check_some_adapted(stack, lora) -> None:
    """ValueError when `lora.targets` gave no weight of the layer stack an adapter."""
    for path, _ in nnx.iter_graph(stack):
        if path and str(path[-1]).endswith(LORA_A):
            return
    raise ValueError(
        f"train.lora.targets={lora.targets!r} matches no weight of the model (groups: "
        f"{' | '.join(ADAPTABLE_GROUPS)}; patterns match per-layer paths such as "
        f"layers/0/attn/query or names such as wo)"
    )


def _group(block, parts: tuple[str, ...], name: str, moe_class) -> str:
    """The param_groups group of weight `name` of the module at `parts` inside `block`."""
    node = block
    for part in parts:
        if isinstance(node, moe_class):
            return "shared_experts" if part in ("shared", "shared_gate") else "experts"
        node = node[int(part)] if part.isdigit() else getattr(node, part)
        if part in ("attn", "self_attn", "cross_attn"):
            return "attention"
    if isinstance(node, moe_class):
        return "router" if name == "router" else "experts"
    return "dense_ffn"


def _add_adapter(module, name, weight, contract, lora, rngs, where) -> None:
    axes = weight.get_metadata().get("axes") or (None,) * weight.ndim
    shape = tuple(weight.shape)
    lead = 0
    while lead < len(axes) and axes[lead] in _LEAD_AXES:
        lead += 1
    ins, outs = shape[lead : lead + contract], shape[lead + contract :]
    a_shape = (*shape[:lead], *ins, lora.rank)
    b_shape = (*shape[:lead], lora.rank, *outs)
    a_axes = (*axes[:lead], *axes[lead : lead + contract], None)
    b_axes = (*axes[:lead], None, *axes[lead + contract :])
    # One key per weight from its path: the adapters do not depend on the traversal order.
    salt = int.from_bytes(hashlib.sha256(where.encode()).digest()[:4], "little")
    key = jax.random.fold_in(rngs.lora(), salt)
    a = _pa_uniform(math.prod(ins))(key, a_shape)
    setattr(module, name + LORA_A, nnx.Param(a, axes=a_axes))
    setattr(module, name + LORA_B, nnx.Param(jnp.zeros(b_shape, jnp.float32), axes=b_axes))


def merged_params(params: dict, scale: float) -> dict:
    """A params tree with every adapter folded into its weight (W + scale A B, in f32) and
    the adapter leaves removed: what `jaxmoe merge` writes."""
    out = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out[key] = merged_params(value, scale)
        elif not is_adapter((key,)):
            if key + LORA_A not in params:
                out[key] = value
                continue
            a, b = params[key + LORA_A], params[key + LORA_B]
            contract = ADAPTED_INPUTS[key]
            lead = a.ndim - contract - 1
            a2 = a.reshape(*a.shape[:lead], -1, a.shape[-1]).astype(jnp.float32)
            b2 = b.reshape(*b.shape[: lead + 1], -1).astype(jnp.float32)
            delta = jnp.matmul(a2, b2, precision=jax.lax.Precision.HIGHEST).reshape(value.shape)
            out[key] = (value.astype(jnp.float32) + scale * delta).astype(value.dtype)
    return out
