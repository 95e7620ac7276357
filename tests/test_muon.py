"""optimizer.name=muon: the update against a numpy reference of the same iteration (momentum,
Nesterov look-ahead, Frobenius normalisation, quintic Newton-Schulz per matrix and per expert,
the RMS-matching scale, decoupled weight decay; AdamW for the rest), which parameters of a
real model are matrices, and what the orthogonalisation of a sharded expert stack gathers.
"""

import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxmoe.config.loading import load_config
from jaxmoe.errors import ConfigError
from jaxmoe.models.spec import model_spec
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.training.muon import dimension_numbers, labels
from jaxmoe.training.optimizer import make_optimizer
from tests.helpers import tiny_config

LR, WD, BETA = 0.02, 0.1, 0.95
B1, B2, EPS = 0.9, 0.95, 1e-8


def leaf(axes, shape):
    return SimpleNamespace(axes=axes, shape=shape)


# A scanned MoE period (2 layers x 3 experts), an attention output projection, an
# embedding and a norm scale.
AXES = {
    "embed": {"embedding": leaf(("vocab", "embed"), (11, 6))},
    "experts": leaf(("layers", "expert", "embed", "expert_mlp"), (2, 3, 6, 4)),
    "out": leaf(("heads", "head_dim", "embed"), (2, 3, 6)),
    "norm": {"scale": leaf(("norm",), (6,))},
}


