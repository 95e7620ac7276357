"""The scanned layer stack (model.scan_layers) computes what the unrolled stack computes.

The reference is the Python-unrolled model on one device, whose blocks are run one after
another: the same parameters, laid out per layer, must give the scanned model the same loss
(with the MoE balance and z terms) and the same gradients, on one device and on a mesh with
fsdp and expert axes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.config.loading import with_overrides
from jaxmoe.models import build_model
from jaxmoe.models.spec import model_params, model_spec
from jaxmoe.models.stack import layer_layouts, stack_layers, unstack_layers
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.options import MeshOptions
from jaxmoe.parallel.sharding import batch_spec, named
from jaxmoe.training import steps
from tests.helpers import synthetic_batches, tiny_config

# name: config overrides. Interleaved: MoE in layers 1 and 3, dense 0, 2 and a dense tail 4.
# Dense head (DeepSeek's first_k_dense_replace at every=2): layer 1, MoE by the every-2
# pattern, is dense, so layers 0-1 are an unrolled head, then periods (2, 3), (4, 5) and a
# dense tail 6.
CASES = {
    "decoder": ("model.num_layers=3",),
    "interleaved": ("model.num_layers=5", "model.moe.every=2", "model.remat=dots_saveable"),
    "dense_head": (
        "model.num_layers=7",
        "model.moe.every=2",
        "model.moe.first_dense_layers=2",
        "model.remat=full",
    ),
    "t5": (
        "model.arch=encoder_decoder",
        "model.num_layers=3",
        "model.num_encoder_layers=2",
        "model.moe.every=2",
        "model.rope_theta=0.0",
        "model.activation=gelu",
        "model.remat=full",
    ),
}
MESHES = {"one_device": (1, 1, 1), "fsdp_expert": (2, 2, 2)}  # data, fsdp, expert


def configs(case: str, mesh_name: str):
    data, fsdp, expert = MESHES[mesh_name]
    mesh = (f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.expert={expert}")
    unrolled = tiny_config(*CASES[case], *mesh)
    scanned = tiny_config(*CASES[case], *mesh, "model.scan_layers=true")
    return unrolled, scanned


def batch_for(config):
    batch = synthetic_batches(config, 1)[0]
    if config.model.arch == "encoder_decoder":
        rng = np.random.default_rng(1)
        encoder = rng.integers(1, config.model.vocab_size, size=batch["inputs"].shape)
        encoder[:, -3:] = 0  # padding, masked in both attentions
        batch["encoder_inputs"] = encoder.astype(np.int32)
    return batch


def loss_and_grads(config, params, batch):
    """(loss with aux terms, MoE metrics, grads) of the train step's loss on config's mesh."""
    # The in-slice axes only: mesh.dcn_* count slices (dcn_data defaults to -1).
    size = np.prod([getattr(config.mesh, a) for a in ("data", "fsdp", "tensor", "expert")])
    devices = jax.devices()[: int(size)]
    mesh = make_mesh(config.mesh, devices)
    spec = model_spec(config.model, mesh)
    fns = steps.step_fns(
        config.train, config.optimizer, config.model, spec, optimizer=None, schedule=None
    )
    params = jax.device_put(params, named(mesh, spec.param_specs))
    batch_sharding = named(mesh, batch_spec(mesh, 2, config.train.batch_size))
    batch = jax.device_put(batch, batch_sharding)
    total = jnp.sum(batch["weights"])
    rng = jax.random.key(0)

    @jax.jit
    def run(params, batch):
        grad_fn = jax.value_and_grad(steps._loss, has_aux=True)
        return grad_fn(params, batch, total, rng, fns)

    with jax.set_mesh(mesh):
        (loss, extra), grads = run(params, batch)
    return float(loss), jax.device_get(extra), jax.device_get(grads)


def init_params(config):
    """Host copies of the parameters of a fresh model of `config` (seed 0), in its layout."""
    model = build_model(config.model, rngs=nnx.Rngs(params=0, jitter=1))
    return jax.device_get(model_params(model)[1])


HEADS = {"dense_head": 2}  # unrolled leading layers of a case, counted by hand


def hand_stacked(params, name, k, num_layers, head=0):
    """The scanned layout written out by hand: head/i is layer i, row p of period/j is layer
    head + p * k + j, tail/t the layers after the last whole period."""
    periods = (num_layers - head) // k
    layers = params[name]
    out = {
        "period": {
            str(j): jax.tree.map(
                lambda *xs: np.stack(xs), *[layers[str(head + p * k + j)] for p in range(periods)]
            )
            for j in range(k)
        }
    }
    if head:
        out["head"] = {str(i): layers[str(i)] for i in range(head)}
    first_tail = head + periods * k
    if num_layers > first_tail:
        out["tail"] = {str(t): layers[str(first_tail + t)] for t in range(num_layers - first_tail)}
    return out


@functools.cache
def unrolled_reference(case: str):
    """(parameters, batch, (loss, extra, grads)) of `case`'s unrolled model on one device:
    the reference of the scanned model on every mesh, compiled once per case."""
    unrolled_cfg, _ = configs(case, "one_device")
    params = init_params(unrolled_cfg)
    batch = batch_for(unrolled_cfg)
    return params, batch, loss_and_grads(unrolled_cfg, params, batch)


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("case", list(CASES))
def test_scanned_matches_unrolled(case, mesh_name):
    """The scanned model on `mesh_name` against the unrolled one on one device."""
    _, scanned_cfg = configs(case, mesh_name)
    params, batch, (loss_u, extra_u, grads_u) = unrolled_reference(case)
    stacked = stack_layers(params, scanned_cfg.model)
    m = scanned_cfg.model
    k = m.moe.every
    expected_names = (
        {"encoder_layers": m.num_encoder_layers, "decoder_layers": m.num_layers}
        if m.arch == "encoder_decoder"
        else {"layers": m.num_layers}
    )
    for name, n in expected_names.items():
        by_hand = hand_stacked(params, name, k, n, HEADS.get(case, 0))
        jax.tree.map(np.testing.assert_array_equal, stacked[name], by_hand)
    # The scanned model's own parameter tree has exactly this layout and shapes.
    spec = model_spec(
        scanned_cfg.model,
        make_mesh(MeshOptions(data=1, fsdp=1, tensor=1, expert=1), jax.devices()[:1]),
    )
    assert jax.tree.map(np.shape, stacked) == jax.tree.map(lambda a: a.shape, spec.abstract_params)

    loss_s, extra_s, grads_s = loss_and_grads(scanned_cfg, stacked, batch)
    np.testing.assert_allclose(loss_s, loss_u, rtol=1e-5, atol=1e-6)
    for key in ("weighted_balance_loss", "weighted_router_z_loss", "top2_fraction", "routing_BM"):
        np.testing.assert_allclose(extra_s[key], extra_u[key], rtol=1e-5, atol=1e-6)
    assert sorted(extra_s) == sorted(extra_u)
    jax.tree.map(
        lambda s, u: np.testing.assert_allclose(s, u, rtol=1e-5, atol=1e-6),
        grads_s,
        stack_layers(grads_u, scanned_cfg.model),
    )


@pytest.mark.parametrize("case", ["interleaved", "dense_head"])
def test_same_seed_same_model_and_round_trip(case):
    """Blocks are created in the same order from the same streams in both layouts."""
    unrolled_cfg, scanned_cfg = configs(case, "one_device")
    params = init_params(unrolled_cfg)
    scanned = init_params(scanned_cfg)  # built with scan_layers on
    jax.tree.map(np.testing.assert_array_equal, scanned, stack_layers(params, scanned_cfg.model))
    jax.tree.map(np.testing.assert_array_equal, unstack_layers(scanned, scanned_cfg.model), params)


def test_layers_axis_is_never_sharded():
    _, scanned_cfg = configs("decoder", "fsdp_expert")
    mesh = make_mesh(scanned_cfg.mesh, jax.devices())
    spec = model_spec(scanned_cfg.model, mesh)
    router = spec.param_axes["layers"]["period"]["0"]["ffn"]["router"]
    assert router.axes == ("layers", "embed", None)
    assert spec.param_specs["layers"]["period"]["0"]["ffn"]["router"][0] is None


@pytest.mark.parametrize(
    "saved_scanned", [False, True], ids=["old_into_scanned", "scanned_into_old"]
)
def test_checkpoint_restores_into_the_other_layout(tmp_path, saved_scanned):
    """An unrolled checkpoint loads into a scanned model and the other way round."""
    from jaxmoe.checkpoints.manager import restore_params, save_params

    unrolled_cfg, scanned_cfg = configs("interleaved", "one_device")
    params = init_params(unrolled_cfg)
    saved_cfg, load_cfg = (
        (scanned_cfg, unrolled_cfg) if saved_scanned else (unrolled_cfg, scanned_cfg)
    )
    saved = stack_layers(params, saved_cfg.model) if saved_scanned else params
    save_params(str(tmp_path / "ckpt"), saved, saved_cfg)  # the tree as given
    tree_metadata = (tmp_path / "ckpt" / "params" / "_METADATA").read_text()
    assert ('"period"' in tree_metadata) == saved_scanned

    mesh = make_mesh(load_cfg.mesh, jax.devices()[:1])
    spec = model_spec(load_cfg.model, mesh)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        spec.abstract_params,
        named(mesh, spec.param_specs),
    )
    restored = jax.device_get(
        restore_params(str(tmp_path / "ckpt"), abstract, layer_layouts(load_cfg.model))
    )
    expected = stack_layers(params, scanned_cfg.model) if not saved_scanned else params
    jax.tree.map(np.testing.assert_array_equal, restored, expected)


def _restore_unrolled(path, config):
    """A checkpoint's parameters with per-layer paths, whatever layout it was saved in."""
    from jaxmoe.checkpoints.manager import restore_params
    from jaxmoe.config.stored import read_config
    from jaxmoe.models.stack import unrolled_config

    cfg = read_config(path).model
    mesh = make_mesh(config.mesh, jax.devices()[:1])
    spec = model_spec(unrolled_config(cfg), mesh)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        spec.abstract_params,
        named(mesh, spec.param_specs),
    )
    return cfg, jax.device_get(restore_params(path, abstract, layer_layouts(cfg)))


