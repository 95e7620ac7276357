"""T5X checkpoint reader against real T5X fixtures and independent decoders.

References: flax's own msgpack reader (`flax.serialization.msgpack_restore`), gunzip +
`np.frombuffer` by hand, TensorStore opened directly, and checkpoints written here by
TensorStore + flax. Malicious and corrupt variants are edited copies in tmp_path.
"""

import gzip
import json
import os
import shutil
from pathlib import Path

import flax.serialization
import ml_dtypes
import msgpack
import numpy as np
import pytest
import tensorstore

from jaxmoe.checkpoints.safe_paths import resolve_inside
from jaxmoe.conversions.t5x.reader import open_t5x

FIXTURES = Path(os.environ.get("JAXMOE_T5X_FIXTURES", "/work/shared/fixtures/t5x"))
if not FIXTURES.is_dir():
    pytest.skip(f"T5X fixtures not found at {FIXTURES}", allow_module_level=True)

TINY = FIXTURES / "test_t5_tiny.checkpoint_0"
TINY_T5 = FIXTURES / "tiny_t5" / "checkpoint_1"
TINY_ORBAX = FIXTURES / "tiny_orbax" / "1"
KERNEL = "param_states/kernel"  # the toy state's [10, 5] float64 array
KERNEL_DIR = "state.param_states.kernel"


