"""`convert t5x` on a Switch-layout T5X MoE checkpoint, checked against numpy.

No T5X MoE checkpoint ships with the fixtures, so the test writes a tiny one in the layout
Flaxformer's MoE architecture gives (T5X legacy format: msgpack index + one gzip zarr
TensorStore array per parameter, as in ../shared/fixtures/t5x/tiny_t5): encoder and decoder
of 4 layers with Switch's "every other layer" MIXED placement (sparse layers 1 and 3),
router `mlp/router/router_weights/w/kernel [D, E]` (+ `w/bias [E]` when used), stacked
experts `mlp/expert/.../kernel [E, ...]`. Two variants, as Flaxformer's Switch gin configs
define them: Switch XXL (gated-GELU FFNs `wi_0`/`wi_1`, untied `decoder/logits_dense`) and
Switch Base / Large / C (ReLU FFNs `wi`, output tied to the token embedding and scaled by
1/sqrt(D)). The reference is a float64 numpy forward pass written from Flaxformer's
definitions (T5 layer norm, relative-position buckets, unscaled attention, top-1
"tokens choose" routing whose router probability scales the chosen expert's output),
with no capacity limit (the converted model is dropless).
"""

import json
from pathlib import Path

import flax.serialization
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore
from flax import nnx

from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.checkpoints.trees import flatten
from jaxmoe.conversions.t5x.convert import convert_t5x
from jaxmoe.models import build_model
from jaxmoe.training.loop import train
from jaxmoe.training.steps import forward
from tests.test_t5x_recipe import tiny_uptrain

V, D, H, DH, F, E, FE, LAYERS, BUCKETS, MAX_DISTANCE = 64, 8, 2, 4, 12, 4, 6, 4, 32, 128
SPARSE = (1, 3)  # Flaxformer MIXED with 2 sparse layers of 4: i % 2 == 1


def write_t5x_tensorstore(path: Path, arrays: dict[str, np.ndarray], step: int) -> Path:
    """A legacy T5X checkpoint directory: `checkpoint` (msgpack) whose parameter leaves are
    TensorStore zarr specs of gzip-compressed arrays `target.<name with dots>/` beside it."""
    target: dict = {}
    for name, value in arrays.items():
        directory = "target." + name.replace("/", ".")
        store = tensorstore.open(
            {
                "driver": "zarr",
                "kvstore": {"driver": "file", "path": str(path / directory)},
                "metadata": {
                    "shape": list(value.shape),
                    "chunks": list(value.shape),
                    "dtype": "<f4",
                    "compressor": {"id": "gzip", "level": 1},
                },
            },
            create=True,
        ).result()
        store.write(value.astype(np.float32)).result()
        *parents, leaf = name.split("/")
        node = target
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = {
            "driver": "zarr",
            "dtype": "float32",
            "kvstore": {"driver": "gfile", "path": directory + "/"},
            "metadata": {
                "chunks": list(value.shape),
                "compressor": {"id": "gzip", "level": 1},
                "shape": list(value.shape),
            },
        }
    tree = {"version": 3, "optimizer": {"target": target, "state": {"step": np.int32(step)}}}
    (path / "checkpoint").write_bytes(flax.serialization.msgpack_serialize(tree))
    return path


