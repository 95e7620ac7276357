"""A checkpoint is data: converters and exporters answer bad input in one line, never a
traceback. NaN weights, destinations that cannot be written, interrupted conversions (the
staging folder goes; a killed run's is removed by the next one), sizes a received config or
spec claims without the data to back them. Expected lines are written out by hand.
"""

import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import flax.serialization
import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxmoe.checkpoints.manager import save_params
from jaxmoe.checkpoints.trees import flatten, unflatten
from jaxmoe.cli import main
from jaxmoe.conversions.hf.exporter import export_hf
from jaxmoe.conversions.hf.importer import convert_hf
from jaxmoe.conversions.surgery import convert_gqa, convert_upcycle
from jaxmoe.conversions.t5x.convert import convert_t5x
from jaxmoe.conversions.t5x.exporter import export_t5x
from jaxmoe.models import build_model
from jaxmoe.models.spec import model_params
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
T5X = Path(os.environ.get("JAXMOE_T5X_FIXTURES", "/work/shared/fixtures/t5x"))
TINY = T5X / "test_t5_tiny.checkpoint_0"
needs_t5x = pytest.mark.skipif(not TINY.exists(), reason=f"T5X fixture not found at {TINY}")
NAN = "holds 1 NaN or infinite value(s)"


def refused(call, message: str) -> None:
    with pytest.raises(ValueError) as error:
        call()
    assert str(error.value) == message


@pytest.fixture
def cli(capsys, monkeypatch):
    """`cli(*args)`: `jaxmoe ARGS` in this process; asserts exit 2 and one stderr line,
    which it returns. The hooks main() silences after an error are put back afterwards."""
    for name in ("unraisablehook", "excepthook"):
        monkeypatch.setattr(sys, name, getattr(sys, name))
    monkeypatch.setattr(logging.getLogger("asyncio"), "level", logging.getLogger("asyncio").level)
    return lambda *args: cli_line(capsys, *args)


def cli_line(capsys, *args) -> str:
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def llama_folder(path: Path, *, vocab=64, d=16, ffn=24, layers=2, seed=0, **config) -> Path:
    """An HF Llama checkpoint written by hand (names and config.json as save_pretrained
    writes them), random weights."""
    rng = np.random.default_rng(seed)
    heads, kv, hd = 2, 1, d // 2

    def w(*shape):
        return (rng.standard_normal(shape, np.float32) * shape[-1] ** -0.5).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(vocab, d), "lm_head.weight": w(vocab, d)}
    tensors["model.norm.weight"] = np.ones(d, np.float32)
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(heads * hd, d),
            p + "self_attn.k_proj.weight": w(kv * hd, d),
            p + "self_attn.v_proj.weight": w(kv * hd, d),
            p + "self_attn.o_proj.weight": w(d, heads * hd),
            p + "mlp.gate_proj.weight": w(ffn, d),
            p + "mlp.up_proj.weight": w(ffn, d),
            p + "mlp.down_proj.weight": w(d, ffn),
            p + "input_layernorm.weight": np.ones(d, np.float32),
            p + "post_attention_layernorm.weight": np.ones(d, np.float32),
        }
    hf = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": d,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
    } | config
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(hf))
    return path


@pytest.fixture(scope="module")
def hf_src(tmp_path_factory) -> Path:
    return llama_folder(tmp_path_factory.mktemp("hf") / "src")