def t5_1_1_tiny_shapes() -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tiny T5.1.1 of the fixture README, written out by hand:
    vocab 32128, d 8, 4 heads x 3, d_ff 16 gated, 2 + 2 layers, 32 buckets."""
    d, hd, ff, vocab = 8, 4 * 3, 16, 32128
    attention = {"query/kernel": (d, hd), "key/kernel": (d, hd), "value/kernel": (d, hd)}
    attention["out/kernel"] = (hd, d)
    mlp = {"mlp/wi_0/kernel": (d, ff), "mlp/wi_1/kernel": (d, ff), "mlp/wo/kernel": (ff, d)}
    shapes = {"token_embedder/embedding": (vocab, d), "decoder/logits_dense/kernel": (d, vocab)}
    for stack, norm in (("encoder", "encoder_norm"), ("decoder", "decoder_norm")):
        shapes[f"{stack}/relpos_bias/rel_embedding"] = (4, 32)
        shapes[f"{stack}/{norm}/scale"] = (d,)
    for i in range(2):
        enc, dec = f"encoder/layers_{i}", f"decoder/layers_{i}"
        for block in ("pre_attention_layer_norm", "pre_mlp_layer_norm"):
            shapes[f"{enc}/{block}/scale"] = (d,)
        for block in ("pre_self_attention", "pre_cross_attention", "pre_mlp"):
            shapes[f"{dec}/{block}_layer_norm/scale"] = (d,)
        for key, shape in attention.items():
            shapes[f"{enc}/attention/{key}"] = shape
            shapes[f"{dec}/self_attention/{key}"] = shape
            shapes[f"{dec}/encoder_decoder_attention/{key}"] = shape
        for key, shape in mlp.items():
            shapes[f"{enc}/{key}"] = shape
            shapes[f"{dec}/{key}"] = shape
    return shapes


def copy_tree(src: Path, dst: Path) -> Path:
    """A writable copy (the fixture directory is read-only)."""
    shutil.copytree(src, dst, copy_function=shutil.copyfile)
    for folder, _, _ in os.walk(dst):
        os.chmod(folder, 0o755)
    return dst


def edit_msgpack(file: Path, edit) -> None:
    """Rewrites a msgpack file after `edit(tree)`; ext values pass through untouched."""
    tree = msgpack.unpackb(file.read_bytes(), raw=False, strict_map_key=False)
    edit(tree)
    file.write_bytes(msgpack.packb(tree, use_bin_type=True))


def kernel_by_hand(checkpoint_dir: Path) -> np.ndarray:
    """gunzip the single chunk; zarr stores C order, '<f8' per the spec."""
    raw = gzip.decompress((checkpoint_dir / KERNEL_DIR / "0.0").read_bytes())
    return np.frombuffer(raw, "<f8").reshape(10, 5)


def assert_one_line(excinfo, *needles: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, (needle, message)


@pytest.fixture(scope="module")
def tiny():
    return open_t5x(TINY)


@pytest.fixture(scope="module")
def flax_tiny():
    return flax.serialization.msgpack_restore(TINY.read_bytes())


@pytest.fixture
def ts_opens(monkeypatch):
    """Records every spec this process hands to tensorstore.open."""
    calls, real_open = [], tensorstore.open

    def spy(spec, *args, **kwargs):
        calls.append(spec)
        return real_open(spec, *args, **kwargs)

    monkeypatch.setattr(tensorstore, "open", spy)
    return calls


# --- the tiny T5.1.1, arrays inline --------------------------------------------------------


def test_tiny_lists_t5_1_1_names_and_shapes(tiny):
    expected = t5_1_1_tiny_shapes()
    assert tiny.names() == sorted(expected)
    assert {name: tiny.shape(name) for name in tiny.names()} == expected
    assert all(tiny.dtype(name) == np.float32 for name in tiny.names())
    assert (tiny.layout, tiny.version, tiny.step) == ("legacy", 3, 0)
    adafactor = {"m", "v", "v_row", "v_col"}
    state = tiny.optimizer_state_names()
    assert len(state) == 1 + 4 * len(expected) and "step" in state
    assert {n.rsplit("/", 1)[1] for n in state if n != "step"} == adafactor
    assert tiny.optimizer_state.shape("param_states/token_embedder/embedding/v") == (32128, 8)


def test_tiny_values_equal_flax_reader(tiny, flax_tiny):
    target = flax_tiny["optimizer"]["target"]
    for name in tiny.names():
        expected = target
        for key in name.split("/"):
            expected = expected[key]
        got = tiny.read(name)
        assert got.dtype == expected.dtype and got.flags.writeable
        np.testing.assert_array_equal(got, expected, err_msg=name)
    v = tiny.optimizer_state.read("param_states/decoder/logits_dense/kernel/v")
    flax_v = flax_tiny["optimizer"]["state"]["param_states"]["decoder"]["logits_dense"]
    np.testing.assert_array_equal(v, flax_v["kernel"]["v"])
    assert tiny.step == int(flax_tiny["optimizer"]["state"]["step"])
    assert [name for name, _ in tiny.items()] == tiny.names()


# --- TensorStore-backed legacy checkpoint ----------------------------------------------


def test_tiny_t5_kernel_equals_gunzip_and_tensorstore():
    checkpoint = open_t5x(TINY_T5)
    assert checkpoint.names() == []  # a toy state: everything is optimizer state
    assert checkpoint.optimizer_state_names() == [
        "param_states/bias", "param_states/kernel", "param_states/step", "step",
    ]  # fmt: skip
    got = checkpoint.optimizer_state.read(KERNEL)
    assert got.dtype == np.float64 and got.shape == (10, 5)
    np.testing.assert_array_equal(got, kernel_by_hand(TINY_T5))

    spec = msgpack.unpackb((TINY_T5 / "checkpoint").read_bytes(), strict_map_key=False)
    spec = spec["optimizer"]["state"]["param_states"]["kernel"]
    spec["kvstore"] = {"driver": "file", "path": str(TINY_T5 / KERNEL_DIR)}
    direct = tensorstore.open(spec, open=True, assume_metadata=True).result().read().result()
    np.testing.assert_array_equal(got, direct)

    bias = np.frombuffer(
        gzip.decompress((TINY_T5 / "state.param_states.bias" / "0").read_bytes()), "<f4"
    )
    np.testing.assert_array_equal(checkpoint.optimizer_state.read("param_states/bias"), bias)
    step = np.frombuffer(
        gzip.decompress((TINY_T5 / "state.param_states.step/0").read_bytes()), "<i4"
    )
    assert checkpoint.step == 1 and checkpoint.optimizer_state.read("param_states/step") == step[0]


def test_bare_file_and_directory_paths_agree():
    by_dir, by_file = open_t5x(TINY_T5), open_t5x(TINY_T5 / "checkpoint")
    np.testing.assert_array_equal(
        by_dir.optimizer_state.read(KERNEL), by_file.optimizer_state.read(KERNEL)
    )


def test_portable_gcs_spec_reads_locally(tmp_path, ts_opens):
    """T5X writes `gcs` + 't5x-dummy-bucket' into checkpoints saved on GCS and reads such
    an array from the checkpoint's own directory; so must we, without touching GCS."""
    ckpt = copy_tree(TINY_T5, tmp_path / "ckpt")
    portable = {"driver": "gcs", "bucket": "t5x-dummy-bucket", "path": KERNEL_DIR}
    edit_msgpack(ckpt / "checkpoint", lambda t: kernel_spec(t).update(kvstore=portable))
    got = open_t5x(ckpt).optimizer_state.read(KERNEL)
    np.testing.assert_array_equal(got, kernel_by_hand(ckpt))
    assert [spec["kvstore"]["driver"] for spec in ts_opens] == ["file"]


