"""Bad input gets one line naming the culprit: never a traceback, never a silent wrong number.

Each case is a hostile input a user can type or hand over (eval data, configs, checkpoints of
another model); the expected lines are written out by hand.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxmoe.checkpoints.manager import CheckpointError, restore_params
from jaxmoe.config.loading import with_overrides
from jaxmoe.conversions.hf.importer import abstract_params, convert_hf
from jaxmoe.conversions.t5x.reader import open_t5x
from jaxmoe.errors import ConfigError
from jaxmoe.inference.evaluate import evaluate, read_jsonl
from jaxmoe.models import build_model
from jaxmoe.models.spec import model_params
from tests.fixtures_checkpoints import VOCAB, dense_config
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(saved_dense) -> Path:
    """A parameters-only checkpoint of a tiny dense decoder (vocabulary 512) holding the
    512-piece tokenizer of the embedded corpus; its config is dense_config(checkpoint.parent)
    (the session's, tests/fixtures_checkpoints.py: read-only)."""
    return saved_dense / "ckpt"


def cli(*args: str, **env) -> subprocess.CompletedProcess:
    """`jaxmoe ARGS` as a user runs it: no JAX_PLATFORMS, whatever extras are installed."""
    environ = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    environ["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "jaxmoe.cli", *args],
        cwd=ROOT,
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


# ---------------------------------------------------------------------------- eval data


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"targets": [1, 2, 512, 4]}', "'targets'[2] = 512 is outside the vocabulary [0, 512)"),
        ('{"targets": [1, -3, 4]}', "'targets'[1] = -3 is outside the vocabulary [0, 512)"),
        ('{"targets": [1, true, 4]}', "'targets'[1] = true is not a token id"),
        ('{"targets": [1, false]}', "'targets'[1] = false is not a token id"),
        ('{"targets": [1, 2.0, 4]}', "'targets'[1] = 2.0 is not a token id"),
        ('{"targets": [1, 2.5, 4]}', "'targets'[1] = 2.5 is not a token id"),
        ('{"targets": 7}', "'targets' must be text or a list of token ids, not 7"),
        ("7", "expected a JSON object with 'text' or 'targets', got 7"),
        ("[1, 2, 3]", "expected a JSON object with 'text' or 'targets', got [1, 2, 3]"),
    ],
)
def test_bad_eval_ids_name_file_line_and_value(tmp_path, line, message):
    data = tmp_path / "data.jsonl"
    data.write_text('{"targets": [1, 2, 3]}\n\n' + line + "\n")  # the bad line is line 3
    with pytest.raises(ValueError) as error:
        read_jsonl(str(data), None, encoder_decoder=False, vocab_size=VOCAB)
    assert str(error.value) == f"{data}:3: {message}"


def test_largest_and_smallest_ids_are_accepted(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"targets": [0, 511]}\n')
    (example,) = read_jsonl(str(data), None, encoder_decoder=False, vocab_size=VOCAB)
    assert example.targets == [0, 511]
    with pytest.raises(ValueError, match=r":2: 'inputs'\[0\] = 600 is outside"):
        data.write_text('{"inputs": [5], "targets": [1]}\n{"inputs": [600], "targets": [1]}\n')
        read_jsonl(str(data), None, encoder_decoder=True, vocab_size=VOCAB)


def test_cli_bad_eval_data_prints_only_jaxmoes_line(checkpoint, tmp_path):
    """One stderr line, exit 2: no traceback, and no libtpu probe noise on a host without a
    TPU even when the `tpu` extra is installed."""
    data = tmp_path / "ids.jsonl"
    data.write_text('{"targets": [1, 2, 3]}\n{"targets": [4, 600, 6]}\n')
    result = cli("eval", "--checkpoint", str(checkpoint), "--data", f"jsonl:{data}")
    assert result.returncode == 2
    assert result.stderr == (
        f"jaxmoe eval: error: {data}:2: 'targets'[1] = 600 is outside the vocabulary [0, 512)\n"
    )


# ---------------------------------------------------------------------------- configs


def test_moe_every_beyond_the_layers_is_refused(tmp_path):
    config = tiny_config("model.num_layers=2", "model.moe.every=2")  # layer 1 is MoE: fine
    with pytest.raises(ConfigError) as error:
        with_overrides(config, ["model.moe.every=3"])
    assert str(error.value) == (
        "model.moe.every=3 exceeds model.num_layers=2: no layer would be MoE "
        "(model.moe.num_experts=0 is the dense model)"
    )