def test_converters_and_export_read_and_write_the_scanned_layout(tmp_path):
    """convert gqa / upcycle and export hf give the same model from either layout, and a
    scanned source gives a scanned (stacked on disk) result."""
    from jaxmoe.checkpoints.manager import save_params
    from jaxmoe.conversions.hf.exporter import export_hf
    from jaxmoe.conversions.surgery import convert_gqa, convert_upcycle

    dense = ("model.moe.num_experts=0", "model.num_kv_heads=4", "model.num_layers=3")
    results = {}
    for layout in ("unrolled", "scanned"):
        config = tiny_config(*dense, "mesh.data=1", f"model.scan_layers={layout == 'scanned'}")
        params = init_params(tiny_config(*dense, "mesh.data=1"))
        root = tmp_path / layout
        stored = stack_layers(params, config.model) if layout == "scanned" else params
        save_params(str(root / "src"), stored, config)
        convert_gqa(str(root / "src"), str(root / "gqa"), num_kv_heads=2)
        convert_upcycle(str(root / "src"), str(root / "moe"), 4, every=2)
        export_hf(str(root / "src"), str(root / "hf"))
        for name in ("gqa", "moe"):
            meta = (root / name / "params" / "_METADATA").read_text()
            assert ('"period"' in meta) == (layout == "scanned"), (layout, name)
            cfg, results[layout, name] = _restore_unrolled(str(root / name), config)
            assert cfg.scan_layers == (layout == "scanned")
        results[layout, "hf"] = (root / "hf" / "model.safetensors").read_bytes()
    for name in ("gqa", "moe"):
        jax.tree.map(
            np.testing.assert_array_equal, results["scanned", name], results["unrolled", name]
        )
    assert results["scanned", "hf"] == results["unrolled", "hf"]