def kernel_spec(tree: dict) -> dict:
    return tree["optimizer"]["state"]["param_states"]["kernel"]


# --- Orbax-era T5X --------------------------------------------------------------------------


def orbax_with_zarray(tmp_path: Path) -> Path:
    """tiny_orbax as T5X wrote it: the fixture copy lost each array's `.zarray` (Orbax itself
    refuses it: '.zarray not found ... copying a checkpoint without -a'). Put them back,
    taking shape and dtype from tiny_t5's specs (same toy state) and zstd from the chunks."""
    ckpt = copy_tree(TINY_ORBAX, tmp_path / "orbax")
    specs = msgpack.unpackb((TINY_T5 / "checkpoint").read_bytes(), strict_map_key=False)
    state = specs["optimizer"]["state"]
    leaves = {f"param_states.{k}": v for k, v in state["param_states"].items()}
    leaves["step"] = {"dtype": "int32", "metadata": {"shape": []}}
    for name, spec in leaves.items():
        folder = ckpt / f"_optimizer.state.{name}"
        for chunk in folder.iterdir():
            assert chunk.read_bytes()[:4] == b"\x28\xb5\x2f\xfd"  # zstd frame magic
        shape = spec["metadata"]["shape"]
        zarray = {
            "zarr_format": 2, "shape": shape, "chunks": shape,
            "dtype": np.dtype(spec["dtype"]).str, "compressor": {"id": "zstd", "level": 1},
            "fill_value": None, "order": "C", "filters": None,
        }  # fmt: skip
        (folder / ".zarray").write_text(json.dumps(zarray))
    return ckpt


def test_tiny_orbax_reads_same_values_as_tiny_t5(tmp_path):
    orbax, legacy = open_t5x(orbax_with_zarray(tmp_path)), open_t5x(TINY_T5)
    assert orbax.layout == "orbax" and orbax.names() == []
    assert orbax.optimizer_state_names() == legacy.optimizer_state_names()
    for name in legacy.optimizer_state_names():
        got = orbax.optimizer_state.read(name)
        assert got.dtype == legacy.optimizer_state.dtype(name)
        np.testing.assert_array_equal(got, legacy.optimizer_state.read(name), err_msg=name)
    np.testing.assert_array_equal(orbax.optimizer_state.read(KERNEL), kernel_by_hand(TINY_T5))
    assert orbax.step == 1


def test_orbax_fixture_as_shipped_names_missing_zarray():
    checkpoint = open_t5x(TINY_ORBAX)
    assert checkpoint.optimizer_state_names()[-1] == "step"
    with pytest.raises(ValueError) as excinfo:
        checkpoint.optimizer_state.read(KERNEL)
    assert_one_line(excinfo, "_optimizer/state/param_states/kernel", ".zarray is missing")


# --- hostile metadata ----------------------------------------------------------------------


def _set_kvstore(kvstore):
    return lambda tree: kernel_spec(tree).update(kvstore=kvstore)


