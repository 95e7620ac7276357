"""`convert t5x` on T5X's own tiny T5.1.1 checkpoint, checked against Hugging Face.

Reference: `transformers`' T5ForConditionalGeneration (PyTorch) loaded with the fixture's
arrays through a T5X -> HF name map written here by hand, independent of the converter.
Bad checkpoints are small legacy msgpack files written with flax's serializer in tmp_path.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import flax.serialization
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.cli import build_parser
from jaxmoe.config.stored import read_config
from jaxmoe.conversions.t5x.convert import convert_t5x
from jaxmoe.conversions.t5x.reader import open_t5x
from jaxmoe.inference.evaluate import evaluate

FIXTURES = Path(os.environ.get("JAXMOE_T5X_FIXTURES", "/work/shared/fixtures/t5x"))
TINY = FIXTURES / "test_t5_tiny.checkpoint_0"
if not TINY.exists():
    pytest.skip(f"T5X fixture not found at {TINY}", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
VOCAB, LAYERS = 32128, 2
# (encoder length, target length): unequal, spanning several relative-position buckets.
LENGTHS = [(5, 3), (12, 9), (20, 17), (33, 40), (1, 1)]


@pytest.fixture(scope="module")
def t5x_arrays():
    checkpoint = open_t5x(TINY)
    return {name: checkpoint.read(name) for name in checkpoint.names()}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    dst = tmp_path_factory.mktemp("converted") / "t5_tiny"
    config = convert_t5x(TINY, dst)
    return dst, config


@pytest.fixture(scope="module")
def examples_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    examples = [
        {
            "inputs": rng.integers(1, VOCAB, n).tolist(),
            "targets": rng.integers(1, VOCAB, m).tolist(),
        }
        for n, m in LENGTHS
    ]
    path = tmp_path_factory.mktemp("data") / "examples.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return path, examples


def hugging_face_t5(arrays):
    """HF T5 v1.1 with the fixture's weights, mapped by hand (HF kernels are [out, in])."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB,
        d_model=8,
        d_kv=3,
        num_heads=4,
        d_ff=16,
        num_layers=LAYERS,
        num_decoder_layers=LAYERS,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        dropout_rate=0.0,
        layer_norm_epsilon=1e-6,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        decoder_start_token_id=0,
    )
    model = T5ForConditionalGeneration(config).eval()

    def t(name, transpose=True):
        value = torch.from_numpy(np.ascontiguousarray(arrays[name], dtype=np.float32))
        return value.T.contiguous() if transpose else value

    state = {"shared.weight": t("token_embedder/embedding", transpose=False)}
    blocks = {
        "encoder": [("SelfAttention", "attention", "pre_attention_layer_norm")],
        "decoder": [
            ("SelfAttention", "self_attention", "pre_self_attention_layer_norm"),
            ("EncDecAttention", "encoder_decoder_attention", "pre_cross_attention_layer_norm"),
        ],
    }
    for stack, attentions in blocks.items():
        # HF keeps the stack's one relative-bias table in layer 0, as [buckets, heads].
        bias = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        state[bias] = t(f"{stack}/relpos_bias/rel_embedding")
        state[f"{stack}.final_layer_norm.weight"] = t(f"{stack}/{stack}_norm/scale", False)
        for i in range(LAYERS):
            src, dst = f"{stack}/layers_{i}", f"{stack}.block.{i}.layer"
            for j, (hf_name, t5x_name, norm) in enumerate(attentions):
                for hf_proj, t5x_proj in zip("qkvo", ("query", "key", "value", "out"), strict=True):
                    state[f"{dst}.{j}.{hf_name}.{hf_proj}.weight"] = t(
                        f"{src}/{t5x_name}/{t5x_proj}/kernel"
                    )
                state[f"{dst}.{j}.layer_norm.weight"] = t(f"{src}/{norm}/scale", False)
            j = len(attentions)
            for w in ("wi_0", "wi_1", "wo"):
                state[f"{dst}.{j}.DenseReluDense.{w}.weight"] = t(f"{src}/mlp/{w}/kernel")
            state[f"{dst}.{j}.layer_norm.weight"] = t(f"{src}/pre_mlp_layer_norm/scale", False)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected
    # transformers 5 ties lm_head to the input embedding even for T5 v1.1; give it its own.
    tied = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"}
    assert set(missing) == tied
    model.lm_head.weight = torch.nn.Parameter(t("decoder/logits_dense/kernel"))
    assert model.lm_head.weight is not model.shared.weight
    return model


