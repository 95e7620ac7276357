"""How far the TPU compiler's `optimal_seconds` estimate holds: small programs compiled for v5p.

    python -m benchmarks cost_analysis_probe [--topology v5p-8] [--json]

Each program is compiled ahead of time for one chip of the topology (libtpu's compile-only
devices; no TPU needed) and its `cost_analysis()` read back: FLOPs, bytes accessed and
optimal_seconds, next to the FLOPs counted by hand and their time at the chip's bf16 peak.
Programs: a plain bf16 matmul; the same matmul sharded over 4 chips (an all-reduce
after it); a scanned stack of 1, 4 and 16 layers; a `fori_loop` whose trip count is an
argument; `jax.lax.ragged_dot` over 8 groups; two Pallas kernels (the tiled matmul of
jax's examples, which carries no cost estimate, and megablox's grouped matmul, which
does). docs/tpu_kernels.md reads the numbers.
"""

import argparse
import json
import time

N = 8192  # matmul side: big enough for the estimate to be compute-bound
LAYER = 4096  # one layer of the scanned stack: tanh(x @ w), [LAYER, LAYER]
GROUPS = 8


def _programs(topo):
    """(name, function, argument structs, FLOPs by hand) for each probe."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu import matmul as pallas_matmul
    from jax.experimental.pallas.ops.tpu.megablox import gmm
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxmoe.aot.topologies import topology_devices

    devices = topology_devices(topo)
    one = Mesh(devices[:1], ("x",))
    four = Mesh(devices[:4], ("x",))

    def arg(shape, dtype=jnp.bfloat16, mesh=one, spec=None):
        sharding = NamedSharding(mesh, spec or P())
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    matmul = 2 * N**3
    layer = 2 * LAYER**3

    def stack(x, w):
        return jax.lax.scan(lambda x, w_l: (jnp.tanh(x @ w_l), None), x, w)[0]

    def loop(x, w, trips):
        return jax.lax.fori_loop(0, trips, lambda i, x: jnp.tanh(x @ w), x)

    programs = [
        ("matmul", lambda a, b: a @ b, (arg((N, N)), arg((N, N))), matmul),
        (
            "matmul, K split over 4 chips (all-reduce)",
            lambda a, b: a @ b,
            (arg((N, N), mesh=four, spec=P(None, "x")), arg((N, N), mesh=four, spec=P("x"))),
            matmul / 4,
        ),
    ]
    for layers in (1, 4, 16):
        args = (arg((LAYER, LAYER)), arg((layers, LAYER, LAYER)))
        programs.append((f"scan of {layers} layers", stack, args, layers * layer))
    trips = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(one, P()))
    square = arg((LAYER, LAYER))
    looped = ("fori_loop, traced trip count (per trip)", loop, (square, square, trips), layer)
    programs.append(looped)
    sizes = arg((GROUPS,), jnp.int32)
    experts = arg((GROUPS, N, N // GROUPS))
    grouped = 2 * N * N * (N // GROUPS)  # every row through one group's [N, N / G] weights
    ragged = (arg((N, N)), experts, sizes)
    programs.append(("ragged_dot, 8 groups", jax.lax.ragged_dot, ragged, grouped))
    programs.append(
        (
            "Pallas matmul (no CostEstimate)",
            lambda a, b: pallas_matmul.matmul(a, b, block_shape=(512, 512), block_k=512),
            (arg((N, N)), arg((N, N))),
            matmul,
        )
    )
    programs.append(
        (
            "Pallas megablox gmm, 8 groups (CostEstimate)",
            lambda a, b, g: gmm(a, b, g, jnp.bfloat16, (512, 1024, 1024)),
            (arg((N, N)), experts, sizes),
            grouped,
        )
    )
    return programs


def probe(topology: str = "v5p-8") -> list[dict]:
    """One row per program: the compiler's figures and the hand count."""
    import jax

    from jaxmoe.aot.cost_estimate import count_pallas_calls, count_while_loops
    from jaxmoe.aot.topologies import parse_topology

    topo = parse_topology(topology)
    peak = topo.chip.peak_bf16_flops
    rows = []
    for name, fn, args, flops in _programs(topo):
        started = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        hlo = compiled.as_text()
        seconds = cost.get("optimal_seconds")
        rows.append(
            {
                "program": name,
                "hand_flops": float(flops),
                "peak_s": flops / peak,
                "compiler_flops": cost.get("flops"),
                "bytes_accessed": cost.get("bytes accessed"),
                "optimal_seconds": seconds,
                "optimal_over_peak": seconds / (flops / peak) if seconds else None,
                "while_loops": count_while_loops(hlo),
                "pallas_calls": count_pallas_calls(hlo),
                "compile_s": time.perf_counter() - started,
            }
        )
    return rows


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    head = (
        f"{'program':46} {'hand FLOPs':>10} {'compiler FLOPs':>14} {'at peak':>9} "
        f"{'optimal_s':>10} {'ratio':>6} loops pallas"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['program']:46} {r['hand_flops']:10.3e} {_fmt(r['compiler_flops'], '14.3e')} "
            f"{r['peak_s'] * 1e3:7.3f}ms {_fmt(r['optimal_seconds'], '10.4g')} "
            f"{_fmt(r['optimal_over_peak'], '6.2f')} {r['while_loops']:5d} {r['pallas_calls']:6d}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default="v5p-8")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = parser.parse_args(argv)
    import jax

    from jaxmoe.aot.topologies import parse_topology, quiet_libtpu_env

    quiet_libtpu_env(parse_topology(args.topology))
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_enable_compilation_cache", False)  # compile-only executables
    rows = probe(args.topology)
    print(table(rows))
    if args.json:
        import libtpu

        versions = {"jax": jax.__version__, "libtpu": getattr(libtpu, "__version__", "?")}
        print(json.dumps({"topology": args.topology, **versions, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
