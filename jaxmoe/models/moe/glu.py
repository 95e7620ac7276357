"""The experts' gated hidden units h = glu(x wi_0, x wi_1), and GPT-OSS's clamped SwiGLU.

Every dispatch computes an expert's hidden units through `gated_hidden(act, gate, up)`:
act(gate) * up for an elementwise activation (silu, gelu, relu, ...), or act.combine(gate,
up) for an activation that reads both (ClampedSwiGLU). The block dispatch's hand-written
backward differentiates the same function (jax.vjp of gated_hidden).
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp

CLAMPED_SWIGLU = "swiglu_clamped"


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's expert activation (`model.activation=swiglu_clamped`):
    g = min(gate, limit), u = clip(up, -limit, limit), h = (u + 1) * g * sigmoid(alpha g).
    Frozen (hashable): it is a static argument of the compiled dispatch."""

    alpha: float = 1.702
    limit: float = 7.0

    def combine(self, gate, up):
        gate = jnp.minimum(gate, jnp.asarray(self.limit, gate.dtype))
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * jnp.asarray(self.alpha, gate.dtype)))

    def __call__(self, x):
        raise TypeError("swiglu_clamped reads gate and up together: call gated_hidden")


def gated_hidden(act, gate, up):
    """An expert's hidden units from its gate and up projections."""
    combine = getattr(act, "combine", None)
    if combine is not None:
        return combine(gate, up)
    return act(gate) * up


def expert_activation(cfg, elementwise):
    """The MoE experts' activation of model config `cfg`: ClampedSwiGLU for
    `swiglu_clamped`, else `elementwise(cfg.activation)` (layers.activation_fn or its
    ungated gate)."""
    if cfg.activation == CLAMPED_SWIGLU:
        return ClampedSwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit)
    return elementwise(cfg.activation)
