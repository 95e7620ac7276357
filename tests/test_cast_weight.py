"""layers.cast_weight: the f32 -> bf16 weight cast done with integer ops (models/layers.py).

References: ml_dtypes' numpy bfloat16 conversion (round to nearest, ties to even) for the
bits, hand-computed derivatives, and the TPU compiler's output for what the cast is for (a
layer scan whose weights are not copied to bf16 all at once). The TPU part needs libtpu.
"""

import importlib.util

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxmoe.models.layers import cast_weight
from tests.helpers import compile_cache_off


def _bits16(a) -> np.ndarray:
    return np.asarray(a).view(np.uint16)


def test_bits_match_round_to_nearest_even():
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            rng.standard_normal(4096).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 4096),
            # Halfway cases: the dropped 16 bits are exactly 0x8000 (odd and even kept bits).
            np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F807FFF, 0x3F808001], np.uint32).view(
                np.float32
            ),
            np.array([0.0, -0.0, np.inf, -np.inf, 3.4028235e38, -3.4028235e38], np.float32),
            np.array([1e-40, -1e-40, 1.4e-45], np.float32),  # subnormals
        ]
    )
    got = jax.jit(lambda w: cast_weight(w, jnp.bfloat16))(values)
    assert got.dtype == jnp.bfloat16
    want = values.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(_bits16(got), _bits16(want))


def test_nan_stays_nan_never_inf():
    # A NaN whose payload sits only in the dropped bits would round up to inf.
    nans = np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0x7FFFFFFF], np.uint32).view(np.float32)
    got = np.asarray(cast_weight(jnp.asarray(nans), jnp.bfloat16)).astype(np.float32)
    assert np.isnan(got).all()


def test_other_dtypes_are_a_plain_cast():
    w = jnp.arange(6, dtype=jnp.float32).reshape(2, 3) / 7
    np.testing.assert_array_equal(np.asarray(cast_weight(w, jnp.float32)), np.asarray(w))
    half = np.asarray(cast_weight(w, jnp.float16))
    np.testing.assert_array_equal(half, np.asarray(w).astype(np.float16))


def test_derivatives_are_those_of_a_cast():
    w = jnp.array([0.3, -1.7, 2.5e3], jnp.float32)
    c = jnp.array([2.0, -0.5, 0.25], jnp.float32)
    # d/dw sum(bf16(w) * c) = c (the cast's derivative is 1), as f32.
    grad = jax.grad(lambda w: jnp.sum(cast_weight(w, jnp.bfloat16).astype(jnp.float32) * c))(w)
    assert grad.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(grad), [2.0, -0.5, 0.25])
    # Forward mode: the tangent is cast like the value.
    t = jnp.array([1.0, 3.0, -0.1], jnp.float32)
    _, tangent = jax.jvp(lambda w: cast_weight(w, jnp.bfloat16), (w,), (t,))
    assert tangent.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        _bits16(tangent), _bits16(np.asarray(t).astype(ml_dtypes.bfloat16))
    )


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu")
def test_tpu_layer_scan_keeps_no_bf16_copy_of_the_stack():
    """A remat scan over 8 stacked f32 weights: with `astype` the TPU compiler makes one bf16
    copy of the whole stack before the loop (bf16 propagation); cast_weight converts one
    layer's slice per step, and needs no more temporary memory."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxmoe.aot.topologies import parse_topology, topology_devices

    mesh = Mesh(topology_devices(parse_topology("v5p-8"))[:1], ("x",))
    replicated = NamedSharding(mesh, PartitionSpec())
    w = jax.ShapeDtypeStruct((8, 512, 512), jnp.float32, sharding=replicated)
    x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16, sharding=replicated)

    def compiled(cast):
        def loss(w, x):
            def layer(h, w_layer):
                return jnp.tanh(h @ cast(w_layer)), None

            h, _ = jax.lax.scan(jax.checkpoint(layer), x, w)
            return jnp.sum(h.astype(jnp.float32))

        return jax.jit(jax.grad(loss)).lower(w, x).compile()

    with compile_cache_off():  # compile-only TPU executables: the cache cannot load them
        plain = compiled(lambda a: a.astype(jnp.bfloat16))
        fenced = compiled(lambda a: cast_weight(a, jnp.bfloat16))
    whole_stack = "bf16[8,512,512]"
    assert whole_stack in plain.as_text()  # what the compiler does with a plain cast
    assert whole_stack not in fenced.as_text()
    plain_temp = plain.memory_analysis().temp_size_in_bytes
    assert fenced.memory_analysis().temp_size_in_bytes <= plain_temp