@pytest.fixture(scope="module")
def hf_losses(t5x_arrays, examples_file):
    """Per-example mean cross-entropy over the targets; HF shifts `labels` right with 0."""
    import torch

    model = hugging_face_t5(t5x_arrays)
    losses = []
    with torch.no_grad():
        for example in examples_file[1]:
            out = model(
                input_ids=torch.tensor([example["inputs"]]),
                labels=torch.tensor([example["targets"]]),
            )
            losses.append(float(out.loss))
    return np.array(losses)


def per_example(result):
    return np.array([r["loss"] for r in result["per_example"]])


def test_inferred_config(converted):
    dst, config = converted
    m = read_config(str(dst)).model
    assert m == config.model
    expected = dict(
        arch="encoder_decoder", vocab_size=VOCAB, d_model=8, num_layers=2,
        num_encoder_layers=2, num_heads=4, num_kv_heads=4, head_dim=3, ffn_dim=16,
        activation="gelu", rope_theta=0.0, norm_eps=1e-6, tie_embeddings=False,
        relpos_buckets=32, relpos_max_distance=128,
    )  # fmt: skip
    assert {key: getattr(m, key) for key in expected} == expected
    assert m.moe.num_experts == 0


def test_parameters_land_where_t5x_had_them(converted, t5x_arrays):
    """A few tensors restored from DST against the T5X arrays, reshaped by hand."""
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(converted[0] / "params")
    cross = params["decoder_layers"]["1"]["cross_attn"]
    layer = "decoder/layers_1/encoder_decoder_attention"
    np.testing.assert_array_equal(cross["out"], t5x_arrays[f"{layer}/out/kernel"].reshape(4, 3, 8))
    np.testing.assert_array_equal(cross["key"], t5x_arrays[f"{layer}/key/kernel"].reshape(8, 4, 3))
    np.testing.assert_array_equal(params["lm_head"], t5x_arrays["decoder/logits_dense/kernel"])
    np.testing.assert_array_equal(
        params["encoder_relpos"]["rel_embedding"], t5x_arrays["encoder/relpos_bias/rel_embedding"]
    )


def test_eval_losses_match_hugging_face(converted, examples_file, hf_losses):
    result = evaluate(str(converted[0]), f"jsonl:{examples_file[0]}", per_example=True)
    np.testing.assert_allclose(per_example(result), hf_losses, rtol=0, atol=1e-4)
    counts = [r["num_tokens"] for r in result["per_example"]]
    assert counts == [m for _, m in LENGTHS]