def switch_arrays(
    seed: int = 0, router_bias: bool = False, base: bool = False, vocab: int = V
) -> dict[str, np.ndarray]:
    """T5X names -> arrays of a tiny Switch-layout model: XXL-style (gated GELU, untied
    logits), or with `base` Switch Base-style (ReLU `wi`, logits tied to the embedding)."""
    rng = np.random.default_rng(seed)
    ffn_in = ("wi",) if base else ("wi_0", "wi_1")

    def w(*shape, fan_in):
        return rng.normal(size=shape) / np.sqrt(fan_in)

    a = {
        "token_embedder/embedding": rng.normal(size=(vocab, D)),
        "encoder/encoder_norm/scale": 1 + 0.1 * rng.normal(size=D),
        "decoder/decoder_norm/scale": 1 + 0.1 * rng.normal(size=D),
    }
    for stack in ("encoder", "decoder"):
        a[f"{stack}/relpos_bias/rel_embedding"] = rng.normal(size=(H, BUCKETS))
        attentions = (
            ["attention"] if stack == "encoder" else ["self_attention", "encoder_decoder_attention"]
        )
        norms = (
            ["pre_attention_layer_norm", "pre_mlp_layer_norm"]
            if stack == "encoder"
            else [
                "pre_self_attention_layer_norm",
                "pre_cross_attention_layer_norm",
                "pre_mlp_layer_norm",
            ]
        )
        for i in range(LAYERS):
            layer = f"{stack}/layers_{i}"
            for norm in norms:
                a[f"{layer}/{norm}/scale"] = 1 + 0.1 * rng.normal(size=D)
            for att in attentions:
                for proj in ("query", "key", "value"):
                    a[f"{layer}/{att}/{proj}/kernel"] = w(D, H * DH, fan_in=D)
                a[f"{layer}/{att}/out/kernel"] = w(H * DH, D, fan_in=H * DH)
            if i in SPARSE:
                # A router 3x Flaxformer's init scale: decisive, still varied, routing.
                a[f"{layer}/mlp/router/router_weights/w/kernel"] = w(D, E, fan_in=D) * 3
                if router_bias:
                    a[f"{layer}/mlp/router/router_weights/w/bias"] = rng.normal(size=E)
                for name in ffn_in:
                    a[f"{layer}/mlp/expert/{name}/kernel"] = w(E, D, FE, fan_in=D)
                a[f"{layer}/mlp/expert/wo/kernel"] = w(E, FE, D, fan_in=FE)
            else:
                for name in ffn_in:
                    a[f"{layer}/mlp/{name}/kernel"] = w(D, F, fan_in=D)
                a[f"{layer}/mlp/wo/kernel"] = w(F, D, fan_in=F)
    if not base:
        a["decoder/logits_dense/kernel"] = w(D, vocab, fan_in=D)
    return {name: value.astype(np.float32) for name, value in a.items()}


# ---------------------------------------------------------------------------------------
# Independent reference: Flaxformer's encoder-decoder in float64 numpy, one example at a time.


def _norm(x, scale):  # T5LayerNorm: no mean subtraction, no bias
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def _gelu(x):  # flax's nn.gelu default (tanh approximation)
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _bucket(relative: np.ndarray, bidirectional: bool) -> np.ndarray:
    """Flaxformer's RelativePositionBiases._relative_position_bucket (memory - query)."""
    n, num_buckets, out = -relative, BUCKETS, np.zeros(relative.shape, np.int64)
    if bidirectional:
        num_buckets //= 2
        out += (n < 0) * num_buckets
        n = np.abs(n)
    else:
        n = np.maximum(n, 0)
    max_exact = num_buckets // 2
    with np.errstate(divide="ignore"):
        log = np.log(n.astype(np.float32) / max_exact + np.finfo(np.float32).eps)
    large = max_exact + (log / np.log(MAX_DISTANCE / max_exact) * (num_buckets - max_exact)).astype(
        np.int64
    )
    return out + np.where(n < max_exact, n, np.minimum(large, num_buckets - 1))


def _relpos(a, stack, q_len, k_len, bidirectional):
    rel = np.arange(k_len)[None, :] - np.arange(q_len)[:, None]
    return a[f"{stack}/relpos_bias/rel_embedding"][:, _bucket(rel, bidirectional)]  # [H, q, k]