def _hostile_cases(outside: Path):
    file = lambda path: {"driver": "file", "path": path}
    return {
        "absolute": (_set_kvstore(file(f"{outside}/")), "is absolute"),
        "etc_passwd": (_set_kvstore(file("../../etc/passwd")), "'..' component"),
        "dotdot_to_real_copy": (_set_kvstore(file("../outside/")), "'..' component"),
        "file_url": (_set_kvstore(file(f"file://{outside}/")), "absolute or a URL"),
        "gcs_bucket": (
            _set_kvstore({"driver": "gcs", "bucket": "evil", "path": KERNEL_DIR}),
            "'gcs' bucket 'evil'",
        ),
        "http": (_set_kvstore({"driver": "http", "path": "x/"}), "'http'"),
        "memory": (_set_kvstore({"driver": "memory", "path": KERNEL_DIR}), "'memory'"),
        "kvstore_url": (_set_kvstore(f"file://{outside}/"), "not a local file store"),
        "base_url": (_set_kvstore({"driver": "file", "base_url": "/"}), "not a local"),
        "cast_base": (
            lambda t: kernel_spec(t).update(base={"driver": "zarr", "kvstore": str(outside)}),
            "['base'] are refused",
        ),
        "two_paths": (lambda t: kernel_spec(t).update(path="../outside/"), "two paths"),
    }


@pytest.mark.parametrize("case", sorted(_hostile_cases(Path("/x"))))
def test_hostile_spec_is_refused_before_any_open(tmp_path, ts_opens, case):
    outside = copy_tree(TINY_T5 / KERNEL_DIR, tmp_path / "outside")  # a valid chunk lure
    ckpt = copy_tree(TINY_T5, tmp_path / "ckpt")
    edit, needle = _hostile_cases(outside)[case]
    edit_msgpack(ckpt / "checkpoint", edit)
    with pytest.raises(ValueError) as excinfo:
        open_t5x(ckpt).optimizer_state.read(KERNEL)
    assert_one_line(excinfo, "optimizer/state/param_states/kernel", needle)
    assert ts_opens == []


def test_symlinked_array_dir_pointing_out_is_refused(tmp_path, ts_opens):
    outside = copy_tree(TINY_T5 / KERNEL_DIR, tmp_path / "outside")
    ckpt = copy_tree(TINY_T5, tmp_path / "ckpt")
    shutil.rmtree(ckpt / KERNEL_DIR)
    (ckpt / KERNEL_DIR).symlink_to(outside, target_is_directory=True)
    with pytest.raises(ValueError) as excinfo:
        open_t5x(ckpt)
    assert_one_line(excinfo, "param_states/kernel", str(outside), "outside")
    assert ts_opens == []


def test_symlinked_chunk_pointing_out_is_refused(tmp_path, ts_opens):
    outside = copy_tree(TINY_T5 / KERNEL_DIR, tmp_path / "outside")
    ckpt = copy_tree(TINY_T5, tmp_path / "ckpt")
    (ckpt / KERNEL_DIR / "0.0").unlink()
    (ckpt / KERNEL_DIR / "0.0").symlink_to(outside / "0.0")
    checkpoint = open_t5x(ckpt)
    with pytest.raises(ValueError) as excinfo:
        checkpoint.optimizer_state.read(KERNEL)
    assert_one_line(excinfo, "param_states/kernel", str(outside / "0.0"))
    assert ts_opens == []
    assert checkpoint.optimizer_state.read("param_states/bias").shape == (5,)


def test_symlink_staying_inside_is_allowed(tmp_path):
    ckpt = copy_tree(TINY_T5, tmp_path / "ckpt")
    (ckpt / KERNEL_DIR).rename(ckpt / "real_kernel")
    (ckpt / KERNEL_DIR).symlink_to(ckpt / "real_kernel", target_is_directory=True)
    got = open_t5x(ckpt).optimizer_state.read(KERNEL)
    np.testing.assert_array_equal(got, kernel_by_hand(TINY_T5))