def test_sharded_eval_matches_one_device_cli(converted, examples_file, hf_losses):
    """Restored onto data=2 x tensor=4 (heads, FFN and vocabulary split 4 ways) in process,
    and by `jaxmoe eval` in a 1-device process that reads the config from the checkpoint."""
    sharded = evaluate(
        str(converted[0]),
        f"jsonl:{examples_file[0]}",
        per_example=True,
        overrides=["mesh.data=2", "mesh.tensor=4"],
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    command = [sys.executable, "-m", "jaxmoe", "eval", "--checkpoint", str(converted[0])]
    command += ["--data", f"jsonl:{examples_file[0]}", "--per_example"]
    out = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=True
    )
    one_device = json.loads(out.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(per_example(sharded), per_example(one_device), atol=1e-5)
    np.testing.assert_allclose(per_example(sharded), hf_losses, atol=1e-4)


def test_bfloat16_conversion_through_the_command_line(
    tmp_path, t5x_arrays, examples_file, hf_losses, capsys
):
    dst = tmp_path / "bf16"
    args = build_parser().parse_args(["convert", "t5x", str(TINY), str(dst), "--dtype", "bfloat16"])
    args.overrides = ["--config.train.batch_size=8"]
    assert args.run(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["heads"] == [4, 4, 3] and summary["dtype"] == "bfloat16"
    assert read_config(str(dst)).train.batch_size == 8
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(dst / "params")
    embedding = params["token_embed"]["embedding"]
    assert embedding.dtype == ml_dtypes.bfloat16
    expected = t5x_arrays["token_embedder/embedding"].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(embedding, expected)
    # Restored as float32 for evaluation: bf16 weights move the losses by well under 1%.
    result = evaluate(str(dst), f"jsonl:{examples_file[0]}", per_example=True)
    np.testing.assert_allclose(per_example(result), hf_losses, rtol=1e-2)


# --- Bad checkpoints ------------------------------------------------------------------


def write_legacy(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    """A legacy T5X msgpack checkpoint (`checkpoint_0/checkpoint`) holding `arrays`."""
    target: dict = {}
    for name, value in arrays.items():
        *parents, leaf = name.split("/")
        node = target
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    tree = {"version": 3, "optimizer": {"target": target, "state": {"step": np.int64(0)}}}
    path.mkdir(parents=True)
    (path / "checkpoint").write_bytes(flax.serialization.msgpack_serialize(tree))
    return path


def variant(arrays, drop=(), **replace):
    """A copy of `arrays` without `drop`, with `replace` (names given with '__' for '/')."""
    out = {k: v for k, v in arrays.items() if k not in drop}
    out.update({k.replace("__", "/"): v for k, v in replace.items()})
    return out


WO = "decoder/layers_1/mlp/wo/kernel"
CROSS_V = "decoder/layers_1/encoder_decoder_attention/value/kernel"


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda a: variant(a, decoder__layers_0__mlp__extra__kernel=np.zeros((8, 8), "f4")),
            "unknown parameter decoder/layers_0/mlp/extra/kernel [8, 8]",
        ),
        (
            lambda a: variant(a, drop=[CROSS_V]),
            f"missing parameter {CROSS_V}: jaxmoe decoder_layers/1/cross_attn/value needs [8, 12]",
        ),
        (
            lambda a: variant(a, decoder__layers_1__mlp__wo__kernel=np.zeros((17, 8), "f4")),
            f"tensor {WO} has shape [17, 8] but the model config",
        ),
        (  # one ungated FFN in a gated model: one FFN form per jaxmoe model
            lambda a: {
                k.replace("decoder/layers_1/mlp/wi_0", "decoder/layers_1/mlp/wi"): v
                for k, v in a.items()
                if k != "decoder/layers_1/mlp/wi_1/kernel"
            },
            "unknown parameter decoder/layers_1/mlp/wi/kernel [8, 16]",
        ),
        (
            lambda a: variant(a, decoder__relpos_bias__rel_embedding=np.zeros((5, 32), "f4")),
            "decoder/relpos_bias/rel_embedding has shape [5, 32] but the model config",
        ),
    ],
    ids=["unknown", "missing", "shape", "ungated", "relpos"],
)
def test_bad_checkpoints_fail_in_one_line(tmp_path, t5x_arrays, edit, message):
    src = write_legacy(tmp_path / "checkpoint_0", edit(t5x_arrays))
    dst = tmp_path / "out"
    with pytest.raises(CheckpointError) as error:
        convert_t5x(src, dst)
    assert message in str(error.value)
    assert str(src) in str(error.value) and "\n" not in str(error.value)
    assert not dst.exists() and os.listdir(tmp_path) == ["checkpoint_0"]


def test_gqa_checkpoint_infers_kv_heads(tmp_path, t5x_arrays):
    """Decoder key/value kernels of 2 heads x 3 (a GQA-uptrained T5) give num_kv_heads=2."""
    arrays = dict(t5x_arrays)
    for i in range(LAYERS):
        for block in ("self_attention", "encoder_decoder_attention"):
            for proj in ("key", "value"):
                name = f"decoder/layers_{i}/{block}/{proj}/kernel"
                arrays[name] = arrays[name][:, :6]
    src = write_legacy(tmp_path / "checkpoint_0", arrays)
    config = convert_t5x(src, tmp_path / "out")
    assert (config.model.num_kv_heads, config.model.encoder_num_kv_heads) == (2, 0)
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(tmp_path / "out" / "params")
    np.testing.assert_array_equal(
        params["decoder_layers"]["0"]["self_attn"]["value"],
        arrays["decoder/layers_0/self_attention/value/kernel"].reshape(8, 2, 3),
    )


def test_existing_destination_and_bad_flags(tmp_path, converted):
    with pytest.raises(CheckpointError, match="already exists"):
        convert_t5x(TINY, converted[0])
    with pytest.raises(CheckpointError, match="--num_heads=8 but encoder/relpos_bias"):
        convert_t5x(TINY, tmp_path / "a", num_heads=8)
    with pytest.raises(CheckpointError, match="--dtype='float16' is not one of"):
        convert_t5x(TINY, tmp_path / "b", dtype="float16")
    toy = FIXTURES / "tiny_t5" / "checkpoint_1"  # a TensorStore-backed toy state, no model
    with pytest.raises(CheckpointError, match="tensors: not a T5 encoder-decoder checkpoint"):
        convert_t5x(toy, tmp_path / "c")
    assert os.listdir(tmp_path) == []
