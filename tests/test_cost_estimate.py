"""What `jaxmoe compile` relies on in the TPU compiler's `optimal_seconds` (cost_estimate.py).

Programs compiled ahead of time for one v5p chip (libtpu's compile-only devices), each
checked against FLOPs counted by hand: a loop-free matmul's estimate is close to its
FLOPs at the chip's bf16 peak; a scan or a fori_loop with a traced trip count is counted
as one trip; a Pallas kernel without a cost estimate counts for nothing. The step
estimate is given for the first kind only.
"""

import pytest

pytest.importorskip(
    "libtpu", reason="the `tpu` extra is not installed (pip install 'jaxmoe[tpu]'): no libtpu"
)

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmoe.aot.cost_estimate import count_pallas_calls, count_while_loops, step_time_estimate
from jaxmoe.aot.topologies import parse_topology, topology_devices
from tests.helpers import compile_cache_off

N = 4096
V5P_PEAK = 459e12  # bf16 FLOP/s of one v5p chip (Cloud TPU's spec sheet)


@pytest.fixture(scope="module", autouse=True)
def _compile_cache_off():
    with compile_cache_off():
        yield


@pytest.fixture(scope="module")
def compile_one_chip():
    mesh = Mesh(topology_devices(parse_topology("v5p-8"))[:1], ("x",))

    def compile_(fn, *shapes):
        args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P())) for s, d in shapes]
        compiled = jax.jit(fn).lower(*args).compile()
        cost = compiled.cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost), compiled.as_text()

    return compile_


MATRIX = ((N, N), jnp.bfloat16)
ONE_MATMUL = 2 * N**3


def test_loop_free_estimate_is_the_roofline(compile_one_chip):
    cost, hlo = compile_one_chip(lambda a, b: a @ b, MATRIX, MATRIX)
    assert cost["flops"] == ONE_MATMUL
    seconds, note = step_time_estimate(cost, hlo)
    assert note == ""
    # Measured 1.16x at 8192 (docs/tpu_kernels.md): a bound, not a guess.
    assert 1.0 <= seconds / (ONE_MATMUL / V5P_PEAK) < 1.6


def test_loops_are_counted_once(compile_one_chip):
    def stack(x, w):
        return jax.lax.scan(lambda x, w_l: (jnp.tanh(x @ w_l), None), x, w)[0]

    def loop(x, w, trips):
        return jax.lax.fori_loop(0, trips, lambda i, x: jnp.tanh(x @ w), x)

    for fn, shapes in (
        (stack, (MATRIX, ((8, N, N), jnp.bfloat16))),
        (loop, (MATRIX, MATRIX, ((), jnp.int32))),
    ):
        cost, hlo = compile_one_chip(fn, *shapes)
        # 8 layers (or any number of trips) of one matmul each: one matmul's FLOPs.
        assert ONE_MATMUL <= cost["flops"] < 1.01 * ONE_MATMUL
        assert count_while_loops(hlo) == 1
        seconds, note = step_time_estimate(cost, hlo)
        assert seconds is None and "1 while loops" in note


def test_pallas_kernel_counts_for_nothing(compile_one_chip):
    from jax.experimental.pallas.ops.tpu import matmul as pallas_matmul

    def both(a, b):  # one XLA matmul and one Pallas matmul
        return a @ b + pallas_matmul.matmul(a, b, block_shape=(512, 512), block_k=512)

    cost, hlo = compile_one_chip(both, MATRIX, MATRIX)
    assert ONE_MATMUL <= cost["flops"] < 1.01 * ONE_MATMUL  # the kernel's half is missing
    assert count_pallas_calls(hlo) == 1 and count_while_loops(hlo) == 0
    seconds, note = step_time_estimate(cost, hlo)
    assert seconds is None and "1 Pallas kernels" in note


def test_ragged_dot_is_estimated(compile_one_chip):
    """libtpu runs ragged_dot as its own Mosaic kernels, which it does estimate."""
    groups = 8
    cost, hlo = compile_one_chip(
        jax.lax.ragged_dot,
        MATRIX,
        ((groups, N, N // groups), jnp.bfloat16),
        ((groups,), jnp.int32),
    )
    flops = 2 * N * N * (N // groups)  # every row through one group's [N, N / 8]
    assert cost["flops"] == flops and count_pallas_calls(hlo) == 0
    seconds, _ = step_time_estimate(cost, hlo)
    assert 1.0 <= seconds / (flops / V5P_PEAK) < 1.6


def test_an_estimate_that_is_not_a_time_is_said_in_words():
    assert step_time_estimate({"optimal_seconds": -7.998526}, "") == (
        None,
        "the compiler's estimate is not a time (-8 s)",
    )
    assert step_time_estimate({}, "") == (None, "the compiler gave none")
    assert step_time_estimate({"optimal_seconds": 0.25}, "") == (0.25, "")