def test_orbax_placeholder_escaping_is_refused(tmp_path, ts_opens):
    ckpt = copy_tree(TINY_ORBAX, tmp_path / "orbax")
    escape = "PLACEHOLDER://../tiny_t5"

    def edit(tree):
        tree["_optimizer"]["state"]["param_states"]["kernel"] = escape

    edit_msgpack(ckpt / "checkpoint", edit)
    with pytest.raises(ValueError) as excinfo:
        open_t5x(ckpt)
    assert_one_line(excinfo, "_optimizer/state/param_states/kernel", "'../tiny_t5'")
    assert ts_opens == []


def test_resolve_inside_rules(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "link").symlink_to(tmp_path / "a")
    assert resolve_inside(tmp_path, "a/link/b/") == tmp_path.resolve() / "a" / "b"
    (tmp_path / "a" / "up").symlink_to(tmp_path.parent)
    for bad in ("", "/etc", "a/../a", "gs://b/x", "C:/x", "a\\..\\x", "a\x00", "a/up/x"):
        with pytest.raises(ValueError):
            resolve_inside(tmp_path, bad)


# --- corrupt and inconsistent checkpoints --------------------------------------------------


@pytest.mark.parametrize("keep", [0.5, 0.02, 0.0])
def test_truncated_checkpoint_file(tmp_path, keep):
    file = tmp_path / "checkpoint_0"
    data = TINY.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError) as excinfo:
        open_t5x(file)
    assert_one_line(excinfo, str(file), "truncated or corrupt")


def test_missing_or_absent_checkpoint_file(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError) as excinfo:
        open_t5x(tmp_path / "empty")
    assert_one_line(excinfo, "no `checkpoint` msgpack file")
    with pytest.raises(ValueError) as excinfo:
        open_t5x(tmp_path / "nowhere")
    assert_one_line(excinfo, "nowhere", "no such")


def test_missing_chunk_file(tmp_path):
    ckpt = copy_tree(TINY_T5, tmp_path / "ckpt")
    (ckpt / KERNEL_DIR / "0.0").unlink()
    checkpoint = open_t5x(ckpt)
    with pytest.raises(ValueError) as excinfo:
        checkpoint.optimizer_state.read(KERNEL)
    assert_one_line(excinfo, "param_states/kernel", f"{KERNEL_DIR}/0.0 is missing")
    assert checkpoint.step == 1  # the other arrays stay readable


@pytest.mark.parametrize(
    "shape, chunks, needles",
    [
        ([20, 5], [10, 5], ["1.0 is missing", "[20, 5]"]),  # spec larger than the data
        ([5, 5], [5, 5], ["[5, 5] float64", "200 bytes each"]),  # chunk larger than spec
    ],
)
def test_spec_shape_disagreeing_with_data(tmp_path, shape, chunks, needles):
    ckpt = copy_tree(TINY_T5, tmp_path / "ckpt")
    edit = lambda t: kernel_spec(t)["metadata"].update(shape=shape, chunks=chunks)
    edit_msgpack(ckpt / "checkpoint", edit)
    with pytest.raises(ValueError) as excinfo:
        open_t5x(ckpt).optimizer_state.read(KERNEL)
    assert_one_line(excinfo, "param_states/kernel", *needles)


def test_zarray_disagreeing_with_spec(tmp_path):
    ckpt = copy_tree(TINY_T5, tmp_path / "ckpt")
    zarray = {"zarr_format": 2, "shape": [5, 10], "chunks": [5, 10], "dtype": "<f8"}
    (ckpt / KERNEL_DIR / ".zarray").write_text(json.dumps(zarray | {"compressor": None}))
    with pytest.raises(ValueError) as excinfo:
        open_t5x(ckpt).optimizer_state.read(KERNEL)
    assert_one_line(excinfo, "param_states/kernel", "[10, 5] float64", "[5, 10] float64")


def test_inline_header_disagreeing_with_data(tmp_path):
    file = tmp_path / "checkpoint_0"
    file.write_bytes(TINY.read_bytes())

    def edit(tree):
        norm = tree["optimizer"]["target"]["encoder"]["encoder_norm"]
        shape, dtype, data = msgpack.unpackb(norm["scale"].data)
        assert shape == [8]
        norm["scale"] = msgpack.ExtType(1, msgpack.packb(([9], dtype, data)))

    edit_msgpack(file, edit)
    with pytest.raises(ValueError) as excinfo:
        open_t5x(file)
    assert_one_line(excinfo, "encoder/encoder_norm/scale", "[9] float32 (36 bytes)", "32 bytes")


