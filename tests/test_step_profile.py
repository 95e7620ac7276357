# ruff: noqa: E501  (the compiled HLO fixture keeps its lines whole, as XLA prints them)
"""benchmarks/step_profile.py: compiled HLO read into instructions, kinds and source places
(checked against a hand-written module with hand-labelled answers), ATen ops sorted into
the same kinds, and the whole benchmark run once on the tiny Mixtral (slow)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.step_profile import hlo_instructions, jax_kind, jax_place, opcode_of, torch_kind

ROOT = Path(__file__).resolve().parents[1]

HLO = """\
HloModule jit_train_step, entry_computation_layout={(f32[4,8]{1,0})->f32[4,4]{1,0}}

FileNames
1 "/x/jaxmoe/training/steps.py"
2 "/x/jaxmoe/models/moe/routing.py"

FunctionNames
1 "train_step"
2 "route"

FileLocations
1 {file_name_id=1 function_name_id=1 line=3 end_line=3 column=4 end_column=64}
2 {file_name_id=2 function_name_id=2 line=7 end_line=7 column=9 end_column=20}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}

%fused_dot (param_0.1: f32[4,8], param_1.2: f32[8,4]) -> f32[4,4] {
  %param_0.1 = f32[4,8]{1,0} parameter(0)
  %param_1.2 = f32[8,4]{1,0} parameter(1)
  ROOT %dot.3 = f32[4,4]{1,0} dot(%param_0.1, %param_1.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_gather (param_0.4: f32[16,4], param_1.5: s32[4,1]) -> f32[4,4] {
  %param_0.4 = f32[16,4]{1,0} parameter(0)
  %param_1.5 = s32[4,1]{1,0} parameter(1)
  ROOT %gather.6 = f32[4,4]{1,0} gather(%param_0.4, %param_1.5), offset_dims={1}
}

%fused_transpose (param_0.7: f32[4,4]) -> f32[4,4] {
  %param_0.7 = f32[4,4]{1,0} parameter(0)
  ROOT %transpose.8 = f32[4,4]{0,1} transpose(%param_0.7), dimensions={1,0}
}

%fused_adam (param_0.9: f32[4,4]) -> f32[4,4] {
  %param_0.9 = f32[4,4]{1,0} parameter(0)
  ROOT %multiply.10 = f32[4,4]{1,0} multiply(%param_0.9, %param_0.9)
}

ENTRY %main.20 (Arg_0.1: f32[4,8], Arg_1.2: f32[8,4], Arg_2.3: f32[16,4], Arg_3.4: s32[4,1]) -> (f32[4,4], f32[4,4]) {
  %Arg_0.1 = f32[4,8]{1,0} parameter(0)
  %Arg_1.2 = f32[8,4]{1,0} parameter(1)
  %Arg_2.3 = f32[16,4]{1,0} parameter(2)
  %Arg_3.4 = s32[4,1]{1,0} parameter(3)
  %dot_fusion = f32[4,4]{1,0} fusion(%Arg_0.1, %Arg_1.2), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(train_step)/jvp(moe)/dot_general" source_file="/x/jaxmoe/models/grouped_ffn.py" source_line=40}
  %gather_fusion = f32[4,4]{1,0} fusion(%Arg_2.3, %Arg_3.4), kind=kLoop, calls=%fused_gather, metadata={op_name="jit(train_step)/transpose(jvp(moe))/gather" source_file="/x/jaxmoe/models/grouped_ffn.py" source_line=51}
  %transpose_fusion = f32[4,4]{0,1} fusion(%dot_fusion), kind=kLoop, calls=%fused_transpose, metadata={op_name="jit(train_step)/transpose" source_file="/x/jaxmoe/models/attention.py" source_line=9}
  %adam_fusion = f32[4,4]{1,0} fusion(%gather_fusion), kind=kLoop, calls=%fused_adam, metadata={op_name="jit(train_step)/mul" source_file="/v/site-packages/optax/_src/transform.py" source_line=3}
  %sort.11 = (f32[4]{0}, s32[4]{0}) sort(%Arg_0.1, %Arg_3.4), dimensions={0}, to_apply=%cmp, metadata={op_name="jit(train_step)/sort" stack_frame_id=2}
  ROOT %tuple.12 = (f32[4,4]{1,0}, f32[4,4]{1,0}) tuple(%transpose_fusion, %adam_fusion)
}
"""


def test_compiled_hlo_gives_each_instruction_its_kind_and_place():
    instructions, computations = hlo_instructions(HLO)
    assert computations["fused_dot"] == {"parameter", "dot"}
    assert computations["main.20"] >= {"fusion", "sort", "tuple", "parameter"}
    expected = {
        "dot_fusion": ("matmul", "grouped_ffn.py forward"),
        "gather_fusion": ("gather/scatter", "grouped_ffn.py backward"),
        "transpose_fusion": ("copy/layout", "attention.py forward"),
        "adam_fusion": ("optimizer", "transform.py forward"),
        "sort.11": ("gather/scatter", "routing.py forward"),
    }
    for name, (kind, place) in expected.items():
        assert jax_kind(instructions[name], computations) == kind, name
        assert jax_place(instructions[name]) == place, name
    assert instructions["dot_fusion"][1] == "fused_dot"


def test_opcode_is_read_past_tuple_shapes_and_layouts():
    assert opcode_of("f32[2,3]{1,0} fusion(f32[2] %p), kind=kLoop") == "fusion"
    assert opcode_of("(f32[4]{0}, s32[4]{0}) sort(%a, %b), dimensions={0}") == "sort"
    assert opcode_of("f32[] constant(0)") == "constant"


@pytest.mark.parametrize(
    "name, kind",
    [
        ("aten::mm", "matmul"),
        ("aten::addmm", "matmul"),
        ("aten::_grouped_mm", "matmul"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention kernel"),
        ("aten::_foreach_addcdiv_", "optimizer"),
        ("AdamW.step/aten::mul_", "optimizer"),
        ("aten::index_add_", "gather/scatter"),
        ("aten::embedding_dense_backward", "gather/scatter"),
        ("aten::copy_", "copy/layout"),
        ("aten::cat", "copy/layout"),
        ("aten::mul", "other"),
        ("aten::silu_backward", "other"),
    ],
)
def test_aten_ops_fall_into_the_same_kinds(name, kind):
    assert torch_kind(name) == kind


@pytest.mark.slow
def test_profiles_both_steps_and_attributes_most_of_jaxmoes_op_time(tmp_path):
    out = tmp_path / "profile.json"
    command = [sys.executable, "-m", "benchmarks", "step_profile", "--variant", "top2",
               "--steps", "2", "--warmup", "1", "--json", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    jax_result, torch_result = result["systems"]
    assert (jax_result["system"], torch_result["system"]) == ("jaxmoe", "hf")
    for system in (jax_result, torch_result):
        assert system["kinds_s"]["matmul"] > 0
        assert sum(system["kinds_s"].values()) == pytest.approx(system["op_s"])
    # The trace's ops are found in the compiled HLO: ops ran for most of the wall time.
    assert jax_result["outside_ops_s"] < 0.5 * jax_result["wall_s"]
    assert any(place.startswith("grouped_ffn.py") for place in jax_result["modules_s"])
    assert result["host"]["cpu_model"]