def test_routing_probes_see_every_layer_of_a_scanned_stack():
    """analyze-routing's per-layer gate decisions are the unrolled model's, layer by layer."""
    from jaxmoe.inference.routing_probe import routing_masks

    unrolled_cfg, scanned_cfg = configs("interleaved", "one_device")
    params = init_params(unrolled_cfg)
    batch = batch_for(unrolled_cfg)
    masks = {}
    for cfg, p in ((unrolled_cfg, params), (scanned_cfg, stack_layers(params, scanned_cfg.model))):
        mesh = make_mesh(cfg.mesh, jax.devices()[:1])
        spec = model_spec(cfg.model, mesh)
        masks[cfg.model.scan_layers] = jax.device_get(
            routing_masks(p, batch, spec.graphdef, "eval", spec.rest)
        )
    assert list(masks[True]) == ["layer_1", "layer_3"] == list(masks[False])
    jax.tree.map(np.testing.assert_array_equal, masks[True], masks[False])


def test_remat_takes_a_policy_and_the_old_booleans():
    from jaxmoe.config.stored import complete_stored
    from jaxmoe.errors import ConfigError

    assert tiny_config("model.remat=true").model.remat == "full"
    assert tiny_config("model.remat=false").model.remat == "none"
    assert tiny_config("model.remat=dots_saveable").model.remat == "dots_saveable"
    # A checkpoint written when model.remat was a bool still loads its config.
    assert complete_stored({"model": {"remat": True}}).model.remat == "full"
    with pytest.raises(ConfigError, match=r"model\.remat='everything' is not one of"):
        tiny_config("model.remat=everything")