def test_eval_with_the_training_config_sizes_the_vocabulary_from_the_tokenizer(
    checkpoint, tmp_path
):
    """A training config has model.vocab_size=0 ("take the tokenizer's"): eval resolves it
    as training does instead of building a (d_model, 0) output layer."""
    data = tmp_path / "ids.jsonl"
    data.write_text('{"targets": [1, 2, 3, 4]}\n')
    stored = evaluate(str(checkpoint), f"jsonl:{data}")
    config = dense_config(checkpoint.parent, "model.vocab_size=0", f"data.vocab_size={VOCAB}")
    passed = evaluate(str(checkpoint), f"jsonl:{data}", config=config)
    assert passed["loss"] == pytest.approx(stored["loss"], rel=1e-6)
    assert passed["num_tokens"] == 3


# ---------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize(
    "override, message",
    [
        # The embedding is [vocab, d_model]: (512, 32) stored, (512, 48) asked for.
        (
            "model.d_model=48",
            "tensor embed.embedding has shape (512, 32), the model config expects (512, 48)",
        ),
        # Layer 2's nine tensors (2 norms, 4 attention, 3 FFN) exist only in the model.
        (
            "model.num_layers=3",
            "the model's tensor layers.2.attn.key (32, 2, 8) is not in the checkpoint (9 missing)",
        ),
    ],
)
def test_restoring_another_model_names_the_tensor_and_shapes(
    checkpoint, tmp_path, override, message
):
    other = dense_config(tmp_path, override)
    with pytest.raises(CheckpointError) as error:
        restore_params(str(checkpoint), abstract_params(other.model))
    assert message in str(error.value) and "\n" not in str(error.value)


# ---------------------------------------------------------------------------- HF sources

LLAMA = {  # one layer, hand-sized: vocab 32, width 8, 2 heads of 4 sharing 1 KV head, FFN 16
    "model_type": "llama",
    "vocab_size": 32,
    "hidden_size": 8,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 16,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
}


def llama_tensors() -> dict[str, np.ndarray]:
    """HF Llama names and [out, in] shapes for LLAMA, written out by hand."""
    shapes = {
        "model.embed_tokens.weight": (32, 8),
        "model.layers.0.input_layernorm.weight": (8,),
        "model.layers.0.self_attn.q_proj.weight": (8, 8),
        "model.layers.0.self_attn.k_proj.weight": (4, 8),
        "model.layers.0.self_attn.v_proj.weight": (4, 8),
        "model.layers.0.self_attn.o_proj.weight": (8, 8),
        "model.layers.0.post_attention_layernorm.weight": (8,),
        "model.layers.0.mlp.gate_proj.weight": (16, 8),
        "model.layers.0.mlp.up_proj.weight": (16, 8),
        "model.layers.0.mlp.down_proj.weight": (8, 16),
        "model.norm.weight": (8,),
        "lm_head.weight": (32, 8),
    }
    rng = np.random.default_rng(0)
    return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


def write_hf(path: Path, config: dict, tensors: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_hand_written_llama_converts(tmp_path):
    """The fixture itself is a valid checkpoint: the refusals below are about one defect."""
    config = convert_hf(write_hf(tmp_path / "src", LLAMA, llama_tensors()), tmp_path / "dst")
    assert (config.model.num_layers, config.model.num_kv_heads) == (1, 1)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("hidden_size", "8", "config.json: hidden_size='8' is not a positive integer"),
        ("hidden_size", 8.5, "config.json: hidden_size=8.5 is not a positive integer"),
        ("num_attention_heads", True, "config.json: num_attention_heads=True is not a positive"),
        ("intermediate_size", -16, "config.json: intermediate_size=-16 is not a positive"),
        ("rms_norm_eps", "1e-6", "config.json: rms_norm_eps='1e-6' is not a finite number"),
        # The tensors hold layer 0 only: refused from the names, before any per-layer work.
        ("num_hidden_layers", 10**4, "num_hidden_layers=10000, but the checkpoint holds "
         "tensors of 1 layers, indices 0..0"),
        ("num_hidden_layers", 10**6, "num_hidden_layers=1000000, but the checkpoint holds "),
    ],
)  # fmt: skip
def test_bad_hf_config_value_is_named(tmp_path, key, value, message):
    src = write_hf(tmp_path / "src", {**LLAMA, key: value}, llama_tensors())
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as error:
        convert_hf(src, tmp_path / "dst")
    assert message in str(error.value) and "\n" not in str(error.value)
    assert time.perf_counter() - start < 5.0
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_weights_are_refused_naming_the_tensor(tmp_path, bad):
    tensors = llama_tensors()
    tensors["model.layers.0.mlp.up_proj.weight"][3, 5] = bad
    src = write_hf(tmp_path / "src", LLAMA, tensors)
    with pytest.raises(CheckpointError) as error:
        convert_hf(src, tmp_path / "dst")
    assert str(error.value) == (
        "tensor model.layers.0.mlp.up_proj.weight in model.safetensors holds 1 NaN or "
        "infinite value(s)"
    )
    assert not (tmp_path / "dst").exists()


