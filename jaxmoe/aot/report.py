"""The table `jaxmoe compile` prints from compile_check's report dict, and its verdict line."""

from jaxmoe.parallel.chips import GiB


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{kind} {n}" for kind, n in counts.items() if n) or "none"


def _where(result: dict) -> str:
    """What was compiled for: a TPU slice (x slices) or a GPU cluster."""
    if result.get("platform") == "gpu":
        gpu = result["gpu"]
        domains = gpu["nvlink_domains"]
        domains = "one NVLink domain" if domains == 1 else f"{domains} NVLink domains"
        return (
            f"{result['topology']}: {result['num_chips']} x {gpu['device_kind']} "
            f"({gpu['hosts']} hosts of {gpu['gpus_per_host']}, {domains}; "
            f"CUDA {gpu['cuda_runtime']}, cuDNN {gpu['cudnn']})"
        )
    slices = f" x {result['num_slices']} slices" if result["num_slices"] > 1 else ""
    return (
        f"{result['topology']}{slices}: {result['num_chips']} chips ({result['libtpu_topology']})"
    )


def _memory_rows(result: dict) -> list[tuple[str, str]]:
    usable = f"{_gib(result['hbm_bytes'])} usable"
    if result.get("platform") == "gpu":
        gpu = result["gpu"]
        usable += (
            f" = {gpu['memory_fraction']:.0%} of {_gib(gpu['memory_bytes'])} "
            f"(XLA_CLIENT_MEM_FRACTION)"
        )
    peak = result["peak_hbm_bytes"]
    return [
        ("arguments / device", _gib(result["argument_bytes"])),
        ("temporaries / device", _gib(result["temp_bytes"])),
        ("peak memory / device", f"{_gib(peak)} of {usable} ({peak / result['hbm_bytes']:.0%})"),
        ("headroom / device", _gib(result["headroom_bytes"])),
    ]


def _gpu_rows(result: dict) -> list[tuple[str, str]]:
    kernels = result["gpu_kernels"]
    attention = (
        f"{kernels['cudnn_attention_forward']} forward, "
        f"{kernels['cudnn_attention_backward']} backward"
    )
    if kernels.get("cudnn_attention_peeled"):  # absent from reports written before it
        attention += f" (+{kernels['cudnn_attention_peeled']} in peeled loop iterations)"
    rows = [("cuDNN flash attention", attention)]
    if kernels["ragged_dot_lowering"]:
        rows.append(("grouped matmuls", kernels["ragged_dot_lowering"]))
    rows += [
        ("across hosts", _counts(result["collectives_across_hosts"])),
        ("across NVLink domains", _counts(result["collectives_across_domains"])),
    ]
    return rows


def format_report(result: dict, config_name: str = "") -> str:
    """The human-readable table `jaxmoe compile` prints."""
    mesh = " ".join(f"{axis}={size}" for axis, size in result["mesh"].items())
    rows = [
        ("config", config_name or "-"),
        ("topology", _where(result)),
        ("mesh", mesh),
        *([("MoE grouping", result["moe_grouping"])] if result.get("moe_grouping") else []),
        ("parameters", f"{result['num_params'] / 1e9:.3f} B"),
        ("params / device", _gib(result["param_bytes_per_device"])),
        ("optimizer / device", _gib(result["optimizer_bytes_per_device"])),
        ("batch / device", _gib(result["batch_bytes_per_device"])),
    ]
    if "peak_hbm_bytes" in result:
        rows += _memory_rows(result)
    rows.append(("model FLOPs / step", f"{result['model_flops_per_step']:.3e}"))
    if result.get("hlo_flops_per_device"):
        hlo = result["hlo_flops_per_device"] * result["num_chips"]
        rows.append(("compiled FLOPs / step", f"{hlo:.3e} (loop bodies counted once)"))
    if result.get("pallas_kernels"):
        kernels = ", ".join(f"{k} {v}" for k, v in sorted(result["pallas_kernels"].items()))
        rows.append(("Pallas kernels", kernels))
    if "gpu_kernels" in result:
        rows += _gpu_rows(result)
    if "estimate_note" in result:
        if result["estimated_step_s"]:
            estimate = f"{result['estimated_step_s']:.3g} s (MFU {result['estimated_mfu']:.1%})"
        else:
            estimate = f"n/a: {result['estimate_note']}"
        rows.append(("compiler's step estimate", estimate))
    if result["mfu"] is not None:
        rows.append((f"MFU at {result['step_time_s']:g} s/step", f"{result['mfu']:.1%}"))
    rows.append(("step time at 100% MFU", f"{result['ideal_step_time_s']:.3g} s"))
    if "collectives" in result:
        rows.append(
            ("collectives", ", ".join(f"{k} {v}" for k, v in result["collectives"].items()))
        )
    if result.get("all_to_all_bytes"):
        size = result["all_to_all_bytes"]
        text = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"
        rows.append(("all-to-all / device", text))
    if result.get("dcn_transfers"):
        transfers = ", ".join(f"{k.lower()} {v}" for k, v in result["dcn_transfers"].items())
        rows.append(("across slices (DCN)", transfers))
    if "error" in result:
        rows.append(("compiler", result["error"]))
    rows.append(("compile time", f"{result['lower_s']:.1f} s lower + {result['compile_s']:.1f} s"))
    width = max(len(name) for name, _ in rows)
    lines = [f"  {name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines) + "\n" + verdict_line(result)


def verdict_line(result: dict) -> str:
    gpu = result.get("platform") == "gpu"
    device = "GPU" if gpu else "chip"
    where = result["topology"]
    if result["num_slices"] > 1 and not gpu:
        where += f" x {result['num_slices']}"
    if result["verdict"] == "fits":
        return (
            f"verdict: fits on {where}: peak {_gib(result['peak_hbm_bytes'])} of "
            f"{_gib(result['hbm_bytes'])} usable per {device}, "
            f"headroom {_gib(result['headroom_bytes'])}"
        )
    state = result["param_bytes_per_device"] + result["optimizer_bytes_per_device"]
    need = result.get("required_bytes", result.get("peak_hbm_bytes"))
    needs = f"needs {_gib(need)}" if need else "does not fit"
    return (
        f"verdict: OUT OF MEMORY on {where}: {needs} per {device}, {_gib(result['hbm_bytes'])} "
        f"usable (params+optimizer alone {_gib(state)}); shard more (mesh.fsdp / "
        f"mesh.tensor / mesh.expert), raise train.grad_accum or set model.remat=full"
    )
