"""overlap_report on tiny synthetic traces in both formats, with every number worked by hand;
and echo.profiling's ranges and profiler window on the CPU."""

import gzip
import json
import os
import sqlite3
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import overlap_report  # noqa: E402
from trace_formats import load_chrome_trace, load_trace, parse_range_name  # noqa: E402

# ---- the synthetic run (µs) ------------------------------------------------------------------
# Three steps, two in flight, as echo runs them: step 11's schedule and step 10's output happen
# while the GPU works. Launches are (correlation id, CPU time); kernels (correlation, name,
# device, start, end). Worked out below each number in EXPECTED.
RANGES = [  # (label, start, end); "core" ranges ran on another thread (another process in nsys)
    ("echo.schedule[step=10]", 0, 10, "core"),
    ("echo.prepare[step=10]", 10, 20, "main"),
    ("echo.forward[step=10]", 20, 40, "main"),
    ("echo.sample[step=10]", 40, 45, "main"),
    ("echo.schedule[step=11]", 45, 55, "core"),
    ("echo.prepare[step=11]", 55, 60, "main"),
    ("echo.forward[step=11]", 60, 70, "main"),
    ("echo.sample[step=11]", 70, 75, "main"),
    ("echo.output[step=10]", 75, 85, "main"),
    ("echo.prepare[step=12]", 85, 90, "main"),
    ("echo.forward[step=12]", 90, 95, "main"),
    ("echo.output[step=11]", 95, 100, "main"),
    ("echo.output-processing", 100, 110, "main"),
    ("echo.schedule[step=13]", 110, 115, "core"),  # its step never reached the GPU: left out
    ("ProfilerStep#3", 0, 115, "main"),  # not echo's: ignored
]
LAUNCHES = [(1, 22), (2, 30), (3, 42), (4, 62), (5, 72), (6, 91)]
KERNELS = [
    (1, "gemm", 0, 25, 50), (2, "attn", 0, 50, 60), (3, "sample_k", 0, 60, 65),
    (4, "gemm", 0, 70, 90), (5, "sample_k", 0, 90, 92),
    (99, "memset_like", 0, 94, 96),  # no launch record: busy, but tied to no step
    (6, "gemm", 0, 100, 120),
    (7, "other_gpu", 1, 0, 200),  # another device: ignored
]
# window: step 10's first kernel (25) .. step 12's last (120) = 95
# busy on device 0: [25,65] 40 + [70,92] 22 + [94,96] 2 + [100,120] 20 = 84
# gaps: 10->11 [65,70] = 5; 11->12 [92,100] less the memset [94,96] = 6
# GPU step starts 25, 70, 100: periods 45 + 30 = 75
EXPECTED = {
    "window_ms": 95e-3,
    "gpu_busy_fraction": 84 / 95,
    "gpu_busy_ms": 84e-3,
    "steps": {"count": 3, "first": 10, "last": 12, "gpu_period_mean_us": 37.5},
    "unattributed_kernels": 1,
    "gaps": {"count": 2, "nonzero": 2, "p50_us": 5.5, "p99_us": 5.99, "mean_us": 5.5,
             "max_us": 6.0, "total_us": 11.0, "fraction_of_window": 11 / 95,
             "fraction_of_step": 11 / 75, "values_us": [5.0, 6.0]},
    "cpu_ranges": {
        # [0,10] idle; [45,55] all under [25,65]
        "schedule": {"count": 2, "total_us": 20, "per_step_us": 10, "overlapped_fraction": 0.5},
        # [10,20] idle, [55,60] and [85,90] busy
        "prepare": {"count": 3, "total_us": 20, "per_step_us": 20 / 3,
                    "overlapped_fraction": 0.5},
        # [20,40]: 15 busy; [60,70]: 5; [90,95]: [90,92] + [94,95] = 3
        "forward": {"count": 3, "total_us": 35, "per_step_us": 35 / 3,
                    "overlapped_fraction": 23 / 35},
        "sample": {"count": 2, "total_us": 10, "per_step_us": 5, "overlapped_fraction": 1.0},
        # [75,85]: 10 busy; [95,100]: only [95,96]
        "output": {"count": 2, "total_us": 15, "per_step_us": 7.5,
                   "overlapped_fraction": 11 / 15},
        "output-processing": {"count": 1, "total_us": 10, "per_step_us": 10,
                              "overlapped_fraction": 1.0},
    },
}
EXPECTED_KERNELS = [("gemm", 3, 65.0), ("attn", 1, 10.0), ("sample_k", 2, 7.0),
                    ("memset_like", 1, 2.0)]