def _attention(a, prefix, x, kv, bias, key_ok):
    """Flaxformer's MultiHeadDotProductAttention for T5 (no 1/sqrt(dh): folded in the init)."""
    q = (x @ a[f"{prefix}/query/kernel"]).reshape(len(x), H, DH)
    k = (kv @ a[f"{prefix}/key/kernel"]).reshape(len(kv), H, DH)
    v = (kv @ a[f"{prefix}/value/kernel"]).reshape(len(kv), H, DH)
    logits = np.einsum("qhd,khd->hqk", q, k) + bias
    logits = np.where(key_ok[None], logits, -1e10)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v).reshape(len(x), H * DH) @ a[f"{prefix}/out/kernel"]


def _mlp(a, layer, x, routes):
    """Dense MlpBlock (gated GELU `wi_0`/`wi_1`, or ReLU `wi`), or the MoeLayer when the
    layer has a router: top-1 expert by router probability, its output times that
    probability (no capacity limit)."""

    def ffn(prefix, h, e=None):
        def k(name):
            kernel = a[f"{prefix}/{name}/kernel"]
            return kernel if e is None else kernel[e]

        if f"{prefix}/wi/kernel" in a:  # activations = ('relu',)
            return np.maximum(h @ k("wi"), 0.0) @ k("wo")
        return (_gelu(h @ k("wi_0")) * (h @ k("wi_1"))) @ k("wo")  # ('gelu', 'linear')

    router = f"{layer}/mlp/router/router_weights/w/kernel"
    if router not in a:
        return ffn(f"{layer}/mlp", x)
    logits = x @ a[router] + a.get(f"{layer}/mlp/router/router_weights/w/bias", 0.0)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t, p in enumerate(probs):
        e = int(np.argmax(p))
        routes.append((e, np.sort(p)[-1] - np.sort(p)[-2]))
        out[t] = p[e] * ffn(f"{layer}/mlp/expert", x[t], e)
    return out


def reference_logits(a, encoder_tokens, decoder_inputs, routes):
    a = {k: v.astype(np.float64) for k, v in a.items()}
    emb = a["token_embedder/embedding"]
    ok = encoder_tokens != 0
    x = emb[encoder_tokens]
    bias = _relpos(a, "encoder", len(x), len(x), True)
    for i in range(LAYERS):
        layer = f"encoder/layers_{i}"
        h = _norm(x, a[f"{layer}/pre_attention_layer_norm/scale"])
        x = x + _attention(a, f"{layer}/attention", h, h, bias, ok[None, :])
        x = x + _mlp(a, layer, _norm(x, a[f"{layer}/pre_mlp_layer_norm/scale"]), routes)
    encoded = _norm(x, a["encoder/encoder_norm/scale"])
    y = emb[decoder_inputs]
    n = len(y)
    bias = _relpos(a, "decoder", n, n, False)
    causal = np.tril(np.ones((n, n), bool))
    for i in range(LAYERS):
        layer = f"decoder/layers_{i}"
        h = _norm(y, a[f"{layer}/pre_self_attention_layer_norm/scale"])
        y = y + _attention(a, f"{layer}/self_attention", h, h, bias, causal)
        h = _norm(y, a[f"{layer}/pre_cross_attention_layer_norm/scale"])
        y = y + _attention(a, f"{layer}/encoder_decoder_attention", h, encoded, 0.0, ok[None, :])
        y = y + _mlp(a, layer, _norm(y, a[f"{layer}/pre_mlp_layer_norm/scale"]), routes)
    y = _norm(y, a["decoder/decoder_norm/scale"])
    if "decoder/logits_dense/kernel" in a:
        return y @ a["decoder/logits_dense/kernel"]
    return y @ emb.T / np.sqrt(D)  # tied: Flaxformer's Decoder divides by sqrt(D)


# ---------------------------------------------------------------------------------------


def _batch(seed=1, b=3, s=20, l=11):
    rng = np.random.default_rng(seed)
    encoder = rng.integers(1, V, size=(b, s)).astype(np.int32)
    encoder[0, 14:] = 0  # a padded example
    decoder = rng.integers(1, V, size=(b, l)).astype(np.int32)
    decoder[:, 0] = 0  # decoder inputs start with 0, T5's start token
    return encoder, decoder