def test_top_level_safetensors_symlink_out_of_the_source_is_refused(tmp_path):
    """A `model.safetensors` linking outside SRC is refused, as the same link named by an
    index is: reading never leaves the checkpoint directory."""
    outside = write_hf(tmp_path / "elsewhere", LLAMA, llama_tensors())
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(LLAMA))
    (src / "model.safetensors").symlink_to(outside / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model.safetensors' resolves to .*, outside"):
        convert_hf(src, tmp_path / "dst")
    # Alone in the directory under another name: found by the *.safetensors glob, same gate.
    (src / "model.safetensors").rename(src / "weights.safetensors")
    with pytest.raises(CheckpointError, match=r"'weights.safetensors' resolves to .*, outside"):
        convert_hf(src, tmp_path / "dst")
    # A link that stays inside the directory is fine.
    (src / "weights.safetensors").unlink()
    (src / "real.bin.safetensors").write_bytes((outside / "model.safetensors").read_bytes())
    (src / "model.safetensors").symlink_to("real.bin.safetensors")
    assert convert_hf(src, tmp_path / "dst").model.num_layers == 1


def test_t5x_checkpoint_symlink_out_of_the_directory_is_refused(tmp_path):
    (tmp_path / "secret").write_bytes(b"\x80")  # an empty msgpack map
    step = tmp_path / "checkpoint_100"
    step.mkdir()
    (step / "checkpoint").symlink_to(tmp_path / "secret")
    with pytest.raises(ValueError, match=r"path 'checkpoint' resolves to .*, outside"):
        open_t5x(step)


# ---------------------------------------------------------------------------- training

TRAIN = [
    "--config", "configs/default.py:dense", "--no_progress",
    "--config.model.num_layers=2", "--config.model.d_model=32", "--config.model.num_heads=4",
    "--config.model.num_kv_heads=2", "--config.model.head_dim=8", "--config.model.ffn_dim=64",
    "--config.train.batch_size=8", "--config.train.steps=2", "--config.data.vocab_size=512",
]  # fmt: skip


def test_step_memory_lower_bound_matches_a_hand_count():
    """Tiny dense decoder on 8 devices, batch 8 over mesh.data=8: one row per device."""
    from jaxmoe.models.spec import model_spec
    from jaxmoe.parallel.mesh import make_mesh
    from jaxmoe.training.optimizer import make_optimizer
    from jaxmoe.training.state import state_shardings
    from jaxmoe.training.step_memory import step_bytes_lower_bound

    config = tiny_config("model.moe.num_experts=0")
    mesh = make_mesh(config.mesh)
    optimizer, _ = make_optimizer(config.optimizer, config.train.steps)
    abstract, shardings = state_shardings(mesh, model_spec(config.model, mesh), optimizer)
    parts = step_bytes_lower_bound(config.model, config.train, mesh, abstract, shardings)
    # Parameters: embed 128*32, lm_head 32*128, final norm 32, and per layer 2 norms of 32,
    # q 32*4*8, k and v 32*2*8, out 4*8*32, wi_0 and wi_1 32*64, wo 64*32.
    layer = 2 * 32 + 1024 + 512 + 512 + 1024 + 3 * 2048
    assert parts["gradients"] == 4 * (128 * 32 + 32 * 128 + 32 + 2 * layer)  # replicated f32
    assert parts["logits"] == 1 * 16 * 128 * 4  # rows x seq_len x vocab, float32
    assert parts["activations"] == 1 * 16 * 32 * 4 * 2  # rows x seq_len x d_model x layers
    assert parts["state"] > 3 * parts["gradients"]  # params + AdamW's two moments, at least


@pytest.mark.parametrize(
    "overrides, message",
    [
        # 4 layers of d_model 65536, FFN 262144: ~206G float32 parameters, two Adam moments
        # and gradients, about 3 TiB: more than any host's RAM.
        (
            ["--config.train.seq_len=32", "--config.model.d_model=65536",
             "--config.model.ffn_dim=262144", "--config.model.num_layers=4"],
            "jaxmoe train: error: train.batch_size=8 x train.seq_len=32 with this model needs "
            "at least ",
        ),
        (
            ["--config.train.seq_len=1000000"],
            "jaxmoe train: error: train.seq_len=1000000 is longer than the 'train' split of "
            "data.source='embedded' (",
        ),
    ],
)  # fmt: skip
def test_impossible_step_is_refused_before_compiling_and_leaves_no_workdir(
    checkpoint, tmp_path, overrides, message
):
    workdir = tmp_path / "runs" / "new"
    cache = checkpoint.parent / "cache"  # the tokenizer the checkpoint fixture trained
    result = cli("train", "--workdir", str(workdir), *TRAIN, f"--config.data.cache_dir={cache}",
                 *overrides)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------- damaged items


def _saved_run(workdir: Path, meta: dict):
    """A one-step TrainCheckpoints save of a two-array state; (manager, abstract state)."""
    from jaxmoe.checkpoints.manager import TrainCheckpoints

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    state = {"params": {"w": jax.numpy.ones(3)}, "opt_state": {"m": jax.numpy.zeros(3)}}
    checkpoints = TrainCheckpoints(str(workdir), max_to_keep=2)
    checkpoints.save(1, state, meta, tiny_config())
    checkpoints.wait()
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                            {**state, "step": jax.numpy.int32(0)})  # fmt: skip
    return checkpoints, abstract


