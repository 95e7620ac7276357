"""T5X MoE checkpoints (Flaxformer's `MoeLayer`: Switch Transformer, token-choice MoE) read
as jaxmoe MoE layers. Used by convert.py; the layout facts are in docs/t5x_moe.md.

Flaxformer names the parameters of a sparse layer i of a stack (encoder or decoder):
  <stack>/layers_<i>/mlp/router/router_weights/w/kernel   [D, E]     router (DenseGeneral `w`)
  <stack>/layers_<i>/mlp/router/router_weights/w/bias     [E]        only with use_bias
  <stack>/layers_<i>/mlp/expert/{wi_0,wi_1}/kernel        [E, D, F]  experts (an MlpBlock
  <stack>/layers_<i>/mlp/expert/wo/kernel                 [E, F, D]  vmapped: expert axis 0)
(`mlp/expert/wi/kernel` instead of wi_0 / wi_1 for ReLU experts, Switch Base / Large / C).
Dense layers keep `mlp/wi_0` ... (or `mlp/wi`) as in T5. In the MIXED layout of the
released configs, layer i of n is sparse iff i % k == k - 1 with k = n / (number of sparse
layers): layers 1, 3, 5, ... for Switch's "every other layer". jaxmoe's `moe.every = k`
places MoE layers by the same rule (models/ffn.is_moe_layer): the layers map one to one.
"""

import re

from jaxmoe.checkpoints.manager import CheckpointError

ROUTER = "mlp/router/router_weights/w/kernel"
ROUTER_BIAS = "mlp/router/router_weights/w/bias"
EXPERT_KERNELS = ("wi_0", "wi_1", "wi", "wo")
_ROUTER_NAME = re.compile(rf"(encoder|decoder)/layers_(\d+)/{ROUTER}")
_EXTRA_MLP = re.compile(r"(encoder|decoder)/layers_\d+/(extra_mlp|pre_extra_mlp_layer_norm)/")


def t5x_moe_name(stack: str, index: str, param: str) -> str | None:
    """The T5X name of MoE parameter `param` (router, router_bias, wi_0, wi_1, wo) of layer
    `index` of `stack` ("encoder" | "decoder"), or None for another parameter."""
    layer = f"{stack}/layers_{index}"
    if param == "router":
        return f"{layer}/{ROUTER}"
    if param == "router_bias":
        return f"{layer}/{ROUTER_BIAS}"
    if param in EXPERT_KERNELS:
        return f"{layer}/mlp/expert/{param}/kernel"
    return None


def _period(stack: str, sparse: list[int], num_layers: int, src) -> int:
    """k such that exactly the layers i % k == k - 1 are sparse (Flaxformer's MIXED)."""
    if num_layers % len(sparse) == 0:
        k = num_layers // len(sparse)
        if sparse == [i for i in range(num_layers) if i % k == k - 1]:
            return k
    raise CheckpointError(
        f"{src}: {stack} MoE layers {sparse} of {num_layers} are not every k-th layer "
        "(Flaxformer's MIXED layout, layers k-1, 2k-1, ...), the only placement jaxmoe's "
        "model.moe.every can express"
    )


def infer_moe(table, src, num_layers: dict[str, int]) -> dict:
    """`model.moe.*` values of a T5X checkpoint: {"num_experts": 0} for a dense one, else
    experts, expert width, `every` and `router_bias` read off the router / expert tensors."""
    names = table.names()
    for name in names:
        if _EXTRA_MLP.match(name):
            raise CheckpointError(
                f"{src}: {name} is ST-MoE's extra dense MLP after a sparse layer (extra_mlp), "
                "which jaxmoe's T5 blocks do not have"
            )
    sparse: dict[str, list[int]] = {"encoder": [], "decoder": []}
    for name in names:
        if match := _ROUTER_NAME.fullmatch(name):
            sparse[match.group(1)].append(int(match.group(2)))
    if not any(sparse.values()):
        return {"num_experts": 0}
    periods = {}
    for stack, layers in sparse.items():
        if not layers:
            other = "decoder" if stack == "encoder" else "encoder"
            raise CheckpointError(
                f"{src}: the {other} has MoE layers {sorted(sparse[other])} but the {stack} has "
                "none; jaxmoe's model.moe.every applies to both stacks"
            )
        periods[stack] = _period(stack, sorted(layers), num_layers[stack], src)
    if periods["encoder"] != periods["decoder"]:
        raise CheckpointError(
            f"{src}: MoE every {periods['encoder']} encoder layers but every "
            f"{periods['decoder']} decoder layers; jaxmoe's model.moe.every is one number"
        )
    first = f"encoder/layers_{periods['encoder'] - 1}"
    router = f"{first}/{ROUTER}"
    router_shape = table.shape(router)
    if len(router_shape) != 2:
        raise CheckpointError(f"{src}: {router} has shape {list(router_shape)}, expected [D, E]")
    expert = f"{first}/mlp/expert/wi_0/kernel"
    if expert not in table:
        expert = f"{first}/mlp/expert/wi/kernel"  # ungated (ReLU) experts
    if expert not in table:
        raise CheckpointError(
            f"{src}: missing parameter {first}/mlp/expert/wi_0/kernel (or wi/kernel; needed "
            "for model.moe.ffn_dim)"
        )
    expert_shape = table.shape(expert)
    if len(expert_shape) != 3:
        raise CheckpointError(
            f"{src}: {expert} has shape {list(expert_shape)}, expected [experts, D, F]"
        )
    return {
        "num_experts": int(router_shape[1]),
        "every": periods["encoder"],
        "ffn_dim": int(expert_shape[2]),
        "router_bias": f"{first}/{ROUTER_BIAS}" in table,
    }


# The model.moe options of Flaxformer's Switch configs that map to jaxmoe: top-1 routing
# weighted by the router probability, balance loss 0.01, no router z-loss, no jitter.
# Capacity stays off (dropless): Flaxformer's capacity counts per group of up to 4096-8192
# tokens across the batch, jaxmoe's per sequence (docs/t5x_moe.md).
SWITCH_RECIPE = {
    "gating": "top1",
    "eval_gating": "",
    "single_weight": "prob",
    "renormalize": False,
    "balance_loss_weight": 0.01,
    "balance_fractions": "auto",
    "z_loss_weight": 0.0,
    "jitter": 0.0,
    "capacity_factor": 0.0,
}