def edited_hf(hf_src: Path, tmp: Path, **changes) -> Path:
    """A copy of `hf_src` whose config.json has `changes` (None deletes a key)."""
    src = tmp / "edited"
    shutil.copytree(hf_src, src)
    config = json.loads((src / "config.json").read_text())
    config |= changes
    (src / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return src


@pytest.fixture(scope="module")
def nan_ckpt(tmp_path_factory) -> Path:
    """A tiny dense jaxmoe decoder checkpoint with one NaN in its embedding."""
    tmp = tmp_path_factory.mktemp("nan")
    config = tiny_config("model.moe.num_experts=0", f"data.cache_dir={tmp / 'cache'}")
    _, params = model_params(build_model(config.model, rngs=nnx.Rngs(0)))
    leaves = {path: np.array(leaf) for path, leaf in flatten(jax.device_get(params)).items()}
    leaves[("embed", "embedding")][3, 1] = np.nan
    save_params(str(tmp / "ckpt"), unflatten(leaves), config)
    return tmp / "ckpt"


# ------------------------------------------------------------------------ NaN weights


def test_convert_hf_refuses_nan(hf_src, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(hf_src, src)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"][2, 3] = np.inf
    save_file(tensors, str(src / "model.safetensors"))
    refused(
        lambda: convert_hf(src, tmp_path / "out"),
        f"tensor model.layers.1.mlp.up_proj.weight in model.safetensors {NAN}",
    )
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_writer_threads_do_not_repeat_the_one_line(hf_src, tmp_path, cli, caplog):
    """The NaN is found on Orbax's writer thread (tensors are produced while it writes):
    the CLI's line is the only report; the threads' tracebacks (110 lines) are dropped."""
    src = tmp_path / "src"
    shutil.copytree(hf_src, src)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.norm.weight"][0] = -np.inf
    save_file(tensors, str(src / "model.safetensors"))
    line = cli("convert", "hf", src, tmp_path / "out")
    assert line == f"jaxmoe convert: error: tensor model.norm.weight in model.safetensors {NAN}"
    for thread in threading.enumerate():  # Orbax's metadata thread may report after
        if thread.name in ("jaxmoe_leafwise", "write_metadata_after_commits"):
            thread.join(timeout=30)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_aftermath_of_an_abandoned_output_is_dropped(tmp_path, caplog):
    """Writers that find their files removed under them (an interrupted conversion) report
    nothing more; another thread's error still prints."""
    from jaxmoe.storage.background_errors import abandon, quiet_background_errors

    abandoned = tmp_path / ".out.converting-1"
    errors = {
        "aftermath": ValueError(f'NOT_FOUND: Error writing "w/0" in {abandoned}/params'),
        "other": ValueError("NOT_FOUND: Error writing somewhere else"),
    }

    def report(error):
        try:
            raise error
        except ValueError:
            logging.getLogger("absl").exception("_SignalingThread.run() raised: %s", error)

    with quiet_background_errors():
        abandon(abandoned)
        for error in errors.values():
            thread = threading.Thread(target=report, args=(error,))
            thread.start()
            thread.join()
    assert [r.exc_info[1] for r in caplog.records] == [errors["other"]]


@needs_t5x
def test_convert_t5x_refuses_nan(tmp_path):
    tree = flax.serialization.msgpack_restore(TINY.read_bytes())
    mlp = tree["optimizer"]["target"]["decoder"]["layers_1"]["mlp"]
    mlp["wo"]["kernel"] = np.array(mlp["wo"]["kernel"])
    mlp["wo"]["kernel"][0, 0] = np.nan
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "checkpoint").write_bytes(flax.serialization.msgpack_serialize(tree))
    refused(
        lambda: convert_t5x(tmp_path / "src", tmp_path / "out"),
        f"{tmp_path / 'src'}: tensor decoder/layers_1/mlp/wo/kernel {NAN}",
    )
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_surgery_and_export_hf_refuse_nan(nan_ckpt, tmp_path):
    line = f"{nan_ckpt}: parameter embed.embedding {NAN}"
    refused(lambda: convert_gqa(str(nan_ckpt), str(tmp_path / "gqa"), 1), line)
    refused(lambda: convert_upcycle(str(nan_ckpt), str(tmp_path / "moe"), 2), line)
    refused(
        lambda: export_hf(str(nan_ckpt), str(tmp_path / "hf")),
        f"checkpoint {str(nan_ckpt)!r}: embed.embedding {NAN}",
    )
    assert os.listdir(tmp_path) == []


@needs_t5x
def test_export_t5x_refuses_nan(tmp_path, monkeypatch):
    from jaxmoe.checkpoints import manager

    convert_t5x(TINY, tmp_path / "t5")
    restore = manager.restore_params

    def with_nan(*args, **kwargs):  # what a NaN-holding stored checkpoint restores to
        params = flatten(restore(*args, **kwargs))
        params[("encoder_norm", "scale")] = np.array(params[("encoder_norm", "scale")])
        params[("encoder_norm", "scale")][1] = -np.inf
        return unflatten(params)

    monkeypatch.setattr(manager, "restore_params", with_nan)
    refused(
        lambda: export_t5x(tmp_path / "t5", tmp_path / "out"),
        f"{tmp_path / 't5'}: parameter encoder_norm.scale {NAN}",
    )
    assert sorted(os.listdir(tmp_path)) == ["t5"]


# ------------------------------------------------------- destinations that cannot be written


@needs_t5x
def test_blocked_destinations_fail_before_any_work(hf_src, nan_ckpt, tmp_path, cli):
    """DST under a regular file, or DST a regular file, for every writing command. The
    sources are fine or (nan_ckpt) refused only once read: the DST line comes first."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    under = blocker / "out"
    config = tmp_path / "prepare.py"
    config.write_text(
        "from jaxmoe.config.defaults import base_config\n"
        "def get_config(arg=None):\n    return base_config()\n"
    )
    made = f"{under}: cannot be created: {blocker} is a file"
    exists = f"{blocker}: already exists; converting writes a new directory"
    cases = [
        (("convert", "t5x", TINY, under), made),
        (("convert", "t5x", TINY, blocker), exists),
        (("convert", "hf", hf_src, under), made),
        (("convert", "hf", hf_src, blocker), exists),
        (("convert", "gqa", nan_ckpt, under, "--num_kv_heads=1"), made),
        (("convert", "upcycle", nan_ckpt, blocker, "--num_experts=2"), exists),
        (("export", "hf", nan_ckpt, under), made),
        (("export", "hf", nan_ckpt, blocker), exists.replace("converting", "exporting")),
        (("export", "t5x", nan_ckpt, under), made),
        (("export", "t5x", nan_ckpt, blocker), f"{blocker}: is a file, not a directory"),
        (
            ("prepare", f"--config={config}", f"--config.data.cache_dir={under}"),
            made,
        ),
        (
            ("prepare", f"--config={config}", f"--config.data.cache_dir={blocker}"),
            f"{blocker}: is a file, not a directory",
        ),
    ]
    for args, line in cases:
        assert cli(*args) == f"jaxmoe {args[0]}: error: {line}", args
    assert sorted(os.listdir(tmp_path)) == ["file", "prepare.py"]


# --------------------------------------------------------------- interrupted conversions


@pytest.fixture(scope="module")
def big_hf_src(tmp_path_factory) -> Path:
    """Large enough (~50 MB) that its conversion is still writing when the test looks."""
    return llama_folder(tmp_path_factory.mktemp("big") / "src", vocab=8192, d=512, ffn=1024, seed=1)


def start_convert(src: Path, dst: Path) -> subprocess.Popen:
    environ = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    environ["PYTHONPATH"] = str(ROOT)
    return subprocess.Popen(
        [sys.executable, "-m", "jaxmoe.cli", "convert", "hf", str(src), str(dst)],
        cwd=ROOT,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell without job control starts `cmd &` with SIGINT ignored, the test run inherits
        # that, and Python then leaves SIGINT ignored: give the command a terminal's Ctrl-C.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def stop_while_staging(process: subprocess.Popen, dst: Path) -> Path:
    """SIGSTOPs `process` as soon as its staging folder appears; returns that folder."""
    prefix = f".{dst.name}.converting-"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        staging = [e for e in dst.parent.iterdir() if e.name.startswith(prefix)]
        if staging:
            os.kill(process.pid, signal.SIGSTOP)
            return staging[0]
        time.sleep(0.002)
    raise AssertionError(f"no staging folder appeared: {process.communicate()}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl_c"])
def test_interrupted_conversion_removes_its_staging(big_hf_src, tmp_path, sig):
    dst = tmp_path / "out"
    process = start_convert(big_hf_src, dst)
    staging = stop_while_staging(process, dst)
    assert staging.is_dir()
    os.kill(process.pid, sig)
    os.kill(process.pid, signal.SIGCONT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 2
    assert err.splitlines() == [
        f"jaxmoe convert: error: interrupted by {sig.name}; no partial checkpoint left at {dst}"
    ]
    assert os.listdir(tmp_path) == []


def test_killed_conversion_is_cleaned_up_by_the_next(big_hf_src, tmp_path, caplog):
    dst = tmp_path / "out"
    process = start_convert(big_hf_src, dst)
    staging = stop_while_staging(process, dst)
    process.kill()
    process.communicate(timeout=60)
    assert staging.is_dir()  # SIGKILL: nothing could clean up
    convert_hf(big_hf_src, dst)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"removed {staging}, left by a conversion to {dst} that was killed (pid {process.pid})"
    ]
    assert os.listdir(tmp_path) == ["out"]


def test_concurrent_conversion_to_the_same_dst_is_refused(hf_src, tmp_path):
    """A live conversion holds `.out.lock`; its staging folder is not touched."""
    dst = tmp_path / "out"
    staging = tmp_path / ".out.converting-12345"
    staging.mkdir()
    with open(tmp_path / ".out.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.write("12345\n")
        lock.flush()
        refused(
            lambda: convert_hf(hf_src, dst),
            f"{dst}: another conversion (pid 12345) is writing it now; wait for it to "
            "finish or choose another DST",
        )
        assert staging.is_dir()


# ---------------------------------------------------- sizes a config or spec only claims


@pytest.mark.parametrize(
    "changes, line",
    [
        (
            {"num_hidden_layers": 10**9},
            "config.json: num_hidden_layers=1000000000, but the checkpoint holds tensors of "
            "2 layers, indices 0..1",
        ),
        (
            {"vocab_size": 10**12},
            "config.json: vocab_size=1000000000000 is not a plausible size (> 2**31 - 1)",
        ),
        (
            {"hidden_size": 2**31},
            "config.json: hidden_size=2147483648 is not a plausible size (> 2**31 - 1)",
        ),
        (
            {"vocab_size": 10**9},
            "tensor model.embed_tokens.weight in model.safetensors has shape (64, 16), but "
            "config.json implies (1000000000, 16) (jaxmoe embed.embedding "
            "(1000000000, 16))",
        ),
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            "config.json: rope_type 'dynamic' (RoPE scaling) is not supported; jaxmoe "
            "implements default, linear and llama3",
        ),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 0.5}},
            "config.json: linear RoPE factor=0.5 must be >= 1 (it stretches positions; "
            "transformers warns about the same)",
        ),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 4.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
            "config.json: llama3 RoPE high_freq_factor=4.0 must be greater than "
            "low_freq_factor=4.0",
        ),
        (
            {
                "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                "rope_scaling": {"rope_type": "linear", "factor": 4.0},
            },
            "config.json: rope_parameters={'rope_type': 'linear', 'factor': 2.0, "
            "'rope_theta': 10000.0} and rope_scaling={'rope_type': 'linear', 'factor': 4.0} "
            "disagree (factor); keep one",
        ),
    ],
    ids=[
        "layers",
        "vocab",
        "hidden",
        "vocab_vs_tensors",
        "rope_type",
        "factor",
        "llama3",
        "two_ropes",
    ],
)
def test_hf_config_sizes_and_rope(hf_src, tmp_path, cli, changes, line):
    start = time.monotonic()
    src = edited_hf(hf_src, tmp_path, **changes)
    assert cli("convert", "hf", src, tmp_path / "out") == f"jaxmoe convert: error: {line}"
    assert time.monotonic() - start < 10  # nothing was built per claimed layer


def test_hf_config_nested_too_deeply(hf_src, tmp_path):
    src = edited_hf(hf_src, tmp_path)
    (src / "config.json").write_text("[" * 10**5 + "]" * 10**5)
    refused(
        lambda: convert_hf(src, tmp_path / "out"),
        f"{src / 'config.json'}: unreadable JSON (nested too deeply)",
    )


@needs_t5x
def test_t5x_fill_value_spec_cannot_claim_gigabytes(tmp_path, cli):
    """The tiny T5 with its embedding replaced by a TensorStore spec with a fill_value,
    declaring [2**27, 8] float32 (4 GiB) over one 20-byte chunk file: refused when the
    shape is first read, before a config or an array is built from it."""
    tree = flax.serialization.msgpack_restore(TINY.read_bytes())
    del tree["optimizer"]["state"]["param_states"]  # Adafactor moments: not needed here
    del tree["optimizer"]["target"]["decoder"]["logits_dense"]
    tree["optimizer"]["target"]["token_embedder"]["embedding"] = {
        "driver": "zarr",
        "kvstore": {"driver": "file", "path": "embedding"},
        "metadata": {
            "shape": [2**27, 8],
            "chunks": [2**17, 8],
            "dtype": "<f4",
            "fill_value": 0.0,
            "compressor": {"id": "gzip"},
            "zarr_format": 2,
            "order": "C",
            "filters": None,
        },
    }
    src = tmp_path / "checkpoint_1"
    (src / "embedding").mkdir(parents=True)
    (src / "embedding" / "0.0").write_bytes(b"\x00" * 20)
    (src / "checkpoint").write_bytes(flax.serialization.msgpack_serialize(tree))
    assert sum(f.stat().st_size for f in src.rglob("*") if f.is_file()) < 200_000
    assert cli("convert", "t5x", src, tmp_path / "out") == (
        "jaxmoe convert: error: tensor optimizer/target/token_embedder/embedding: shape "
        "[134217728, 8] float32 needs 4.0 GiB but its chunk files hold 20 bytes, more than "
        "gzip can expand (1032:1); refused before allocating"
    )


@needs_t5x
def test_t5x_layer_numbers_must_be_dense(tmp_path):
    tree = flax.serialization.msgpack_restore(TINY.read_bytes())
    encoder = tree["optimizer"]["target"]["encoder"]
    encoder["layers_999999999"] = encoder.pop("layers_1")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "checkpoint").write_bytes(flax.serialization.msgpack_serialize(tree))
    refused(
        lambda: convert_t5x(tmp_path / "src", tmp_path / "out"),
        f"{tmp_path / 'src'}: encoder layers are numbered up to layers_999999999 but only 2 "
        "of them have tensors",
    )


def test_upcycle_num_experts_bounded_by_host_memory(nan_ckpt, tmp_path, cli):
    # The tiny model (tests/helpers.py): 2 layers of d 32, FFN 64 gated. Per layer and
    # expert 3 * 32 * 64 kernel floats + 32 router floats, 10**8 experts, 4 bytes each:
    # 2 * 6176 * 4 * 10**8 / 2**30 = 4601.5 GiB (the rest of the model: under 1 MiB).
    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    assert cli("convert", "upcycle", nan_ckpt, tmp_path / "moe", "--num_experts=100000000") == (
        "jaxmoe convert: error: --num_experts=100000000: the upcycled parameters would take "
        f"4,601.5 GiB, more than this host's {host_gib:,.1f} GiB of RAM"
    )
    assert os.listdir(tmp_path) == []
