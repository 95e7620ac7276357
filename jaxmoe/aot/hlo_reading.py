"""Reading a compiled program's HLO text: its collectives by kind, the bytes its all-to-alls
move, its cross-slice transfers (TPU multislice), and on NVIDIA GPUs its cuDNN attention
calls, how XLA lowered its grouped matmuls (`ragged_dot`) and which collectives leave a host
or an NVLink domain. Each instruction counts once (loop bodies are not unrolled).

Device positions: a collective's replica groups name SPMD partitions, which are the
positions of the mesh's devices in `mesh.devices.flat`.
"""

import math
import re

import numpy as np

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",  # the expert-parallel exchange sized to the routing
    "collective-permute",
)


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Collective ops in a compiled HLO module, by kind (each op once, loops not unrolled).

    Counts plain and async (`-start`) ops, and the TPU's fused collectives (a kCustom fusion
    calling e.g. %all-reduce-scatter.3) by their fusion, not the ops inside them.
    """
    counts = dict.fromkeys(COLLECTIVES, 0)
    kind_of_name = [("all-reduce-scatter", "reduce-scatter")] + [(k, k) for k in COLLECTIVES]

    def kind(name: str) -> str | None:
        return next((k for prefix, k in kind_of_name if name.startswith(prefix)), None)

    fused_bodies = set()
    for match in re.finditer(r"^%([\w.-]+) \(", hlo_text, re.MULTILINE):
        if kind(match.group(1)):
            fused_bodies.add(match.group(1))
    body = None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%([\w.-]+) \(", line)
        if header:
            body = header.group(1)
            continue
        if body in fused_bodies:
            continue
        called = re.search(r"\bcalls=%([\w.-]+)", line)
        if called and called.group(1) in fused_bodies:
            counts[kind(called.group(1))] += 1
            continue
        op = re.search(r"= .*?\s([a-z-]+)(?<!-done)\(", line)
        if op:
            name = op.group(1).removesuffix("-start")
            if name in counts:
                counts[name] += 1
    return counts


_DEFINITION = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = (\w+)\[", re.MULTILINE)
_TYPED = r"(?:(\w+)\[[^\]]*\](?:\{[^}]*\})? )?"  # an operand's type, where the text prints it
_DOT = re.compile(
    r"^\s*(?:ROOT )?%[\w.-]+ = (\w+)\[[^=]*? (?:dot|convolution|ragged-dot)\("
    + _TYPED
    + r"%([\w.-]+), "
    + _TYPED
    + r"%([\w.-]+)",
    re.MULTILINE,
)


def count_dot_types(hlo_text: str) -> dict[str, int]:
    """Matrix products in a compiled HLO module by operand and result types ("s8 x s8 ->
    s32": int8 products, "f8e4m3fn x f8e4m3fn -> f32": fp8 ones), fused bodies included,
    each instruction once (loops not unrolled): where model.quantization shows."""
    types = dict(_DEFINITION.findall(hlo_text))  # instruction names are unique per module
    counts: dict[str, int] = {}
    for out, lhs_type, lhs, rhs_type, rhs in _DOT.findall(hlo_text):
        lhs_type, rhs_type = lhs_type or types.get(lhs, "?"), rhs_type or types.get(rhs, "?")
        key = f"{lhs_type} x {rhs_type} -> {out}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}


def all_to_all_bytes(hlo_text: str) -> int:
    """Bytes the all-to-all ops' results hold, per device, each op once (loop bodies once).

    A padded all_to_all moves all of it whatever the routing. Ragged all-to-alls are left
    out: their output shapes only bound the rows that the routing moves at run time.
    """
    total = 0
    for result in re.findall(r"= (\(.*?\)|\S+) all-to-all(?:-start)?\(", hlo_text):
        for dtype, dims in re.findall(r"([a-z]+\d*)\[([\d,]*)\]", result):
            size = math.prod(int(d) for d in dims.split(",") if d)
            total += size * _DTYPE_BYTES.get(dtype, 8 if dtype.endswith("64") else 4)
    return total


def count_dcn_transfers(hlo_text: str) -> dict[str, int]:
    """Cross-slice (data-center network) transfers in a multislice program, by kind.

    The TPU compiler turns each slice's share of a cross-slice collective into a host
    transfer to the multislice runtime (a `send` tagged `_xla_megascale_transfer_type`,
    e.g. ALL_REDUCE); collectives inside a slice stay ordinary HLO collectives.
    """
    counts: dict[str, int] = {}
    for line in hlo_text.splitlines():
        if " send(" not in line:
            continue
        kind = re.search(r'_xla_megascale_transfer_type="(\w+)"', line)
        if kind:
            counts[kind.group(1)] = counts.get(kind.group(1), 0) + 1
    return counts


_INSTRUCTION = re.compile(r"=\s*(?:\(.*?\)|\S+)\s+([a-z-]+)\(")
_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


CUDNN_ATTENTION = r'custom_call_target="(__cudnn\$fmha\w*)"'


def _split_peeled(hlo_text: str) -> tuple[str, str]:
    """(the module without, only) the computations that are peeled loop iterations.

    XLA's GPU collective pipeliner moves a loop's reduce-scatter into the next iteration to
    overlap it, and peels one iteration out of the loop to do so: a copy of the loop body
    whose parameter is `loop_peel_param`. Its calls run once per step, like the body's, but
    they are one more call site; counted apart, a scanned model's attention still shows
    one forward and one backward call in its loop.
    """
    kept, peeled = [], []
    for computation in re.split(r"\n(?=\S)", hlo_text):
        header = computation.split("\n", 1)[0]
        (peeled if "(loop_peel_param" in header else kept).append(computation)
    return "\n".join(kept), "\n".join(peeled)


def gpu_kernels(hlo_text: str) -> dict:
    """cuDNN fused attention calls (forward, backward; those in peeled loop iterations
    apart) and the lowering of `ragged_dot`.

    `ragged_dot` becomes a cuDNN grouped-GEMM fusion (a `ragged-dot` survives in its body)
    only with --xla_gpu_experimental_use_ragged_dot_fusion and cuDNN >= 9.21; otherwise XLA
    rewrites it into dense dots over every group (counted by their `ragged_dot_general`
    metadata).
    """
    program, peeled = _split_peeled(hlo_text)
    calls = re.findall(CUDNN_ATTENTION, program)
    backward = sum(1 for call in calls if "Backward" in call)
    dense = sum(
        1
        for line in hlo_text.splitlines()
        if re.search(r"\sdot\(", line) and "ragged_dot_general" in line
    )
    grouped = len(re.findall(r"\sragged-dot\(", hlo_text))
    lowering = None
    if grouped:
        lowering = "cuDNN grouped GEMM"
    elif dense:
        lowering = "dense dots over every group (XLA's rewrite)"
    return {
        "cudnn_attention_forward": len(calls) - backward,
        "cudnn_attention_backward": backward,
        "cudnn_attention_peeled": len(re.findall(CUDNN_ATTENTION, peeled)),
        "grouped_gemms": grouped,
        "ragged_dot_dense_dots": dense,
        "ragged_dot_lowering": lowering,
    }


def replica_groups(line: str) -> list[list[int]] | None:
    """The device positions each group of a collective instruction spans; [] = one group of
    every device; None if the line names no groups (or a form this does not read)."""
    if match := _MESH.search(line):
        axes = re.findall(r"'(\w+)'=(\d+)", match.group(1))
        names = [name for name, _ in axes]
        sizes = [int(size) for _, size in axes]
        items = [item.strip() for item in match.group(2).split(",")]
        if not all(re.fullmatch(r"'\w+'", item) for item in items):
            return None  # sub-axis groups ('x':(1)2): not read
        grouped = [item.strip("'") for item in items]
        if not set(grouped) <= set(names):
            return None
        positions = np.arange(math.prod(sizes)).reshape(sizes)
        order = [i for i, n in enumerate(names) if n not in grouped] + [
            names.index(n) for n in grouped
        ]
        size = math.prod(sizes[names.index(n)] for n in grouped)
        return positions.transpose(order).reshape(-1, size).tolist()
    if match := _IOTA.search(line):
        shape = [int(d) for d in match.group(1).split(",")]
        dims = [int(d) for d in match.group(2).split(",")]
        positions = np.arange(math.prod(dims)).reshape(dims)
        if match.group(3):
            positions = positions.transpose([int(p) for p in match.group(3).split(",")])
        return positions.reshape(shape).tolist()
    if match := _EXPLICIT.search(line):
        groups = re.findall(r"\{([\d,]*)\}", match.group(1))
        return [[int(i) for i in group.split(",") if i] for group in groups]
    if match := _PAIRS.search(line):
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", match.group(1))]
    return None


def collectives_across(hlo_text: str, owner_of_position: list[int]) -> dict[str, int]:
    """Collective instructions, by kind, of which some group spans devices of more than one
    owner (`owner_of_position[p]`: the host or NVLink domain of the device at position p).
    A group this cannot read counts as crossing (the safe side for a network estimate)."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    everyone = [list(range(len(owner_of_position)))]
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.search(line)
        if not match:
            continue
        kind = match.group(1).removesuffix("-start")
        if kind not in counts:
            continue
        groups = replica_groups(line)
        if groups is None and ("replica_groups=" in line or "source_target_pairs=" in line):
            counts[kind] += 1
            continue
        for group in groups or everyone:
            if len({owner_of_position[p] for p in group}) > 1:
                counts[kind] += 1
                break
    return counts