def _converted_logits(dst, config, encoder, decoder, **moe):
    model_cfg = config.model.replace(moe=config.model.moe.replace(**moe))
    graphdef, _, rest = nnx.split(build_model(model_cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(dst / "params")
    batch = {"encoder_inputs": encoder, "inputs": decoder}
    logits, aux = jax.jit(lambda p: forward(graphdef, p, batch, train=False, rest=rest))(params)
    return np.asarray(logits), aux


@pytest.mark.parametrize(
    "router_bias, base",
    [(False, False), (True, False), (False, True)],
    ids=["xxl", "xxl_router_bias", "base_relu_tied"],
)
def test_switch_checkpoint_converts_to_moe_layers_matching_numpy(tmp_path, router_bias, base):
    arrays = switch_arrays(router_bias=router_bias, base=base)
    src = write_t5x_tensorstore(tmp_path / "checkpoint_7000", arrays, step=7000)
    dst = tmp_path / "switch"
    config = convert_t5x(src, dst)
    m = config.model
    assert (m.moe.num_experts, m.moe.every, m.moe.ffn_dim, m.ffn_dim) == (E, 2, FE, F)
    assert m.moe.router_bias is router_bias and m.moe.gate.gating == "top1"
    assert (m.ffn_gated, m.tie_embeddings, m.activation) == (
        (False, True, "relu") if base else (True, False, "gelu")
    )
    assert (m.num_layers, m.num_encoder_layers, config.extra["source"]["step"]) == (
        LAYERS,
        LAYERS,
        7000,
    )
    stored = json.loads((dst / "config" / "config.json").read_text())
    assert stored["model"]["moe"]["num_experts"] == E

    encoder, decoder = _batch()
    got, aux = _converted_logits(dst, config, encoder, decoder)
    # The MoE layers are exactly Flaxformer's sparse ones, in both stacks.
    assert sorted(aux) == sorted(f"{s}_{i}" for s in ("encoder", "decoder") for i in SPARSE)
    routes: list = []
    want = np.stack(
        [reference_logits(arrays, encoder[r], decoder[r], routes) for r in range(len(encoder))]
    )
    # Non-degenerate routing: every expert used, and no near-tie an f32 rounding could flip.
    assert {e for e, _ in routes} == set(range(E))
    assert min(margin for _, margin in routes) > 1e-5
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=5e-5)
    assert np.abs(want).max() > 1.0  # the logits are not all tiny


def test_regating_with_adaptive_threshold_zero_is_switch_top1(tmp_path):
    """Re-gating the converted model: adaptive with threshold 0 keeps one expert per token,
    weighted by its probability: Switch's top-1 output exactly; a positive threshold adds
    second experts and changes it."""
    src = write_t5x_tensorstore(tmp_path / "checkpoint_1", switch_arrays(seed=3), step=1)
    config = convert_t5x(src, tmp_path / "switch")
    encoder, decoder = _batch(seed=4)
    top1, _ = _converted_logits(tmp_path / "switch", config, encoder, decoder)
    same, aux = _converted_logits(
        tmp_path / "switch", config, encoder, decoder, gating="adaptive", threshold=0.0
    )
    # Equal up to f32 summation order: the dispatch sizes its blocks from the rows per expert
    # (tokens x slots / experts), so the one-slot and two-slot gates tile the products apart.
    np.testing.assert_allclose(same, top1, rtol=1e-5, atol=1e-5)
    assert all(float(v["top2_fraction"]) == 0.0 for v in aux.values())
    wider, aux = _converted_logits(
        tmp_path / "switch", config, encoder, decoder, gating="adaptive", threshold=0.5
    )
    assert any(float(v["top2_fraction"]) > 0.0 for v in aux.values())
    assert not np.allclose(wider, top1, atol=1e-4)


@pytest.mark.slow  # ~40 s of CPU; 166 s wall on the loaded shared host
def test_regated_switch_base_uptrains_with_the_adaptive_gate(data_cache, tmp_path):
    """The path the converter is for: a Switch Base-style checkpoint converted re-gated to
    the adaptive gate, then uptrained by configs/uptrain_gqa.py (T5X's recipe continued
    from the source step: 0.05 x 40 = 2 steps) on the embedded corpus."""
    arrays = switch_arrays(seed=5, base=True, vocab=640)  # >= 512 + 100 sentinels
    src = write_t5x_tensorstore(tmp_path / "checkpoint_40", arrays, step=40)
    dst = tmp_path / "switch"
    convert_t5x(src, dst, overrides=["model.moe.gating=adaptive", "model.moe.threshold=0.3"])
    config = tiny_uptrain(dst, data_cache)
    assert (config.train.steps, config.optimizer.start_step) == (2, 40)
    assert config.model.moe.gate.gating == "adaptive" and not config.model.ffn_gated
    train(config, str(tmp_path / "run"), progress=False)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines if '"top2_fraction"' in line]
    assert steps and all(0 < s["top2_fraction"] < 1 and s["balance_loss"] > 0 for s in steps)
    with ocp.StandardCheckpointer() as checkpointer:
        before = flatten(checkpointer.restore(dst / "params"))
        after = flatten(checkpointer.restore(tmp_path / "run" / "checkpoints" / "2" / "params"))
    router = ("encoder_layers", "1", "ffn", "router")
    assert not np.array_equal(before[router], after[router])
    assert all(np.isfinite(value).all() for value in after.values())


