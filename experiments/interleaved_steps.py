"""Train-step times of several trained variants, interleaved in one process.

Variants that train one after another on a shared machine see different load, so their
logged step times are not comparable. Here each variant's final parameters are restored,
its train step is compiled, and the variants then take turns (a few steps each, order
rotated every round) on the same training batches; the median over rounds of each
variant's per-step time, and its ratio to a reference, is what load changes least.
An adaptive model is timed at the routing its trained router makes on these batches.
"""

import os
import time

import numpy as np


def _prepare(config, checkpoint: str, num_batches: int):
    """(compiled step, state, batches) of one variant, restored from `checkpoint`."""
    import jax
    from jax.sharding import NamedSharding

    from jaxmoe.checkpoints.manager import restore_params
    from jaxmoe.data.pipeline import build_data
    from jaxmoe.models.spec import model_spec
    from jaxmoe.models.stack import layer_layouts
    from jaxmoe.parallel.mesh import make_mesh
    from jaxmoe.parallel.sharding import batch_spec
    from jaxmoe.training.evaluator import to_global
    from jaxmoe.training.optimizer import make_optimizer
    from jaxmoe.training.state import init_state, state_shardings
    from jaxmoe.training.steps import jit_train_step, step_fns

    mesh = make_mesh(config.mesh)
    # The batches only need to be real text.
    config = config.replace(data=config.data.replace(curriculum="none", prefetch=0))
    data = build_data(config.data, config.train)
    config = config.replace(model=config.model.with_vocab(data.vocab_size))
    spec = model_spec(config.model, mesh)
    optimizer, schedule = make_optimizer(config.optimizer, config.train.steps, spec.param_axes)
    abstract_state, shardings = state_shardings(mesh, spec, optimizer)
    state = init_state(config.model, config.train.seed, optimizer, shardings, mesh)
    layouts = layer_layouts(config.model)
    state["params"] = restore_params(checkpoint, abstract_state["params"], layouts)
    batch_shardings = {
        key: NamedSharding(mesh, batch_spec(mesh, np.ndim(value), config.train.batch_size))
        for key, value in data.eval_batches[0].items()
    }
    batches = [to_global(next(data.train), batch_shardings) for _ in range(num_batches)]
    if hasattr(data.train, "close"):
        data.train.close()
    fns = step_fns(config.train, config.optimizer, config.model, spec, optimizer, schedule)
    step = jit_train_step(fns, shardings, batch_shardings)
    with jax.set_mesh(mesh):
        compiled = step.lower(state, batches[0]).compile()
    return mesh, compiled, state, batches


def interleaved_step_times(
    runs: dict, reference: str, rounds: int = 6, steps_per_round: int = 4
) -> dict:
    """{name: {median_step_s, step_time_vs_<reference>, top2_share}} plus load averages.

    `runs` maps a variant name to (config, checkpoint path). Each round runs
    `steps_per_round` steps of every variant (the first of each turn untimed: it absorbs
    the switch between programs); the per-step time of a turn is its timed steps' mean.
    """
    import jax

    prepared = {name: _prepare(cfg, path, steps_per_round) for name, (cfg, path) in runs.items()}
    names = list(prepared)
    turns = {name: [] for name in names}
    shares = {name: [] for name in names}
    load_before = os.getloadavg()[0]
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            mesh, compiled, state, batches = prepared[name]
            with jax.set_mesh(mesh):
                state, metrics = compiled(state, batches[0])
                jax.block_until_ready(state)
                start = time.perf_counter()
                for batch in batches[1:]:
                    state, metrics = compiled(state, batch)
                jax.block_until_ready(state)
            turns[name].append((time.perf_counter() - start) / (len(batches) - 1))
            if "top2_fraction" in metrics:
                shares[name].append(float(metrics["top2_fraction"]))
            prepared[name] = (mesh, compiled, state, batches)
    load_after = os.getloadavg()[0]
    medians = {name: float(np.median(turns[name])) for name in names}
    base = medians.get(reference)
    return {
        "rounds": rounds,
        "steps_per_round": steps_per_round,
        "load_average_1min": [load_before, load_after],
        "variants": {
            name: {
                "median_step_s": medians[name],
                "step_time_vs_" + reference: medians[name] / base if base else None,
                "turn_step_s": turns[name],
                "top2_share": float(np.mean(shares[name])) if shares[name] else None,
            }
            for name in names
        },
    }