# --- checkpoints written here by TensorStore + flax ----------------------------------------


def write_t5x(folder: Path, zarr_arrays: dict, inline: dict, keep_zarray: bool) -> None:
    """A legacy T5X checkpoint as T5X writes it: TensorStore zarr arrays (gzip, chunked),
    specs with relative paths in a flax-serialized msgpack file."""
    folder.mkdir()
    target = dict(inline)
    for name, (array, chunks) in zarr_arrays.items():
        rel = f"target.{name.replace('/', '.')}"
        dtype = np.dtype(array.dtype).name
        metadata = {"chunks": chunks, "compressor": {"id": "gzip"}, "shape": list(array.shape)}
        spec = {"driver": "zarr", "dtype": dtype, "metadata": metadata}
        store = tensorstore.open(
            spec | {"kvstore": {"driver": "file", "path": str(folder / rel)}}, create=True
        ).result()
        store.write(array).result()
        if not keep_zarray:
            (folder / rel / ".zarray").unlink()
        target[name] = spec | {"kvstore": {"driver": "gfile", "path": f"{rel}/"}}
    nested = flax.traverse_util.unflatten_dict(target, sep="/")
    tree = {"version": 3, "optimizer": {"target": nested, "state": {"step": np.int32(7)}}}
    (folder / "checkpoint").write_bytes(flax.serialization.msgpack_serialize(tree))


@pytest.mark.parametrize("keep_zarray", [False, True])
def test_tensorstore_written_checkpoint_round_trips(tmp_path, monkeypatch, keep_zarray):
    rng = np.random.default_rng(0)
    zarr_arrays = {
        "enc/bf16_kernel": (rng.normal(size=(6, 4)).astype(ml_dtypes.bfloat16), [3, 4]),
        "enc/grid": (rng.normal(size=(4, 6)).astype(np.float32), [2, 3]),
        "scalar": (np.array(2.5, np.float64), []),
    }
    inline = {
        "inline/bf16": rng.normal(size=(3, 5)).astype(ml_dtypes.bfloat16),
        "inline/big": rng.integers(-9, 9, size=(7, 3)).astype(np.int16),
        "inline/np_scalar": np.float32(3.5),  # flax ext type 3
        "inline/complex": complex(1.0, -2.0),  # flax ext type 2
    }
    # flax splits arrays above MAX_CHUNK_SIZE bytes into flat pieces; force it for "big".
    monkeypatch.setattr(flax.serialization, "MAX_CHUNK_SIZE", 16)
    write_t5x(tmp_path / "ckpt", zarr_arrays, inline, keep_zarray)
    raw = (tmp_path / "ckpt" / "checkpoint").read_bytes()
    assert b"__msgpack_chunked_array__" in raw
    checkpoint = open_t5x(tmp_path / "ckpt")
    expected = {name: np.asarray(array) for name, (array, _) in zarr_arrays.items()}
    expected |= {name: np.asarray(value) for name, value in inline.items()}
    assert checkpoint.names() == sorted(expected)
    for name, want in expected.items():
        got = checkpoint.read(name)
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name
        assert (checkpoint.dtype(name), checkpoint.shape(name)) == (want.dtype, want.shape)
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert checkpoint.step == 7


def test_surplus_chunks_reveal_smaller_spec(tmp_path):
    grid = np.arange(24, dtype=np.float32).reshape(4, 6)
    write_t5x(tmp_path / "ckpt", {"grid": (grid, [2, 3])}, {}, keep_zarray=False)
    edit = lambda t: t["optimizer"]["target"]["grid"]["metadata"].update(shape=[2, 6])
    edit_msgpack(tmp_path / "ckpt" / "checkpoint", edit)
    with pytest.raises(ValueError) as excinfo:
        open_t5x(tmp_path / "ckpt").read("grid")
    assert_one_line(excinfo, "optimizer/target/grid", "[2, 6]", "at least [4, 6]")