def write_chrome_trace(path: Path) -> Path:
    """The run as the PyTorch profiler writes it (ts and dur in µs)."""
    tids = {"main": 7, "core": 8}
    events = [{"ph": "M", "name": "process_name", "pid": 42, "tid": 0, "args": {"name": "py"}}]
    for label, start, end, thread in RANGES:
        events.append({"ph": "X", "cat": "user_annotation", "name": label, "pid": 42,
                       "tid": tids[thread], "ts": 1000.0 + start, "dur": end - start})
    for corr, ts in LAUNCHES:
        events.append({"ph": "X", "cat": "cuda_runtime" if corr != 5 else "cuda_driver",
                       "name": "cudaLaunchKernel", "pid": 42, "tid": 7, "ts": 1000.0 + ts,
                       "dur": 1, "args": {"correlation": corr}})
    for corr, name, device, start, end in KERNELS:
        events.append({"ph": "X", "cat": "kernel", "name": name, "pid": device, "tid": 7,
                       "ts": 1000.0 + start, "dur": end - start,
                       "args": {"device": device, "stream": 7, "correlation": corr}})
    # the GPU-side projection of an annotation: not a CPU range
    events.append({"ph": "X", "cat": "gpu_user_annotation", "name": "echo.forward[step=10]",
                   "pid": 0, "tid": 7, "ts": 1025.0, "dur": 40})
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def write_nsys_sqlite(path: Path) -> Path:
    """The run as `nsys export --type sqlite` writes it (ns; names through StringIds)."""
    def gtid(pid: int, tid: int) -> int:
        return (1 << 56) | (pid << 24) | tid  # hardware id, pid, tid

    threads = {"main": gtid(500, 501), "core": gtid(400, 400)}
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT NOT NULL, end INT NOT NULL,
            deviceId INT NOT NULL, contextId INT, streamId INT, correlationId INT,
            globalPid INT, demangledName INT, shortName INT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INT NOT NULL, end INT NOT NULL,
            eventClass INT, globalTid INT, correlationId INT, nameId INT, returnValue INT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_DRIVER (start INT NOT NULL, end INT NOT NULL,
            eventClass INT, globalTid INT, correlationId INT, nameId INT, returnValue INT);
        CREATE TABLE NVTX_EVENTS (start INT NOT NULL, end INT, eventType INT NOT NULL,
            rangeId INT, category INT, color INT, text TEXT, globalTid INT, endGlobalTid INT,
            textId INT, domainId INT);
    """)
    strings: dict[str, int] = {}

    def sid(text: str) -> int:
        if text not in strings:
            strings[text] = len(strings) + 1
            db.execute("INSERT INTO StringIds VALUES (?, ?)", (strings[text], text))
        return strings[text]

    base = 5_000_000_000
    for i, (label, start, end, thread) in enumerate(RANGES):
        # nsys keeps some texts inline and some in StringIds: both must be read
        text, text_id = (label, None) if i % 2 else (None, sid(label))
        db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, textId) "
                   "VALUES (?, ?, 59, ?, ?, ?)", (base + start * 1000, base + end * 1000, text,
                                                  threads[thread], text_id))
    db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid) "
               "VALUES (?, NULL, 34, 'echo.mark[step=10]', ?)", (base, threads["main"]))
    for corr, ts in LAUNCHES:
        table = "CUPTI_ACTIVITY_KIND_DRIVER" if corr == 5 else "CUPTI_ACTIVITY_KIND_RUNTIME"
        db.execute(f"INSERT INTO {table} (start, end, globalTid, correlationId, nameId) "
                   "VALUES (?, ?, ?, ?, ?)",
                   (base + ts * 1000, base + ts * 1000 + 500, threads["main"], corr,
                    sid("cudaLaunchKernel_v7000")))
    for corr, name, device, start, end in KERNELS:
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL (start, end, deviceId, streamId, "
                   "correlationId, globalPid, demangledName, shortName) VALUES "
                   "(?, ?, ?, 7, ?, ?, ?, ?)",
                   (base + start * 1000, base + end * 1000, device, corr, gtid(500, 0),
                    sid(name), sid(name[:3])))
    db.commit()
    db.close()
    return path


def assert_matches(actual, expected, path="metrics"):
    if isinstance(expected, dict):
        for key, value in expected.items():
            assert key in actual, f"{path}.{key} missing"
            assert_matches(actual[key], value, f"{path}.{key}")
    elif isinstance(expected, list):
        assert actual == pytest.approx(expected), path
    else:
        assert actual == pytest.approx(expected, rel=1e-9, abs=1e-12), path


@pytest.fixture(params=["torch", "nsys"])
def synthetic_trace(request, tmp_path) -> Path:
    if request.param == "torch":
        return write_chrome_trace(tmp_path / "trace.json.gz")
    return write_nsys_sqlite(tmp_path / "trace.sqlite")


def test_metrics_match_the_hand_computed_numbers(synthetic_trace):
    trace = load_trace(synthetic_trace)
    metrics = overlap_report.compute_metrics(trace)
    assert metrics["source"] == ("nsys" if synthetic_trace.suffix == ".sqlite" else "torch")
    assert metrics["device"] == 0
    assert_matches(metrics, EXPECTED)
    assert list(metrics["cpu_ranges"]) == list(EXPECTED["cpu_ranges"])  # pipeline order
    got = [(k["name"], k["count"]) for k in metrics["kernels_top"]]
    assert got == [(name, count) for name, count, _ in EXPECTED_KERNELS]
    totals = [k["total_us"] for k in metrics["kernels_top"]]
    assert totals == pytest.approx([total for _, _, total in EXPECTED_KERNELS])
    assert metrics["kernels_top"][0]["fraction"] == pytest.approx(65 / 84)


def test_cli_writes_json_and_plots(synthetic_trace, tmp_path, capsys):
    out = tmp_path / "report"
    assert overlap_report.main([str(synthetic_trace), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "GPU busy: 88.4%" in printed and "schedule" in printed
    assert json.loads((out / "overlap.json").read_text())["steps"]["count"] == 3
    for png in ("timeline.png", "gaps.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_the_device_can_be_chosen(synthetic_trace):
    metrics = overlap_report.compute_metrics(load_trace(synthetic_trace), device=1)
    # no launch on device 1 is tied to a step: the window is the kernel's own span
    assert metrics["gpu_busy_fraction"] == 1.0 and metrics["steps"]["count"] == 0


def test_steps_can_be_chosen_by_their_ranges(synthetic_trace, tmp_path, capsys):
    trace = load_trace(synthetic_trace)
    assert overlap_report.steps_marked(trace, "output") == {10, 11}
    # steps 10 and 11: window 25..92 = 67, busy [25,65] + [70,92] = 62, one gap [65,70] = 5
    # over one period 70 - 25 = 45
    kept = overlap_report.compute_metrics(trace, only_steps={10, 11})
    assert_matches(kept, {"window_ms": 67e-3, "gpu_busy_ms": 62e-3,
                          "steps": {"count": 2, "first": 10, "last": 11,
                                    "gpu_period_mean_us": 45.0},
                          "gaps": {"count": 1, "values_us": [5.0], "fraction_of_step": 5 / 45}})
    # steps 10 and 12 do not follow each other: no gap between them is counted
    apart = overlap_report.compute_metrics(trace, only_steps={10, 12})
    assert apart["steps"]["count"] == 2 and apart["gaps"]["count"] == 0
    assert overlap_report.main([str(synthetic_trace), "--out", str(tmp_path),
                                "--steps-without", "output"]) == 0
    assert "1 steps (12..12)" in capsys.readouterr().out


def test_range_names():
    assert parse_range_name("echo.schedule[step=12]") == ("schedule", 12)
    assert parse_range_name("echo.output-processing") == ("output-processing", None)
    assert parse_range_name("ProfilerStep#1") is None
    assert parse_range_name("aten::mm") is None


def test_intervals_cover():
    iv = overlap_report.Intervals([(5, 10), (0, 2), (8, 12), (20, 30)])
    assert (iv.starts, iv.ends) == ([0, 5, 20], [2, 12, 30])
    assert iv.covered(1, 25) == 1 + 7 + 5
    assert iv.covered(12, 20) == 0 and iv.covered(6, 7) == 1 and iv.covered(-5, 50) == 19


# ---- echo.profiling ------------------------------------------------------------------------


def test_disabled_step_range_is_one_shared_no_op(tmp_path):
    """Off, step_range costs a call and a with on an object made once: every call returns the
    same context manager, which yields None, lets exceptions through and records nothing. (Its
    cost in time is a benchmark's business, not a test's.)"""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from echo.profiling import make_step_range

    step_range = make_step_range(False)
    uses = [step_range("schedule", 1), step_range("forward", 2), step_range("output-processing"),
            step_range("schedule", 1)]
    assert all(cm is uses[0] for cm in uses)  # nothing is built per use
    with uses[0] as entered, uses[0] as nested:  # reusable, and re-entrant
        assert entered is None and nested is None
    with pytest.raises(ValueError, match="through"), step_range("sample", 3):
        raise ValueError("passes through")

    # what the enabled step_range records in the same profiler run, the disabled one does not
    enabled = make_step_range(True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with step_range("schedule", 7):
            torch.ones(8).sum()
        with enabled("forward", 7):
            torch.ones(8).sum()
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    ranges = load_chrome_trace(tmp_path / "t.json").ranges
    assert [(r.name, r.step) for r in ranges] == [("forward", 7)]


def test_enabled_step_range_shows_in_a_torch_profiler_trace(tmp_path):
    import torch
    from torch.profiler import ProfilerActivity, profile

    from echo.profiling import make_step_range

    step_range = make_step_range(True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in (4, 5):
            with step_range("prepare", step):
                torch.ones(8).sum()
        with step_range("output-processing"):
            pass
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    ranges = load_chrome_trace(tmp_path / "t.json").ranges
    assert sorted((r.name, r.step) for r in ranges) == [
        ("output-processing", None), ("prepare", 4), ("prepare", 5)]
    assert all(r.end > r.start for r in ranges)


def test_profiler_window_records_only_its_steps(tmp_path):
    import torch

    from echo.profiling import ProfilerWindow, make_step_range

    step_range = make_step_range(True)
    window = ProfilerWindow(start=3, count=3, out_dir=tmp_path, tag="rank0")
    for step in range(8):
        window.on_step(step)  # where ModelRunner.launch calls it
        with step_range("prepare", step):
            torch.ones(8).sum()
    assert window.trace_path.exists()
    steps = sorted(r.step for r in load_chrome_trace(window.trace_path).ranges)
    assert steps == [3, 4, 5]
    window.close()  # idempotent


def test_profiler_window_cut_short_still_writes_its_trace(tmp_path):
    from echo.profiling import ProfilerWindow, make_step_range

    step_range = make_step_range(True)
    window = ProfilerWindow(start=2, count=10, out_dir=tmp_path, tag="rank0")
    for step in range(4):
        window.on_step(step)
        with step_range("forward", step):
            pass
    window.close()  # what atexit does when the run ends inside the window
    assert sorted(r.step for r in load_chrome_trace(window.trace_path).ranges) == [2, 3]


def test_profile_steps_env(monkeypatch):
    from echo import envs
    from echo.profiling import NO_WINDOW, ProfilerWindow, profiler_window

    monkeypatch.delenv("ECHO_PROFILE_STEPS", raising=False)
    assert envs.profile_steps() is None and profiler_window("rank0") is NO_WINDOW
    monkeypatch.setenv("ECHO_PROFILE_STEPS", "200:40")
    monkeypatch.setenv("ECHO_PROFILE_OUT", "/tmp/x")
    window = profiler_window("rank1")
    assert isinstance(window, ProfilerWindow)
    assert (window.start, window.count, str(window.trace_path)) == (
        200, 40, "/tmp/x/echo_trace_rank1.json.gz")
    for bad in ("200", "a:3", "5:0", "-1:3"):
        monkeypatch.setenv("ECHO_PROFILE_STEPS", bad)
        with pytest.raises(ValueError, match="ECHO_PROFILE_STEPS"):
            envs.profile_steps()


# ---- tools/nsys_profile.sh -------------------------------------------------------------------

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "nsys_profile.sh"
TINY_RUN = """
import sys
from echo import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", num_gpu_blocks_override=64, max_num_seqs=4)
llm.generate([[1, 5, 9, 3], [1, 7]], SamplingParams(temperature=0, max_tokens=8,
             ignore_eos=True), use_tqdm=False)
