"""benchmarks.pod_compile_peer: MaxText's memory line read right, its command built from
the installed package, and a run without MaxText still measuring jaxmoe."""

import json

import pytest

from benchmarks import pod_compile_peer


def load_bench():
    return pod_compile_peer


def test_memory_analysis_line_gives_the_peak():
    # The line MaxText 0.2.5 printed for Mixtral-8x7B on v5p-256 (bytes per chip).
    log = (
        "Jitting and compilation complete!\nMemory analysis: CompiledMemoryStats("
        "generated_code_size_in_bytes=59003904, argument_size_in_bytes=4381904896, "
        "output_size_in_bytes=4381869856, alias_size_in_bytes=4381863936, "
        "temp_size_in_bytes=5322735616, host_generated_code_size_in_bytes=0, "
        "host_argument_size_in_bytes=0, host_output_size_in_bytes=0, "
        "host_alias_size_in_bytes=0, host_temp_size_in_bytes=0)\n"
    )
    stats = load_bench().parse_memory_analysis(log)
    # 4381904896 + 4381869856 - 4381863936 + 5322735616 + 59003904, worked out by hand:
    assert stats["peak_hbm_bytes"] == 9_763_650_336
    assert stats["argument_bytes"] == 4_381_904_896
    assert stats["temp_bytes"] == 5_322_735_616
    with pytest.raises(RuntimeError, match="Memory analysis"):
        load_bench().parse_memory_analysis("Traceback ...")


def test_maxtext_command_uses_the_installed_base_config(tmp_path):
    bench = load_bench()
    base = tmp_path / "lib/python3.12/site-packages/maxtext/configs/base.yml"
    base.parent.mkdir(parents=True)
    base.write_text("")
    command = bench.maxtext_command(tmp_path, bench.CASES["mixtral_8x7b"], "/out")
    assert command[:4] == [
        str(tmp_path / "bin/python"),
        "-m",
        "maxtext.trainers.pre_train.train_compile",
        str(base),
    ]
    for setting in ("compile_topology=v5p-256", "model_name=mixtral-8x7b",
                    "ici_fsdp_parallelism=16", "ici_expert_parallelism=8",
                    "per_device_batch_size=1", "max_target_length=2048",
                    "base_output_directory=/out"):  # fmt: skip
        assert setting in command
    with pytest.raises(RuntimeError, match=r"base\.yml"):
        bench.maxtext_command(tmp_path / "elsewhere", bench.CASES["mixtral_8x7b"], "/out")


def test_without_maxtext_jaxmoe_is_still_measured(tmp_path, capsys, monkeypatch):
    pytest.importorskip("libtpu", reason="the `tpu` extra is not installed: no libtpu")
    bench = load_bench()
    tiny = ["configs/default.py", "--config.model.num_layers=1", "--config.model.d_model=128",
            "--config.model.num_heads=2", "--config.model.num_kv_heads=1",
            "--config.model.head_dim=64", "--config.model.moe.ffn_dim=128",
            "--config.model.vocab_size=256", "--config.train.batch_size=8",
            "--config.train.seq_len=128", "--config.mesh.data=1",
            "--config.mesh.expert=4"]  # fmt: skip
    monkeypatch.setattr(
        bench, "CASES", {"tiny": {"topology": "v5p-8", "jaxmoe": tiny, "maxtext": []}}
    )
    argv = ["--cases", "tiny", "--maxtext_venv", str(tmp_path / "none"), "--json", "-"]
    assert bench.main(argv) == 0
    captured = capsys.readouterr()
    assert "MaxText is not installed" in captured.err
    result = json.loads(captured.out.strip().splitlines()[-1])
    (row,) = result["rows"]
    assert "maxtext" not in row and row["jaxmoe"]["verdict"] == "fits"
    assert 0 < row["jaxmoe"]["peak_hbm_bytes"] < 95.74 * 2**30
    assert row["jaxmoe"]["wall_s"] > 0 and isinstance(result["quiet"], bool)
    assert "| tiny | v5p-8 | jaxmoe |" in captured.out


def test_gpu_cases_run_maxtext_on_jaxmoes_devices_at_one_sequence_per_gpu(tmp_path):
    """MaxText runs through benchmarks/maxtext_gpu_compile.py on the same cluster name; both
    systems take one 4096-token sequence per GPU (MaxText counts its per-device batch over
    one 8-GPU node, so it is x nodes)."""
    from jaxmoe.aot.topologies import parse_target

    bench = load_bench()
    command = bench.maxtext_command(tmp_path, bench.CASES["mixtral_8x7b_h100"], "/out")
    assert command[:4] == [
        str(tmp_path / "bin/python"),
        "-m",
        "benchmarks.maxtext_gpu_compile",
        "h100-32",
    ]
    for setting in ("model_name=mixtral-8x7b", "ici_fsdp_parallelism=4",
                    "ici_expert_parallelism=8", "attention=cudnn_flash_jax", "megablox=false",
                    "base_output_directory=/out"):  # fmt: skip
        assert setting in command
    for name, case in bench.GPU_CASES.items():
        gpus = parse_target(case["topology"]).num_chips
        settings = dict(s.split("=", 1) for s in case["maxtext"])
        assert int(settings["per_device_batch_size"]) * 8 == gpus, name
        assert settings["max_target_length"] == "4096"
        batch = [a for a in case["jaxmoe"] if a.startswith("--config.train.batch_size=")]
        assert batch == [f"--config.train.batch_size={gpus}"], name


def test_a_failed_maxtext_run_is_named_by_its_exception_line():
    from benchmarks.pod_compile_peer import error_line

    # The tail of MaxText 0.2.5's log for Mixtral with quantization=int8 (2026-12-06).
    log = """I1206 15:20:01 train_compile.py:120] compiling
jax.errors.JaxRuntimeError: INTERNAL: Mosaic failed to compile TPU kernel: unsupported shape cast

The above exception was the direct cause of the following exception:

--------------------
For simplicity, JAX has removed its internal frames from the traceback of the following exception. Set JAX_TRACEBACK_FILTERING=off to include these.
Please report a bug at: https://github.com/jax-ml/jax/issues/new/choose
"""  # noqa: E501
    assert error_line(log).startswith("jax.errors.JaxRuntimeError: INTERNAL: Mosaic failed")
    assert (
        error_line("AssertionError: v=768 bv=1024 s=768\n") == "AssertionError: v=768 bv=1024 s=768"
    )
    assert error_line("no exception here\nlast words\n") == "last words"
