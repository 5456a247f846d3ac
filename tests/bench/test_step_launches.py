"""scripts/step_launches.py: the launches of an optimized HLO module's entry computation, grouped by kind and origin."""

from scripts.step_launches import launches

MODULE = """HloModule jit_train_step

%fused_computation (p: f32[4]) -> f32[] {
  %p = f32[4]{0} parameter(0)
  ROOT %fusion.9 = f32[4]{0} fusion(%p), kind=kLoop, calls=%inner, metadata={op_name="jit(train_step)/not_entry"}
}

ENTRY %main (a: f32[4], b: bf16[4]) -> f32[] {
  %a = f32[4]{0} parameter(0)
  %b = bf16[4]{0} parameter(1)
  %fusion.1 = f32[] fusion(%a), kind=kInput, calls=%r, metadata={op_name="jit(train_step)/reduce_sum"}
  %fusion.2 = f32[] fusion(%a), kind=kInput, calls=%r, metadata={op_name="jit(train_step)/reduce_sum"}
  %fusion.3 = bf16[4]{0} fusion(%a), kind=kLoop, calls=%c, metadata={op_name="jit(s)/Transformer/convert_element_type"}
  %ffi_call.1 = bf16[4]{0} custom-call(%b), custom_call_target="ls_ln", metadata={op_name="jit(s)/Transformer/ffi_call"}
  ROOT %t = (f32[]) tuple(%fusion.1)
}
"""


def test_entry_launches_are_counted_by_kind_and_origin():
    assert launches(MODULE) == {
        ("kInput", "reduce_sum"): 2,
        ("kLoop", "model: convert_element_type"): 1,
        ("custom-call", "model: ffi_call"): 1,
    }