def test_missing_or_incomplete_meta_is_one_line(tmp_path):
    import shutil

    checkpoints, abstract = _saved_run(tmp_path / "a", {"step": 1, "data": {}})
    shutil.rmtree(tmp_path / "a" / "checkpoints" / "1" / "meta")
    with pytest.raises(CheckpointError) as error:
        checkpoints.restore(1, abstract)
    assert str(error.value) == (
        f"checkpoint '{tmp_path / 'a' / 'checkpoints' / '1'}': item 'meta' is missing "
        "(a damaged checkpoint: move it away to resume from an earlier one)"
    )
    checkpoints, abstract = _saved_run(tmp_path / "b", {"step": 1})
    with pytest.raises(CheckpointError, match="item 'meta' lacks 'step' or 'data'"):
        checkpoints.restore(1, abstract)


# ---------------------------------------------------------------------------- disk full

DISK_FULL = """
set -e
mount -t tmpfs -o size=8m tmpfs "$MNT"
"$PY" -m jaxmoe.cli train --workdir "$MNT/run" $ARGS --config.train.steps=2 >/dev/null
# Leave 100 KiB: the workdir probe passes, the next checkpoint (~640 KiB) cannot fit.
avail=$(df -k "$MNT" | tail -1 | awk '{print $4}')
dd if=/dev/zero of="$MNT/filler" bs=1k count=$((avail - 100)) 2>/dev/null || true
set +e
"$PY" -m jaxmoe.cli train --workdir "$MNT/run" $ARGS --config.train.steps=4 \
    >"$OUT/full.out" 2>"$OUT/full.err"
echo $? >"$OUT/full.rc"
ls "$MNT/run/checkpoints" >"$OUT/after_full.txt"
rm "$MNT/filler"
"$PY" -m jaxmoe.cli train --workdir "$MNT/run" $ARGS --config.train.steps=4 \
    >"$OUT/resume.out" 2>"$OUT/resume.err"
echo $? >"$OUT/resume.rc"
cp "$MNT/run/metrics.jsonl" "$OUT/metrics.jsonl"
"""


