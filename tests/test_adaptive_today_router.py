"""Adaptive gating on today's routers (issue 27 item 4, issue 28 item 6): `adaptive` and
`adaptive_k` with DeepSeek-V3's sigmoid scores, selection bias, group-limited choice,
norm_topk_prob and routed_scaling_factor, and with DeepSeek-V2's group-limited softmax.

The reference is a per-token numpy loop written from the rule in docs/adaptive_k.md
("Sigmoid and biased routers"): rank by the biased, group-limited selection scores; keep
rank j while the gap to the top-1 on those scores is below the threshold (a plain
difference, except pair-renormalised for softmax without a bias); weigh the kept experts by
their unbiased scores, renormalised over the kept ones, times the scaling factor. Also: the
bias balancing counts only the kept assignments, and a converted tiny DeepSeek-V3 trains
with `adaptive_k` through the CLI.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.cli import main as jaxmoe_main
from jaxmoe.config.stored import read_config
from jaxmoe.conversions.hf.export_config import export_plan
from jaxmoe.models.moe import gates
from jaxmoe.models.moe.layer import MoE
from jaxmoe.models.spec import merge_model
from tests.test_bias_balancing import E, one_step
from tests.test_moe_today import moe_layer, tokens

DEEPSEEK_V3 = (
    "model.moe.router_scoring=sigmoid",
    "model.moe.selection_bias=true",
    "model.moe.n_group=4",
    "model.moe.topk_group=2",
    "model.moe.routed_scaling_factor=2.5",
)
CASES = {
    # gate, its slots, router options
    "v3_adaptive_k_norm": (
        "adaptive_k", 4, (*DEEPSEEK_V3, "model.moe.renormalize=true", "model.moe.max_k=4")
    ),
    "v3_adaptive_raw": ("adaptive", 2, (*DEEPSEEK_V3, "model.moe.renormalize=false")),
    "sigmoid_no_bias": (
        "adaptive_k",
        3,
        ("model.moe.router_scoring=sigmoid", "model.moe.renormalize=true", "model.moe.max_k=3"),
    ),
    "v2_group_softmax": (
        "adaptive_k",
        3,
        ("model.moe.n_group=2", "model.moe.topk_group=1", "model.moe.renormalize=true",
         "model.moe.routed_scaling_factor=1.5", "model.moe.max_k=3"),
    ),
}  # fmt: skip
THRESHOLDS = (0.05, 0.15, 0.3)
MARGIN = 1e-5  # no reference gap this close to a threshold (f32 vs f64 must agree)


def options(overrides) -> dict:
    out = {}
    for item in overrides:
        key, _, value = item.removeprefix("model.moe.").partition("=")
        out[key] = value
    return out


def ref_token(x_D, layer, opts, slots: int, threshold: float):
    """(kept experts in rank order, their weights) for one token, float64."""
    logits = x_D.astype(np.float64) @ np.asarray(layer.router[...], np.float64)
    sigmoid = opts.get("router_scoring") == "sigmoid"
    if sigmoid:
        scores = 1.0 / (1.0 + np.exp(-logits))
    else:
        scores = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    biased = opts.get("selection_bias") == "true"
    select = scores + np.asarray(layer.selection_bias[...], np.float64) if biased else scores
    groups, pick = int(opts.get("n_group", 1)), int(opts.get("topk_group", 1))
    size = E // groups
    allowed = list(range(E))
    if groups > 1:
        group_score = [sum(sorted(select[g * size : (g + 1) * size])[-2:]) for g in range(groups)]
        best = sorted(range(groups), key=lambda g: -group_score[g])[:pick]
        allowed = [e for e in range(E) if e // size in best]
    ranked = sorted(allowed, key=lambda e: -select[e])[:slots]
    top = select[ranked[0]]
    kept = [ranked[0]]
    for e in ranked[1:]:
        gap = top - select[e]
        if not sigmoid and not biased:  # softmax probabilities: the pair renormalised
            gap = gap / (top + select[e])
        assert abs(gap - threshold) > MARGIN, "test data too close to the threshold"
        if gap < threshold:
            kept.append(e)
    weights = scores[kept]
    renormalize = opts.get("renormalize") == "true"
    if renormalize and sigmoid:
        weights = weights / (weights.sum() + 1e-20)
    elif renormalize and len(kept) > 1:  # softmax: a lone expert keeps its probability
        weights = weights / weights.sum()
    return kept, weights * float(opts.get("routed_scaling_factor", 1.0))


def ref_layer(x_TD, layer, opts, slots, threshold):
    """(kept lists, weight lists, outputs [T, D]) of the per-token loop."""
    wi_0, wi_1, wo = (np.asarray(w[...], np.float64) for w in (layer.wi_0, layer.wi_1, layer.wo))
    kept_all, weights_all, y = [], [], np.zeros(x_TD.shape)
    for t, x in enumerate(x_TD.astype(np.float64)):
        kept, weights = ref_token(x, layer, opts, slots, threshold)
        for e, w in zip(kept, weights, strict=True):
            gate = x @ wi_0[e]
            y[t] += w * ((gate / (1 + np.exp(-gate))) * (x @ wi_1[e])) @ wo[e]
        kept_all.append(kept)
        weights_all.append(weights)
    return kept_all, weights_all, y


def make(name, threshold, gating=None):
    case_gating, slots, overrides = CASES[name]
    gating = gating or case_gating
    layer = moe_layer(f"model.moe.gating={gating}", f"model.moe.threshold={threshold}",
                      f"model.moe.top_k={slots}", *overrides)  # fmt: skip
    return layer, options(overrides), slots


def routed(layer, x_BLD):
    _, _, routing = layer.route(jnp.asarray(x_BLD), train=False)
    indices, weights, mask = (np.asarray(a) for a in routing)
    kept = [list(row[m]) for row, m in zip(indices, mask, strict=True)]
    return kept, weights, mask


@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("name", list(CASES))
def test_choices_weights_and_output_match_the_loop(name, threshold):
    layer, opts, slots = make(name, threshold)
    x = tokens(seed=4, batch=2, length=8)
    x_TD = x.reshape(-1, x.shape[-1])
    want_kept, want_weights, want_y = ref_layer(x_TD, layer, opts, slots, threshold)
    kept, weights, mask = routed(layer, x)
    assert kept == want_kept
    for row, m, want in zip(weights, mask, want_weights, strict=True):
        np.testing.assert_allclose(row[m], want, rtol=2e-5, atol=1e-6)
        assert np.all(row[~m] == 0)  # masked slots weigh nothing
    y, aux = layer(jnp.asarray(x), train=False)
    np.testing.assert_allclose(np.asarray(y).reshape(want_y.shape), want_y, rtol=1e-4, atol=1e-5)
    counts = np.bincount([e for row in want_kept for e in row], minlength=E)
    np.testing.assert_array_equal(np.asarray(aux["expert_load"]), counts)
    np.testing.assert_allclose(float(aux["kept_fraction"]), counts.sum() / (len(x_TD) * slots))


def test_thresholds_actually_vary_the_number_of_experts():
    """The thresholds above are not trivial: some tokens keep one expert, some more."""
    x = tokens(seed=4, batch=2, length=8)
    for name in CASES:
        sizes = {len(k) for t in THRESHOLDS for k in routed(make(name, t)[0], x)[0]}
        assert 1 in sizes and max(sizes) > 1, (name, sizes)


@pytest.mark.parametrize("name", list(CASES))
def test_threshold_zero_is_top1(name):
    layer, opts, _ = make(name, 0.0)
    x = tokens(seed=5)
    kept, _, mask = routed(layer, x)
    assert mask[:, 1:].sum() == 0
    top1, _, _ = ref_layer(x.reshape(-1, x.shape[-1]), layer, opts, 1, 1.0)
    assert kept == top1


@pytest.mark.parametrize("name", list(CASES))
def test_threshold_above_every_gap_is_the_original_top_k(name):
    """A threshold above every possible gap (100: scores lie in [0, 1], biases near 0) keeps
    every slot: the non-adaptive top-k layer's numbers, exactly."""
    layer, _, slots = make(name, 100.0)
    fixed, _, _ = make(name, 0.1, gating="topk")
    nnx.update(fixed, nnx.state(layer))
    x = jnp.asarray(tokens(seed=6))
    _, _, adaptive = layer.route(x, train=False)
    _, _, topk = fixed.route(x, train=False)
    assert bool(jnp.all(adaptive.mask)) and adaptive.mask.shape[-1] == slots
    for a, b in zip(adaptive, topk, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(
        np.asarray(layer(x, train=False)[0]), np.asarray(fixed(x, train=False)[0])
    )


def test_top_p_still_refused_on_biased_routers():
    with pytest.raises(ValueError, match=r"model.moe.gating='top_p'.*need a top-k gate"):
        moe_layer("model.moe.gating=top_p", *DEEPSEEK_V3)


def test_gate_threshold_must_be_non_negative():
    with pytest.raises(ValueError, match=r"model.moe.threshold=-0.1 must be >= 0"):
        gates.GateOptions(threshold=-0.1)


# ---------------------------------------------------------------------------------------
# Auxiliary-loss-free balancing counts the kept assignments only.


def router_inputs(spec, params, batch, monkeypatch) -> list[np.ndarray]:
    """Each MoE layer's input [T, D], in layer order, in a plain forward of the model."""
    model = merge_model(spec.graphdef, jax.tree.map(jnp.asarray, params))
    seen, call = [], MoE.__call__

    def record(self, x_BLD, *args, **kwargs):
        seen.append(np.asarray(x_BLD).reshape(-1, x_BLD.shape[-1]))
        return call(self, x_BLD, *args, **kwargs)

    monkeypatch.setattr(MoE, "__call__", record)
    model(jnp.asarray(batch["inputs"]), train=True)
    monkeypatch.undo()
    return seen


def test_bias_balancing_counts_only_kept_assignments(monkeypatch):
    rate, threshold = 0.01, 0.05
    gate = ("model.moe.gating=adaptive_k", "model.moe.max_k=2", f"model.moe.threshold={threshold}")
    _, spec, before, after, batch = one_step(rate, *gate)
    inputs = router_inputs(spec, before["params"], batch, monkeypatch)
    opts = options(("model.moe.router_scoring=sigmoid", "model.moe.selection_bias=true"))
    model = merge_model(spec.graphdef, jax.tree.map(jnp.asarray, before["params"]))
    for i, x_TD in enumerate(inputs):
        layer = model.layers[i].ffn
        kept = [ref_token(x, layer, opts, 2, threshold)[0] for x in x_TD]
        load = np.bincount([e for row in kept for e in row], minlength=E).astype(np.float64)
        assert len(x_TD) < load.sum() < 2 * len(x_TD)  # some tokens dropped their second
        old = before["params"]["layers"][str(i)]["ffn"]["selection_bias"]
        want = old + np.float32(rate) * np.sign(load.mean() - load).astype(np.float32)
        got = after["params"]["layers"][str(i)]["ffn"]["selection_bias"]
        np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------
# End to end: a transformers DeepSeek-V3 checkpoint, `jaxmoe convert hf`, `jaxmoe train`.


@pytest.mark.slow  # about 50 s on the shared CPU: a conversion, a compile, three steps
def test_converted_deepseek_v3_trains_with_adaptive_k(tmp_path, capsys):
    """transformers' tiny DeepSeek-V3 (sigmoid, bias, 4 groups pick 2) with a word-level
    tokenizer.json, `jaxmoe convert hf --config.model.moe.gating=adaptive_k`, then `jaxmoe
    train` from it (configs/uptrain_gqa.py: the converted model, its tokenizer)."""
    from tests.test_bad_training import bare_tokenizer_json
    from tests.test_hf_deepseek import build

    src, text = tmp_path / "hf", tmp_path / "text"
    bare_tokenizer_json(src, ["<pad>", "</s>"])  # 5 ids, inside the model's 64
    build("v3_low_rank_q_yarn").save_pretrained(src, safe_serialization=True)
    gate = ["--config.model.moe.gating=adaptive_k", "--config.model.moe.max_k=2",
            "--config.model.moe.threshold=0.05",
            "--config.model.moe.bias_update_rate=0.001"]  # fmt: skip
    assert jaxmoe_main(["convert", "hf", str(src), str(tmp_path / "ckpt"), *gate]) == 0
    # DeepSeek's own router is top-k: export refuses the adaptive gate, evaluates by top-k.
    m = read_config(str(tmp_path / "ckpt")).model
    refusal = r"model.moe.gating='adaptive_k': DeepSeek routes"
    with pytest.raises(CheckpointError, match=refusal) as e:
        export_plan(m)
    assert "\n" not in str(e.value)
    m = m.replace(moe=m.moe.replace(eval_gating="topk"))
    assert export_plan(m)[0]["num_experts_per_tok"] == 2
    rng = np.random.default_rng(0)
    text.mkdir()
    for i in range(8):
        (text / f"{i}.txt").write_text(" ".join(rng.choice(["hello", "world"], 400)) + "\n")
    train = ["train", "--config", f"configs/uptrain_gqa.py:{tmp_path / 'ckpt'}",
             "--workdir", str(tmp_path / "run"), "--config.uptrain.original_steps=3",
             "--config.uptrain.alpha=1.0", "--config.uptrain.original_schedule_steps=100",
             f"--config.data.source=text:{text}/*.txt", "--config.data.validation_fraction=0.25",
             f"--config.data.cache_dir={tmp_path / 'cache'}", "--config.train.batch_size=8",
             "--config.train.seq_len=16", "--config.train.eval_every=0",
             "--config.train.log_every=1", "--config.train.checkpoint_every=0"]  # fmt: skip
    assert jaxmoe_main(train) == 0, capsys.readouterr().err[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    rows = [r for r in rows if r.get("split") == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in rows)
    kept = [r["kept_fraction"] for r in rows]
    print("share of assignments kept per step:", [round(k, 3) for k in kept])
    assert all(0.5 < k < 1.0 for k in kept)
    # max_k = 2: the share of the two slots kept is (1 + share of two-expert tokens) / 2.
    np.testing.assert_allclose(kept, [(1 + r["top2_fraction"]) / 2 for r in rows], rtol=1e-6)