def numpy_newton_schulz(m):
    """Keller Jordan's quintic iteration on one matrix, in float64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = m.T if m.shape[0] > m.shape[1] else m
    x = x / (np.linalg.norm(x) + 1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if m.shape[0] > m.shape[1] else x


def numpy_muon_direction(buf, g, matrices):
    """The orthogonalised Nesterov look-ahead of one parameter, matrix by matrix:
    `matrices(x)` yields (index, [fan_in, fan_out] matrix) pairs and writes them back."""
    look = g + BETA * buf  # `buf` already holds this step's gradient
    out = np.zeros_like(look)
    for index, to_matrix, from_matrix in matrices(look):
        m = to_matrix(look[index])
        fan_in, fan_out = m.shape
        o = numpy_newton_schulz(m) * 0.2 * np.sqrt(max(fan_in, fan_out))
        out[index] = from_matrix(o)
    return out


def expert_matrices(x):
    for p in range(x.shape[0]):
        for e in range(x.shape[1]):
            yield (p, e), (lambda a: a), (lambda a: a)


def out_matrices(x):
    shape = x.shape
    yield (
        (slice(None),),
        (lambda a: a.reshape(shape[0] * shape[1], shape[2])),
        (lambda a: a.reshape(shape)),
    )


def test_update_matches_numpy_reference():
    cfg = tiny_config(
        "optimizer.name=muon",
        f"optimizer.learning_rate={LR}",
        "optimizer.schedule=constant",
        "optimizer.warmup_steps=0",
        f"optimizer.weight_decay={WD}",
        "optimizer.grad_clip_norm=0",
    )
    optimizer, _ = make_optimizer(cfg.optimizer, 10, AXES)
    rng = np.random.default_rng(0)
    shapes = jax.tree.map(lambda x: x.shape, AXES, is_leaf=lambda x: hasattr(x, "axes"))
    params = jax.tree.map(
        lambda s: rng.normal(size=s).astype(np.float32),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    state = optimizer.init(params)
    ref = jax.tree.map(lambda p: p.astype(np.float64), params)
    buf = {k: np.zeros(ref[k].shape) for k in ("experts", "out")}
    moments = {
        k: [np.zeros(s), np.zeros(s)]
        for k, s in (("embed", shapes["embed"]["embedding"]), ("norm", shapes["norm"]["scale"]))
    }
    update = jax.jit(optimizer.update)
    for t in range(1, 4):
        grads = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
        updates, state = update(grads, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
        # Muon: trace momentum, Nesterov look-ahead, per-matrix Newton-Schulz.
        for key, matrices in (("experts", expert_matrices), ("out", out_matrices)):
            g = grads[key].astype(np.float64)
            buf[key] = BETA * buf[key] + g
            direction = numpy_muon_direction(buf[key], g, matrices)
            ref[key] = ref[key] - LR * (direction + WD * ref[key])
        # AdamW: the embedding decayed, the norm scale not (vectors never are).
        for key, path, decay in (("embed", "embedding", WD), ("norm", "scale", 0.0)):
            g = grads[key][path].astype(np.float64)
            m, v = moments[key]
            m[:] = B1 * m + (1 - B1) * g
            v[:] = B2 * v + (1 - B2) * g * g
            step = (m / (1 - B1**t)) / (np.sqrt(v / (1 - B2**t)) + EPS)
            ref[key][path] = ref[key][path] - LR * (step + decay * ref[key][path])
        for path, got in jax.tree_util.tree_leaves_with_path(params):
            want = ref
            for k in path:
                want = want[k.key]
            np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5, err_msg=str(path))


def test_matrices_of_a_deepseek_model():
    """Which parameters of a scanned MLA + shared/routed-expert model Muon takes, and how."""
    cfg = load_config(
        "configs/deepseek2_16b.py:tiny",
        [
            "model.q_lora_rank=16",
            "model.scan_layers=true",
            "model.moe.router_scoring=sigmoid",
            "model.moe.selection_bias=true",
        ],
    )
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    dims = dimension_numbers(model_spec(cfg.model, mesh).param_axes)
    period = dims["layers"]["period"]["0"]
    as_pairs = lambda d: None if d is None else (tuple(d.reduction_axis), tuple(d.output_axis))
    want = {
        "embed/embedding": None,
        "lm_head": None,
        "final_norm/scale": None,
        "attn_norm/scale": None,
        "attn/q_norm/scale": None,
        "attn/q_down": ((1,), (2,)),  # [layers, D, rq]
        "attn/q_up": ((1,), (2, 3)),  # [layers, rq, H, dn + dr]
        "attn/kv_down": ((1,), (2,)),
        "attn/kv_up": ((1,), (2, 3)),
        "attn/out": ((1, 2), (3,)),  # [layers, H, dv, D]
        "ffn/router": ((1,), (2,)),
        "ffn/selection_bias": None,
        "ffn/shared/wi_0": ((1,), (2,)),
        "ffn/shared/wo": ((1,), (2,)),
        "ffn/wi_0": ((2,), (3,)),  # [layers, experts, D, F]: one matrix per expert
        "ffn/wo": ((2,), (3,)),
    }
    for name, expected in want.items():
        node = dims if "/" not in name or name.split("/")[0] in ("embed", "final_norm") else period
        for key in name.split("/"):
            node = node[key]
        assert as_pairs(node) == expected, name
    head = dims["layers"]["head"]["0"]
    assert as_pairs(head["ffn"]["wi_0"]) == ((0,), (1,))  # the dense first layer [D, F]
    kinds = set(jax.tree.leaves(labels(dims)))
    assert kinds == {"muon", "adamw"}


def test_sharded_experts_are_not_gathered():
    """A [layers, experts, D, F] stack sharded experts x fsdp: the compiled update has no
    all-gather; its collectives are the Gram matrices' all-reduces over fsdp."""
    p, e, d, f = 2, 8, 64, 32
    axes = {"w": leaf(("layers", "expert", "embed", "expert_mlp"), (p, e, d, f))}
    cfg = tiny_config("optimizer.name=muon", "optimizer.grad_clip_norm=0")
    optimizer, _ = make_optimizer(cfg.optimizer, 10, axes)
    mesh = jax.make_mesh((2, 4), ("fsdp", "expert"), axis_types=(AxisType.Auto,) * 2)
    sharding = NamedSharding(mesh, PartitionSpec(None, "expert", "fsdp", None))
    params = {"w": jax.ShapeDtypeStruct((p, e, d, f), jnp.float32, sharding=sharding)}
    state = jax.eval_shape(optimizer.init, params)
    with jax.set_mesh(mesh):
        compiled = jax.jit(optimizer.update).lower(params, state, params).compile()
    hlo = compiled.as_text()
    assert not re.search(r" all-gather(-start)?\(", hlo)
    reduced = set(re.findall(r"= f32\[([\d,]*)\][^\n]* all-reduce(?:-start)?\(", hlo))
    assert f"{p},{e // 4},{f},{f}" in reduced  # each chip's 2 experts' F x F Gram matrices


def test_bad_values_are_one_line_errors():
    for key, value in (("muon_momentum", 1.0), ("muon_ns_steps", 0), ("muon_rms", -1.0)):
        with pytest.raises(ConfigError, match=f"optimizer.{key}"):
            tiny_config("optimizer.name=muon", f"optimizer.{key}={value}")
