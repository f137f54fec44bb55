"""Named ranges around engine phases, and a window of steps under a profiler.

`with step_range("schedule", step):` marks one phase of one step as "echo.schedule[step=12]",
both as an NVTX range (what Nsight Systems records) and as a torch.profiler user annotation
(what the PyTorch-profiler fallback records), so tools/overlap_report.py reads the same names
from either trace. ECHO_NVTX=1 turns ranges on; it is read once, when this module is imported,
because reading os.environ on every use would cost about as much as the phases being measured.
Off, step_range returns one shared no-op context manager (its cost: docs/benchmarks.md,
Host-side cost of a step).

`ProfilerWindow` starts and stops a profiler around steps START..START+COUNT-1 of the process
that owns the ModelRunner (ECHO_PROFILE_STEPS, ECHO_PROFILE_OUT; see echo/envs.py). The
offline LLM runs the core in that same process, so its trace holds every range. The
multi-process engine runs the core elsewhere: with the PyTorch profiler a worker's trace holds
only its own ranges (prepare, forward, sample, output); Nsight Systems follows every process.

torch is imported only when a range or a window is on: the core process otherwise never needs it.
"""

import atexit
import contextlib
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from echo import envs

# the prefix that overlap_report.py looks for; the step, when known, follows in brackets
RANGE_PREFIX = "echo."
_NO_RANGE = contextlib.nullcontext()

StepRange = Callable[..., AbstractContextManager]


def range_label(name: str, step: int | None = None) -> str:
    return f"{RANGE_PREFIX}{name}" if step is None else f"{RANGE_PREFIX}{name}[step={step}]"


class _NamedRange:
    """An NVTX push/pop (when CUDA is there) and a torch.profiler record_function, together."""

    __slots__ = ("label", "record", "nvtx")

    def __init__(self, label: str, nvtx) -> None:
        import torch

        self.label = label
        self.nvtx = nvtx
        self.record = torch.autograd.profiler.record_function(label)

    def __enter__(self) -> None:
        if self.nvtx is not None:
            self.nvtx.range_push(self.label)
        self.record.__enter__()

    def __exit__(self, *exc) -> None:
        self.record.__exit__(*exc)
        if self.nvtx is not None:
            self.nvtx.range_pop()


def make_step_range(enabled: bool) -> StepRange:
    """A step_range function: the no-op one, or one that emits named ranges."""
    if not enabled:
        def disabled(name: str, step: int | None = None) -> AbstractContextManager:
            return _NO_RANGE

        return disabled
    import torch

    nvtx = torch.cuda.nvtx if torch.cuda.is_available() else None

    def enabled_range(name: str, step: int | None = None) -> AbstractContextManager:
        return _NamedRange(range_label(name, step), nvtx)

    return enabled_range


step_range: StepRange = make_step_range(envs.nvtx_enabled())


class _NoWindow:
    def on_step(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


NO_WINDOW = _NoWindow()


class ProfilerWindow:
    """Profiles COUNT model-runner steps from step START. Call on_step(step_id) as each step is
    launched. With out_dir, the PyTorch profiler (CPU ops, user annotations and, on CUDA,
    CUPTI kernels) records after WARMUP more steps (CUPTI's first moments are slow and would
    skew the first step) and writes out_dir/echo_trace_<tag>.json.gz. Without out_dir, it calls
    cudaProfilerStart/Stop around the window, for nsys --capture-range=cudaProfilerApi."""

    WARMUP = 2

    def __init__(self, start: int, count: int, out_dir: Path | None, tag: str) -> None:
        self.start, self.count, self.out_dir, self.tag = start, count, out_dir, tag
        self._prof = None  # torch.profiler.profile while the window is open (out_dir mode)
        self._steps_left = 0  # launches until the window closes (out_dir mode)
        self._cuda_started = False  # cudaProfilerStart called (no out_dir)
        self._done = False

    @property
    def trace_path(self) -> Path | None:
        return None if self.out_dir is None else self.out_dir / f"echo_trace_{self.tag}.json.gz"

    def on_step(self, step: int) -> None:
        if self._done:
            return
        if self.out_dir is None:
            self._on_step_cuda(step)
        elif self._prof is None:
            if step >= self.start - self.WARMUP:
                self._open(warmup=max(0, min(self.WARMUP, self.start - step)))
        else:
            self._steps_left -= 1
            if self._steps_left == 0:
                self.close()
            else:
                self._prof.step()

    def _open(self, warmup: int) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._prof = profile(activities=activities,
                             schedule=schedule(wait=0, warmup=warmup, active=self.count,
                                               repeat=1),
                             on_trace_ready=self._save)
        self._prof.start()
        self._steps_left = warmup + self.count
        # the run may end inside the window: still write what was recorded (in-process only;
        # a worker process leaves through os._exit, which skips atexit)
        atexit.register(self.close)

    def _save(self, prof) -> None:
        prof.export_chrome_trace(str(self.trace_path))
        print(f"echo: profiler trace written to {self.trace_path}", file=sys.stderr)

    def _on_step_cuda(self, step: int) -> None:
        import torch

        if not torch.cuda.is_available():
            self._done = True
        elif not self._cuda_started and step >= self.start:
            torch.cuda.profiler.start()
            self._cuda_started = True
            atexit.register(self.close)
        elif self._cuda_started and step >= self.start + self.count:
            self.close()

    def close(self) -> None:
        """End the window now (idempotent); kernels still running are waited for first, so
        the last step's kernels are in the trace."""
        if self._done or (self._prof is None and not self._cuda_started):
            return
        self._done = True
        atexit.unregister(self.close)
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if self._prof is not None:
            if self._steps_left == 0:
                self._prof.step()  # leaves the last active step: the trace is saved
            self._prof.stop()  # saves a window cut short by the end of the run
            self._prof = None
        else:
            torch.cuda.profiler.stop()


def profiler_window(tag: str) -> ProfilerWindow | _NoWindow:
    """The window ECHO_PROFILE_STEPS asks for, or a no-op when it is unset."""
    steps = envs.profile_steps()
    if steps is None:
        return NO_WINDOW
    return ProfilerWindow(steps[0], steps[1], envs.profile_out(), tag)
