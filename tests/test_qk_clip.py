"""optimizer.qk_clip (MuonClip): the per-head largest logit against a numpy loop, the rescaling
rule of GQA and MLA query/key weights against numpy logits (each head's logits scaled by
exactly min(1, tau / S_h)), and a train step that clips an attention whose logits are too
large."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.errors import ConfigError
from jaxmoe.models.attention import head_max_logits
from jaxmoe.models.spec import merge_model, model_spec
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.training.optimizer import make_optimizer
from jaxmoe.training.qk_clip import qk_clip
from jaxmoe.training.state import init_state, state_shardings
from jaxmoe.training.steps import jit_train_step, step_fns
from tests.helpers import tiny_config

TAU = 5.0


def test_head_max_logits_matches_a_loop():
    rng = np.random.default_rng(0)
    b, length, heads, kv_heads, d = 2, 6, 4, 2, 3
    q = rng.normal(size=(b, length, heads, d)).astype(np.float32)
    k = rng.normal(size=(b, length, kv_heads, d)).astype(np.float32)
    mask = np.tril(np.ones((length, length), bool))[None]
    got = np.asarray(head_max_logits(jnp.asarray(q), jnp.asarray(k), jnp.asarray(mask), 0.5))
    want = np.full(heads, -np.inf)
    for h in range(heads):
        for i in range(b):
            for t in range(length):
                for s in range(t + 1):
                    logit = 0.5 * float(q[i, t, h] @ k[i, s, h // (heads // kv_heads)])
                    want[h] = max(want[h], logit)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def numpy_gqa_logits(attn, x):
    """[H, L, L] logits q.k of every head (no rotary: the rule is linear in q and k)."""
    q = np.einsum("ld,dhe->hle", x, attn["query"]) + attn["query_bias"][:, None]
    k = np.einsum("ld,dke->kle", x, attn["key"]) + attn["key_bias"][:, None]
    group = q.shape[0] // k.shape[0]
    return np.stack([q[h] @ k[h // group].T for h in range(q.shape[0])])


def test_gqa_rule_scales_each_head_by_its_factor():
    rng = np.random.default_rng(1)
    d, heads, kv_heads, e = 8, 4, 2, 3
    attn = {
        "query": rng.normal(size=(d, heads, e)),
        "key": rng.normal(size=(d, kv_heads, e)),
        "query_bias": rng.normal(size=(heads, e)),
        "key_bias": rng.normal(size=(kv_heads, e)),
        "value": rng.normal(size=(d, kv_heads, e)),
    }
    attn = {k: v.astype(np.float32) for k, v in attn.items()}
    x = rng.normal(size=(5, d))
    before = numpy_gqa_logits(attn, x)
    max_H = before.max(axis=(1, 2))
    tau = float(np.median(max_H))  # some heads clipped, some not
    params = {"layers": {"0": {"attn": jax.tree.map(jnp.asarray, attn)}}}
    out = qk_clip(params, jnp.asarray(max_H)[None], ((("layers", "0", "attn"), 0),), tau)
    after = numpy_gqa_logits(jax.tree.map(np.asarray, out["layers"]["0"]["attn"]), x)
    gamma = np.minimum(1.0, tau / max_H)
    np.testing.assert_allclose(after, before * gamma[:, None, None], rtol=1e-5, atol=1e-6)
    assert after.max() <= tau * (1 + 1e-5)
    np.testing.assert_array_equal(out["layers"]["0"]["attn"]["value"], attn["value"])


def numpy_mla_logits(attn, x, nope):
    """[H, L, L]: plain dims q_nope . k_nope plus rotary q_rope . k_rope (shared key)."""
    q = np.einsum("lr,rhe->hle", x @ attn["q_down"], attn["q_up"])
    both = x @ attn["kv_down"]
    rank = attn["kv_up"].shape[0]
    k_nope = np.einsum("lr,rhe->hle", both[:, :rank], attn["kv_up"])[..., :nope]
    k_rope = both[:, rank:]
    return np.stack(
        [q[h, :, :nope] @ k_nope[h].T + q[h, :, nope:] @ k_rope.T for h in range(q.shape[0])]
    )


def test_mla_rule_stacked_rows():
    """Kimi K2's MLA rule on a scanned period [P, ...]: row p clipped by its own maxima."""
    rng = np.random.default_rng(2)
    d, rq, r, heads, nope, rope, dv, periods = 8, 6, 5, 3, 4, 2, 3, 2
    attn = {
        "q_down": rng.normal(size=(periods, d, rq)),
        "q_up": rng.normal(size=(periods, rq, heads, nope + rope)),
        "kv_down": rng.normal(size=(periods, d, r + rope)),
        "kv_up": rng.normal(size=(periods, r, heads, nope + dv)),
    }
    attn = {k: v.astype(np.float32) for k, v in attn.items()}
    x = rng.normal(size=(4, d))
    rows = [{k: v[p] for k, v in attn.items()} for p in range(periods)]
    before = [numpy_mla_logits(row, x, nope) for row in rows]
    max_PH = np.stack([b.max(axis=(1, 2)) for b in before])
    tau = float(np.median(max_PH))
    params = {"layers": {"period": {"0": {"attn": jax.tree.map(jnp.asarray, attn)}}}}
    sites = ((("layers", "period", "0", "attn"), (0, 1)),)
    out = qk_clip(params, jnp.asarray(max_PH), sites, tau, nope)["layers"]["period"]["0"]["attn"]
    for p in range(periods):
        row = {k: np.asarray(v[p]) for k, v in out.items()}
        gamma = np.minimum(1.0, tau / max_PH[p])
        after = numpy_mla_logits(row, x, nope)
        np.testing.assert_allclose(after, before[p] * gamma[:, None, None], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(row["kv_down"], attn["kv_down"][p])  # shared rope key
        np.testing.assert_array_equal(row["kv_up"][..., nope:], attn["kv_up"][p][..., nope:])


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_train_step_clips_large_logits(attention):
    extra = ()
    if attention == "mla":
        extra = (
            "model.attention=mla",
            "model.num_kv_heads=4",
            "model.kv_lora_rank=8",
            "model.qk_nope_head_dim=8",
            "model.qk_rope_head_dim=4",
            "model.v_head_dim=8",
            "model.head_dim=12",
        )
    cfg = tiny_config(
        *extra,
        "model.moe.num_experts=0",
        "model.num_layers=1",  # a later layer's logits move with the clipped layer's output
        f"optimizer.qk_clip={TAU}",  # after any optimizer (AdamW here: a smaller compile)
        "optimizer.learning_rate=1e-6",
        "optimizer.schedule=constant",
        "optimizer.warmup_steps=0",
        "mesh.data=1",
    )
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])  # one device: one small compile
    spec = model_spec(cfg.model, mesh)
    optimizer, schedule = make_optimizer(cfg.optimizer, cfg.train.steps, spec.param_axes)
    _, shardings = state_shardings(mesh, spec, optimizer)
    state = init_state(cfg.model, 0, optimizer, shardings, mesh)
    query = "query"
    state["params"]["layers"]["0"]["attn"][query] *= 30.0  # logits far above tau
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, cfg.model.vocab_size, (8, 16)).astype(np.int32)
    batch = {"inputs": inputs, "targets": np.roll(inputs, -1, 1), "weights": np.ones((8, 16))}
    batch["weights"] = batch["weights"].astype(np.float32)

    @jax.jit
    def maxima(params):
        model = merge_model(spec.graphdef, params, spec.rest)
        _, aux = model(jnp.asarray(inputs), max_logits=True)
        return {i: a["attn_max_logit"] for i, a in aux.items()}

    def largest(params):
        return jax.tree.map(np.asarray, maxima(params))

    with jax.set_mesh(mesh):
        before = largest(state["params"])
        step = jit_train_step(
            step_fns(cfg.train, cfg.optimizer, cfg.model, spec, optimizer, schedule),
            shardings,
            None,
        )
        state, metrics = step(state, batch)
        after = largest(state["params"])
    assert before[0].max() > 2 * TAU
    np.testing.assert_allclose(float(metrics["max_attention_logit"]), before[0].max(), rtol=1e-4)
    # Clipped heads land on tau, the others stay where they were.
    np.testing.assert_allclose(after[0], np.minimum(before[0], TAU), rtol=1e-3)


def test_refused_with_qk_norm():
    with pytest.raises(ConfigError, match=r"qk_clip.*qk_norm"):
        tiny_config("optimizer.qk_clip=100", "model.qk_norm=head")