"""


@pytest.mark.slow
def test_profile_script_end_to_end_on_cpu(tiny_qwen3, tmp_path):
    """The torch-profiler path on an offline run: every engine hook shows in the trace."""
    import subprocess

    out = tmp_path / "prof"
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("ECHO_NVTX", None)
    result = subprocess.run(
        [str(SCRIPT), "--out", str(out), "--steps", "3:2", "--profiler", "torch", "--",
         sys.executable, "-c", TINY_RUN, str(tiny_qwen3)],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranges = load_chrome_trace(out / "echo_trace_rank0.json.gz").ranges
    names = {r.name for r in ranges}
    assert names >= {"schedule", "prepare", "forward", "sample", "output", "update",
                     "output-processing"}
    assert {r.step for r in ranges if r.name == "forward"} == {3, 4}
    report = json.loads((out / "overlap.json").read_text())
    assert report["cpu_ranges"]["forward"]["count"] == 2


def test_profile_script_ends_the_command_it_started(tmp_path):
    import signal
    import subprocess
    import time

    pidfile = tmp_path / "pid"
    command = (f"import subprocess; p = subprocess.Popen(['sleep', '60']); "
               f"open({str(pidfile)!r}, 'w').write(str(p.pid)); p.wait()")
    script = subprocess.Popen(
        [str(SCRIPT), "--out", str(tmp_path), "--profiler", "torch", "--", sys.executable,
         "-c", command], env={**os.environ, "PYTHON": sys.executable},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not (pidfile.exists() and pidfile.read_text().strip()):
            assert time.monotonic() < deadline, "the command never started"
            time.sleep(0.05)
        sleeper = int(pidfile.read_text())
        script.send_signal(signal.SIGTERM)
        assert script.wait(timeout=20) == 143
        time.sleep(0.1)
        with pytest.raises(ProcessLookupError):
            os.kill(sleeper, 0)  # the command's own child is gone too
    finally:
        if script.poll() is None:
            script.kill()
