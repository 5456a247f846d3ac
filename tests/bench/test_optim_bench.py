"""train.bench.optim: the benchmarked models' sizes, its byte and kernel counts, and a --quick run on CPU."""

import json

import numpy as np

from train.bench import optim


def _parameters(shapes):
    return sum(int(np.prod(shape)) for shape in shapes)


def test_model_shapes_have_the_published_sizes():
    assert _parameters(optim.MODELS["bert-base"].shapes()) == 109_482_240  # bert-base-uncased, pooler included
    transformer = optim.MODELS["transformer-big"].shapes()
    assert _parameters(transformer) == 209_915_904  # 6+6 layers, 1024/4096, shared 32768-token embedding
    assert transformer[0] == (32768, 1024) and transformer.count((32768, 1024)) == 1
    # ls_jax's transformer-big-12e12d preset has these parameters too
    assert _parameters(optim.MODELS["transformer-big-12e12d"].shapes()) == 386_273_280


def test_quick_stand_ins_are_named_as_what_they_are():
    for name, model in optim.MODELS.items():
        quick_name, shapes = model.measured(name, quick=True)
        assert quick_name != name and "big" not in quick_name and "base" not in quick_name
        assert _parameters(shapes) < _parameters(model.shapes()) / 100
    assert optim.MODELS["bert-base"].measured("bert-base", quick=False)[0] == "bert-base"


def test_byte_and_kernel_counts():
    shapes = [(3, 5), (7,)]
    assert optim.step_bytes(shapes, moments=4, clip=False) == 22 * 44
    assert optim.step_bytes(shapes, moments=2, clip=True) == 22 * 32
    hlo = """
  %fusion.1 = f32[8]{0} fusion(f32[8]{0} %p), kind=kLoop, calls=%fused_computation
  %custom-call.2 = (f32[8]{0}) custom-call(f32[8]{0} %fusion.1), custom_call_target="ls_optim_step"
  %add.3 = f32[8]{0} add(f32[8]{0} %a, f32[8]{0} %b)
"""
    assert optim.kernel_count(hlo) == 2


def test_quick_run_writes_results_under_the_stand_in_name(tmp_path, capsys):
    assert optim.main(["--quick", "--models", "bert-base", "--out", str(tmp_path)]) == 0
    assert "bert-base" not in capsys.readouterr().out
    (path,) = tmp_path.glob("optim-*.json")
    report = json.loads(path.read_text())
    assert report["suite"] == "optim" and report["quick"] is True
    assert list(report["models"]) == ["bert-2l-d64"]
    model = report["models"]["bert-2l-d64"]
    shapes = optim.MODELS["bert-base"].quick_shapes()
    assert model["leaves"] == len(shapes) and model["copy_bytes"] == optim.working_set_bytes(shapes)
    for variant in ("adan", "adamw", "adan_clip"):
        for implementation in ("ls_jax_xla", "optax"):
            result = model["results"][variant][implementation]
            assert result["median_ms"] > 0 and result["kernels"] > 0 and result["bytes"] > 0
            # The copy is measured at the step's size, in place: a step moves at most as fast as it (timing noise
            # of a shared 2-core machine allowed for).
            assert result["fraction_of_copy_bandwidth"] < 1.25
    assert model["speedups"]["adan: ls_jax_xla vs optax"] > 0