def _with_mlp(arrays, layer, source):
    """`arrays` with the FFN of `layer` replaced by a copy of the FFN of `source`."""
    out = {k: v for k, v in arrays.items() if not k.startswith(f"{layer}/mlp/")}
    mlp = {k: v for k, v in arrays.items() if k.startswith(f"{source}/mlp/")}
    return out | {k.replace(source, layer): v for k, v in mlp.items()}


def _bad_cases():
    base = switch_arrays()
    e1 = "encoder/layers_1/mlp"
    # Gated dense layers with ReLU experts: jaxmoe has one FFN form per model.
    relu = {
        k.replace("expert/wi_0", "expert/wi"): v for k, v in base.items() if "expert/wi_1" not in k
    }
    # Sparse encoder layers 0 and 1 (Flaxformer's BOTTOM layout).
    bottom = _with_mlp(base, "encoder/layers_0", "encoder/layers_1")
    bottom = _with_mlp(bottom, "encoder/layers_3", "encoder/layers_2")
    decoder_dense = _with_mlp(base, "decoder/layers_1", "decoder/layers_0")
    decoder_dense = _with_mlp(decoder_dense, "decoder/layers_3", "decoder/layers_0")
    return [
        (
            "mixed_gating",
            relu,
            "encoder/layers_1/mlp/expert is ungated (wi) but encoder/layers_0/mlp is gated",
        ),
        (
            "extra_mlp",
            {**base, f"{e1.rsplit('/', 1)[0]}/extra_mlp/wi_0/kernel": np.zeros((D, F), "f4")},
            "encoder/layers_1/extra_mlp/wi_0/kernel is ST-MoE's extra dense MLP",
        ),
        ("bottom", bottom, "encoder MoE layers [0, 1] of 4 are not every k-th layer"),
        ("decoder_dense", decoder_dense, "the encoder has MoE layers [1, 3] but the decoder"),
    ]


@pytest.mark.parametrize("name, arrays, message", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_unsupported_moe_checkpoints_fail_in_one_line(tmp_path, name, arrays, message):
    src = write_t5x_tensorstore(tmp_path / "checkpoint_0", arrays, step=0)
    dst = tmp_path / "out"
    with pytest.raises(CheckpointError) as error:
        convert_t5x(src, dst)
    assert message in str(error.value), str(error.value)
    assert str(src) in str(error.value) and "\n" not in str(error.value)
    assert not dst.exists()
