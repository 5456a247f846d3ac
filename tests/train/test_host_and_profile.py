"""What a run says about its host and what ``--profile-steps`` leaves: the summary's ``host_phases``, the trace of
the chosen steps, ``python -m train.bench timeline`` over it, and the timeline's arithmetic on a trace of known
kernels."""

import argparse
import json

import pytest
from test_train_wmt import compilation_cache, corpus_dir, small_job  # noqa: F401 - fixtures

from train.bench import timeline
from train.errors import EXIT_USAGE
from train.harness import cli
from train.harness.host_phases import PHASES, HostPhases
from train.harness.training import run_training
from train.records import runlog
from train.wmt import task as wmt


def test_a_profiled_run_reports_its_host_and_leaves_a_trace_of_those_steps(
    tmp_path,
    compilation_cache,  # noqa: F811
    corpus_dir,  # noqa: F811
    capsys,
):
    run_dir = tmp_path / "run"
    job = small_job(corpus_dir, run_dir, "--steps", "6", "--log-every", "3", "--profile-steps", "3:4")
    assert run_training(wmt.TASK, job) == 0
    summary = runlog.read(run_dir / runlog.LOG_FILENAME)[-1]
    host = summary["host_phases"]
    assert host["steps"] == 6 and set(host) == {"steps", "host_bound", *(f"{phase}_ms" for phase in PHASES)}
    assert all(host[f"{phase}_ms"] >= 0 for phase in PHASES) and host["launch_ms"] > 0
    assert host["host_bound"] is False  # a CPU computes the step inside its launch: it never waits for the host
    assert "  host        batch " in capsys.readouterr().out

    profile = run_dir / "profile"
    (trace,) = timeline.trace_files(profile)
    assert trace.relative_to(profile).parts[0] == "process0"
    assert timeline.traced_steps(profile) == 2
    assert timeline.main([str(profile), "--out", str(tmp_path / "timeline.json")]) == 0
    (result,) = json.loads((tmp_path / "timeline.json").read_text()).values()
    assert result["steps"] == 2 and result["devices"] == {}  # a CPU's trace has no GPU kernels
    times = [event["ms_per_step"] for event in result["host"]]
    assert times and times == sorted(times, reverse=True)  # the host's events, longest first


def test_profile_steps_take_a_range_of_steps_from_one():
    assert cli.step_range("100:104") == [100, 104] and cli.step_range("7") == [7, 7]
    for bad in ("0:3", "5:4", "a:b", "3:"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli.step_range(bad)


def test_a_bad_profile_range_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        run_training(wmt.TASK, ["--profile-steps", "9:2", "--run-dir", str(tmp_path / "r")])
    assert stop.value.code == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--profile-steps" in err[0] and "LAST must be >= FIRST" in err[0]


def test_host_phases_say_host_bound_when_the_host_hardly_waited():
    host = HostPhases(steps=10, seconds={"batch": 0.05, "transfer": 0.02, "launch": 0.1, "wait": 0.009, "account": 0})
    assert host.per_step_ms() == pytest.approx(
        {"batch_ms": 5.0, "transfer_ms": 2.0, "launch_ms": 10.0, "wait_ms": 0.9, "account_ms": 0.0}
    )
    assert host.host_bound(0.020)  # waited 0.9 ms of a 20 ms step
    assert not host.host_bound(0.005)  # 0.9 of 5 ms
    assert HostPhases().per_step_ms() is None and not HostPhases().host_bound(0.02)
    assert HostPhases.from_dict(json.loads(json.dumps(host.__dict__))) == host


def kernel(name, start, duration, pid=1):
    return {"ph": "X", "pid": pid, "tid": 7, "name": name, "ts": start, "dur": duration}


def test_the_timeline_splits_a_devices_time_into_compute_communication_and_idle():
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "tid": 3, "name": "thread_name", "args": {"name": "python"}},
        kernel("gemm", 0, 100),
        kernel("ncclDevKernel_AllReduce", 50, 100),  # 50 us under the gemm, 50 us alone
        kernel("layer_norm", 180, 20),  # after a 30 us gap
        kernel("gemm", 205, 95),  # after a 5 us gap (under --gap-us 20)
        {"ph": "X", "pid": 2, "tid": 3, "name": "PjitFunction(train_step)", "ts": 0, "dur": 40},
        {"ph": "X", "pid": 2, "tid": 3, "name": "PjitFunction(train_step)", "ts": 100, "dur": 60},
    ]
    summary = timeline.summarize(events, steps=2, gap_us=20)
    (device,) = summary["devices"].values()
    # window 300 us, busy 150 + 20 + 95 = 265, compute 100 + 20 + 95 = 215, nccl 100, exposed 50: per step / 2
    assert device["window_ms"] == pytest.approx(0.150) and device["busy_ms"] == pytest.approx(0.1325)
    assert device["compute_ms"] == pytest.approx(0.1075) and device["nccl_ms"] == pytest.approx(0.050)
    assert device["exposed_nccl_ms"] == pytest.approx(0.025) and device["idle_ms"] == pytest.approx(0.0175)
    assert device["gaps"] == 0.5 and device["gaps_ms"] == pytest.approx(0.015)
    (gap,) = device["largest_gaps"]
    assert gap["length_us"] == 30 and gap["after_kernel"] == "ncclDevKernel_AllReduce"
    assert gap["before_kernel"] == "layer_norm"
    assert device["kernels_per_step"] == 2
    gemm = device["largest_kernels"][0]
    assert gemm["name"] == "gemm" and gemm["ms_per_step"] == pytest.approx(0.0975) and gemm["count_per_step"] == 1
    assert [entry["name"] for entry in device["largest_kernels"]] == ["gemm", "ncclDevKernel_AllReduce", "layer_norm"]
    (host,) = summary["host"]
    assert host == {
        "thread": "python",
        "name": "PjitFunction(train_step)",
        "ms_per_step": 0.05,
        "count_per_step": 1,
        "longest_ms": 0.06,
    }
    assert "/device:GPU:0" in timeline.table(summary)


def test_a_step_kernel_bounds_the_window_to_whole_steps():
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        kernel("gemm", 0, 50),  # before the first step's end: cut off
        kernel("step_kernel<adam>", 60, 40),  # the first step ends at 100
        kernel("gemm", 110, 60),
        kernel("step_kernel<adam>", 180, 20),  # ends at 200
        kernel("gemm", 210, 60),
        kernel("step_kernel<adam>", 280, 20),  # ends at 300
        kernel("gemm", 300, 500),  # after the last: cut off
    ]
    (device,) = timeline.summarize(events, steps=9, gap_us=5, step_kernel="step_kernel")["devices"].values()
    assert device["steps"] == 2 and device["window_ms"] == pytest.approx(0.1)  # 200 us over 2 steps
    assert device["busy_ms"] == pytest.approx(0.08)  # 60 + 20 + 60 + 20
    assert device["gaps"] == 2 and device["gaps_ms"] == pytest.approx(0.02)  # 10 + 10 + 10 + 10 us


@pytest.mark.parametrize("flags", [[], ["--steps", "3"]])
def test_the_timeline_of_a_folder_without_a_trace_is_one_line(flags, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        timeline.main([str(tmp_path), *flags])
    assert exit_info.value.code == 2
    assert f"error: no jax.profiler trace (*.trace.json.gz, perfetto_trace.json.gz) under {tmp_path}" in (
        capsys.readouterr().err
    )