def in_private_tmpfs(script: str, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    """Run sh `script` in a private user + mount namespace (no root needed, nothing visible
    outside the test) where it may mount a tmpfs on $MNT; $OUT is tmp_path."""
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no user namespaces here (unshare -rm: {probe.stderr.decode().strip()})")
    (tmp_path / "mnt").mkdir()
    environ = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    environ |= {
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",
        "PY": sys.executable,
        "MNT": str(tmp_path / "mnt"),
        "OUT": str(tmp_path),
        **env,
    }
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow  # trains on a filled tmpfs, then resumes: 148 s wall, loaded host
def test_disk_full_is_one_line_and_loses_no_checkpoint(checkpoint, tmp_path):
    """A real full disk: a small tmpfs filled after the step-2 checkpoint. The step-4 save
    fails with one line; after freeing space the run resumes from step 2."""
    args = [*TRAIN, "--config.train.seq_len=32", "--config.train.checkpoint_every=2",
            f"--config.data.cache_dir={checkpoint.parent / 'cache'}"]  # fmt: skip
    result = in_private_tmpfs(DISK_FULL, tmp_path, ARGS=" ".join(args))
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "full.rc").read_text().strip() == "2"
    assert (tmp_path / "full.err").read_text() == (
        f"jaxmoe train: error: no space left on {tmp_path / 'mnt' / 'run'}: the checkpoint "
        "being written was not kept and completed checkpoints are intact; free space and "
        "rerun to resume\n"
    )
    assert "2" in (tmp_path / "after_full.txt").read_text().split()
    assert (tmp_path / "resume.rc").read_text().strip() == "0", (
        tmp_path / "resume.err"
    ).read_text()
    assert "starting at step 2 of 4" in (tmp_path / "resume.out").read_text()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 4


# ---------------------------------------------------------------------------- decode


def test_prompt_beyond_the_trained_context_is_refused_or_truncated(caplog):
    from jaxmoe.inference.decode_text import fit_context

    prompts = [list(range(10)), list(range(3))]
    # Decoder: 10 prompt + 8 new tokens > 16; the 3-token prompt would fit.
    with pytest.raises(ValueError) as error:
        fit_context(prompts, 16, 8, truncate=False, encoder_decoder=False)
    assert str(error.value) == (
        "prompt 0: 10 tokens + --max_new_tokens=8 exceed the model's context of 16 tokens "
        "(model.max_len, the longest sequence it was trained on); shorten it, or --truncate "
        "keeps its last 8 tokens"
    )
    with caplog.at_level("WARNING"):
        kept = fit_context(prompts, 16, 8, truncate=True, encoder_decoder=False)
    assert kept == [list(range(2, 10)), list(range(3))]
    assert "prompt 0 truncated from 10 to its last 8 tokens" in caplog.text
    # An encoder's input has the whole context; unknown context (0) checks nothing.
    assert fit_context(prompts, 10, 8, truncate=False, encoder_decoder=True) == prompts
    assert fit_context(prompts, 0, 8, truncate=False, encoder_decoder=False) == prompts
    with pytest.raises(ValueError, match="--max_new_tokens=16 leaves no room for a prompt"):
        fit_context(prompts, 16, 16, truncate=False, encoder_decoder=False)


@pytest.fixture(scope="module")
def generator(checkpoint):
    from jaxmoe.inference.decode import Generator
    from jaxmoe.parallel.mesh import make_mesh

    config = dense_config(checkpoint.parent)
    _, params = model_params(build_model(config.model, rngs=nnx.Rngs(0)))
    return Generator(config.model, params, make_mesh(config.mesh))


def test_decode_memory_lower_bound_matches_a_hand_count(generator):
    """1 prompt of 20 tokens (bucket 32) + 5 new (bucket 16) on 8 data-parallel devices:
    one row per device; 2 layers, 2 KV heads of 8, 4 query heads, float32."""
    parts = generator.bytes_lower_bound(1, 20, 5)
    assert parts["kv_cache"] == 2 * 2 * 1 * 2 * 48 * 8 * 4  # K and V x layers x rows ...
    assert parts["attention"] == 1 * 4 * 32 * 48 * (4 + 4)  # f32 scores + f32 probabilities


