"""The TPU compiler's estimated run time of a program (`cost_analysis()["optimal_seconds"]`)
and when `jaxmoe compile` may report it as the step time.

Measured with libtpu 0.0.42.1 for v5p (the numbers are in docs/tpu_kernels.md;
the probe is in docs/results/retired_benchmarks.md):
- a loop-free program: optimal_seconds is 1.16x a bf16 matmul's FLOPs at the chip's peak
  (1.55x with an all-reduce after it; `jax.lax.ragged_dot`, which libtpu runs as its own
  kernels, 1.16x too);
- a `while` loop (every `lax.scan`, `fori_loop`, `lax.map`; static or traced trip count):
  the body's FLOPs and time are counted once, whatever the trip count;
- a Pallas (Mosaic) kernel counts as no time without a `CostEstimate`, and with one
  (megablox) the whole program's optimal_seconds turns negative (-6).
So the estimate is the step time only for a program with neither: a scanned layer stack,
the query-chunked attention, the ragged expert exchange and the Pallas kernels each make
it meaningless, and the report says which.
"""

import re

PALLAS_TARGET = 'custom_call_target="tpu_custom_call"'


def count_while_loops(hlo_text: str) -> int:
    """`while` ops in a compiled HLO module (each once: nested loops are not multiplied)."""
    return sum(1 for line in hlo_text.splitlines() if re.search(r" = .* while\(", line))


def pallas_kernels(hlo_text: str) -> dict[str, int]:
    """Mosaic (Pallas TPU) kernel calls in a compiled HLO module by name (gmm, tgmm,
    splash_mha_fwd_residuals, ...), less libtpu's own `ragged-dot` kernels (the compiler
    estimates those)."""
    counts: dict[str, int] = {}
    for line in hlo_text.splitlines():
        if PALLAS_TARGET not in line:
            continue
        name = re.match(r"\s*(?:ROOT )?%([\w.-]+)", line)
        base = re.sub(r"\.\d+$", "", name.group(1)) if name else "?"
        if not base.startswith("ragged-dot"):
            counts[base] = counts.get(base, 0) + 1
    return counts


def count_pallas_calls(hlo_text: str) -> int:
    """Pallas kernel calls in a compiled HLO module (pallas_kernels, all names)."""
    return sum(pallas_kernels(hlo_text).values())


def step_time_estimate(cost: dict, hlo_text: str) -> tuple[float | None, str]:
    """(optimal_seconds, "") when the compiler's estimate is the program's run time, else
    (None, why not)."""
    seconds = cost.get("optimal_seconds")
    loops, kernels = count_while_loops(hlo_text), count_pallas_calls(hlo_text)
    reasons = []
    if loops:
        reasons.append(f"{loops} while loops (the compiler counts a loop body once)")
    if kernels:
        reasons.append(f"{kernels} Pallas kernels (no time estimate for them)")
    if seconds is None:
        reasons.append("the compiler gave none")
    elif seconds <= 0:  # e.g. megablox's kernels make it negative (the module doc)
        reasons.append(f"the compiler's estimate is not a time ({seconds:.3g} s)")
    if reasons:
        return None, "; ".join(reasons)
    return float(seconds), ""