def test_per_layer_metrics_are_written_in_numeric_layer_order(tmp_path):
    """jit hands metrics back with keys sorted as strings; the writer orders digits as numbers."""
    import json

    from jaxmoe.training.metrics import MetricsWriter

    writer = MetricsWriter(str(tmp_path), total_steps=1, start_step=0, progress=False)
    names = [f"top2_fraction/layer_decoder_{i}" for i in (10, 2, 1, 0)]
    writer.write(1, "train", {name: 0.5 for name in sorted(names)} | {"loss": 1.0})
    writer.close()
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    layer_keys = [key for key in record if key.startswith("top2_fraction/")]
    assert layer_keys == [f"top2_fraction/layer_decoder_{i}" for i in (0, 1, 2, 10)]


@pytest.mark.parametrize("scan", [False, True])
def test_aux_and_routing_vectors_follow_numeric_layer_order(scan):
    """routing_BM's columns (the curriculum's per-layer vectors) are layers 0, 1, ..., 11."""
    config = tiny_config(
        *CASES["t5"], "model.num_layers=12", "model.num_encoder_layers=1", "model.moe.every=1"
    )
    config = config.replace(model=config.model.replace(scan_layers=scan))
    batch = batch_for(config)
    order = []

    def forward(encoder, decoder):  # traced only: the key order is read inside the trace
        model = build_model(config.model, rngs=nnx.Rngs(0))
        _, aux = model(encoder, decoder, train=False)
        order.extend(aux)  # (a dict returned through jax comes back with sorted keys)

    jax.eval_shape(forward, batch["encoder_inputs"], batch["inputs"])
    assert order == ["encoder_0"] + [f"decoder_{i}" for i in range(12)]


def test_train_then_eval_end_to_end_same_losses_as_unrolled(data_cache, tmp_path):
    """`train()` from the same seed gives the same per-step losses in both layouts (AdamW
    and clipping act elementwise / on the global norm), and the scanned checkpoint
    gives the unrolled one's eval loss, read by a model of either layout."""
    import json

    from jaxmoe.inference.evaluate import evaluate
    from jaxmoe.training.loop import train

    examples = tmp_path / "examples.jsonl"
    examples.write_text('{"text": "The quick brown fox."}\n{"text": "Lists are sequences."}\n')
    losses, configs_, evals = {}, {}, {}
    for scan in (False, True):
        config = tiny_config(
            "model.num_layers=3",
            "model.moe.every=2",
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.expert=2",
            "train.steps=3",
            "train.log_every=1",
            "train.checkpoint_every=3",
            "train.eval_every=0",
            "train.eval_batches=1",
            "train.seq_len=32",
            f"data.cache_dir={data_cache}",
            "model.vocab_size=0",
            f"model.scan_layers={scan}",
        )
        workdir = tmp_path / f"scan_{scan}"
        train(config, str(workdir), progress=False)
        lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
        losses[scan] = [r["loss"] for r in lines if r["split"] == "train"]
        configs_[scan] = config
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)
    # Each checkpoint scored by a model of either layout (restore converts the layout).
    for saved in (False, True):
        for scan in (False, True):
            result = evaluate(str(tmp_path / f"scan_{saved}"), f"jsonl:{examples}", configs_[scan])
            evals[saved, scan] = result["loss"]
    for saved in (False, True):  # the same parameters, whichever layout reads them
        assert evals[saved, True] == pytest.approx(evals[saved, False], rel=1e-6)
    # Three Adam steps apart (its first steps amplify rounding differences of the layouts).
    assert evals[True, True] == pytest.approx(evals[False, False], rel=1e-5)


def test_router_jitter_runs_in_the_scan():
    """Each period row holds its own jitter stream (reseeded per step): noise changes the loss."""
    _, scanned_cfg = configs("interleaved", "fsdp_expert")
    params = init_params(scanned_cfg)  # built in the scanned layout
    batch = batch_for(scanned_cfg)
    plain, _, _ = loss_and_grads(scanned_cfg, params, batch)
    scanned_cfg = with_overrides(scanned_cfg, ["model.moe.jitter=0.5"])
    noisy, _, grads = loss_and_grads(scanned_cfg, params, batch)
    assert np.isfinite(noisy) and noisy != plain
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