def test_prompt_beyond_memory_is_refused_before_prefill(generator):
    # A 2**20-token prompt: its prefill attention scores alone are 4 * 2**40 * 8 bytes.
    with pytest.raises(ValueError) as error:
        generator.generate([[5] * 2**20], 4)
    assert str(error.value).startswith(
        "a 1048576-token prompt (x1) with --max_new_tokens=4 needs at least "
    )
    assert "GiB per device (parameters " in str(error.value)


def test_cli_decode_refuses_a_prompt_beyond_the_context(checkpoint, tmp_path):
    config = dense_config(checkpoint.parent, "model.max_len=16")
    (tmp_path / "config.py").write_text(
        "from jaxmoe.config.stored import complete_stored\n\n\n"
        f"def get_config(variant=None):\n    return complete_stored({config.to_dict()!r})\n"
    )
    prompt = "the quick brown fox jumps over the lazy dog " * 4
    args = ["decode", "--checkpoint", str(checkpoint), "--config", str(tmp_path / "config.py"),
            "--prompt", prompt, "--max_new_tokens", "8"]  # fmt: skip
    result = cli(*args)
    assert result.returncode == 2
    # Before the error, at most decode's own warning that the tokenizer is the trained one.
    *before, last = result.stderr.splitlines()
    assert len(before) <= 1 and all(line.startswith("WARNING:jaxmoe.") for line in before)
    assert last.startswith("jaxmoe decode: error: prompt 0: ")
    assert last.endswith(
        " + --max_new_tokens=8 exceed the model's context of 16 tokens (model.max_len, the "
        "longest sequence it was trained on); shorten it, or --truncate keeps its last 8 "
        "tokens"
    )
    truncated = cli(*args, "--truncate")
    assert truncated.returncode == 0, truncated.stderr
    assert "prompt 0 truncated from " in truncated.stderr


CONVERT_FULL = """
mount -t tmpfs -o size=40k tmpfs "$MNT"
"$PY" -m jaxmoe.cli convert hf "$SRC" "$MNT/dst" 2>"$OUT/convert.err"
echo $? >"$OUT/convert.rc"
ls -A "$MNT" >"$OUT/left.txt"
"""


def test_converting_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    """Orbax writes well over ten files, each at least one 4 KiB tmpfs page: 40 KiB is
    too little for them even though the parameters are only ~5 KiB."""
    src = write_hf(tmp_path / "src", LLAMA, llama_tensors())
    result = in_private_tmpfs(CONVERT_FULL, tmp_path, SRC=str(src))
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "convert.rc").read_text().strip() == "2"
    assert (tmp_path / "convert.err").read_text() == (
        f"jaxmoe convert: error: no space left on {tmp_path / 'mnt' / 'dst'}\n"
    )
    assert (tmp_path / "left.txt").read_text() == ""  # the staging directory is gone


def test_aot_compile_prints_nothing_on_stderr():
    """`jaxmoe compile` reaches libtpu for compile-only TPU devices; on a host without a
    TPU neither that nor the CPU backend's start may print libtpu's probe lines."""
    pytest.importorskip("libtpu", reason="the `tpu` extra is not installed")
    model = ["--config.model.num_layers=2", "--config.model.d_model=256",
             "--config.model.head_dim=128", "--config.model.vocab_size=512"]  # fmt: skip
    step = ["--config.train.batch_size=256", "--config.train.seq_len=8",
            "--config.mesh.data=1", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"]  # fmt: skip
    # Without the tests' compilation cache: jax writes compile-only TPU executables to it
    # but cannot read them back (no client to load into), and warns on every later run.
    result = cli("compile", "--config", "configs/default.py:dense", "--topology", "v5p-8",
                 *model, *step, JAX_ENABLE_COMPILATION_CACHE="false")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "verdict: fits on v5p-8" in result.stdout


def test_resuming_with_another_width_names_the_tensor(tmp_path):
    checkpoints, abstract = _saved_run(tmp_path, {"step": 1, "data": {}})
    w = abstract["params"]["w"]
    wider = {**abstract, "params": {"w": jax.ShapeDtypeStruct((4,), w.dtype, sharding=w.sharding)}}
    with pytest.raises(
        CheckpointError, match=r"tensor w has shape \(3,\), the model config expects \(4,\)"
    ):
        checkpoints.restore(1, wider)
