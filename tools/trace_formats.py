"""Read a GPU trace into one small model: kernels, kernel launches, and echo's named ranges.

Two formats:
- Nsight Systems' SQLite export (`nsys export --type sqlite`): tables CUPTI_ACTIVITY_KIND_KERNEL
  (start, end, deviceId, correlationId, globalPid, demangledName/shortName -> StringIds),
  CUPTI_ACTIVITY_KIND_RUNTIME (and _DRIVER where present: start, globalTid, correlationId),
  NVTX_EVENTS (push/pop ranges, eventType 59: start, end, globalTid, text or textId).
- The PyTorch profiler's Chrome trace (JSON, optionally .gz): events with cat "kernel"
  (args.device, args.correlation), "cuda_runtime" / "cuda_driver" (the launch calls, with
  args.correlation), and "user_annotation" (record_function ranges; older torch: "cpu_op").

All times are nanoseconds. A kernel is tied to the CPU thread and time of its launch through
the correlation id, which is how overlap_report.py finds the step that launched it.
"""

import bisect
import gzip
import json
import re
import sqlite3
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# echo/profiling.py writes "echo.<name>[step=<n>]", or "echo.<name>" when no step is known
RANGE_RE = re.compile(r"^echo\.([A-Za-z0-9_.-]+?)(?:\[step=(-?\d+)\])?$")
NVTX_PUSH_POP = 59  # NVTX_EVENTS.eventType of a push/pop range
SQLITE_MAGIC = b"SQLite format 3\x00"


@dataclass(frozen=True)
class Kernel:
    start: float
    end: float
    name: str
    device: int
    corr: tuple[int, int] | None  # (process, correlation id): the launch it came from


@dataclass(frozen=True)
class Range:
    name: str  # "schedule", "prepare", ... (without the "echo." prefix)
    step: int | None
    start: float
    end: float
    thread: tuple[int, int]  # (process, thread)


@dataclass
class Trace:
    kernels: list[Kernel]
    ranges: list[Range]
    # (process, correlation id) -> (thread, CPU time of the launch call)
    launches: dict[tuple[int, int], tuple[tuple[int, int], float]] = field(default_factory=dict)
    source: str = ""  # "nsys" or "torch"


def parse_range_name(text: str) -> tuple[str, int | None] | None:
    """("schedule", 12) for "echo.schedule[step=12]"; None for anything not echo's."""
    m = RANGE_RE.match(text)
    if m is None:
        return None
    return m.group(1), None if m.group(2) is None else int(m.group(2))


def kernel_steps(trace: Trace, kernels: list[Kernel]) -> list[int | None]:
    """The step of each kernel: the stepped echo range around its launch call, if any."""
    by_thread: dict[tuple[int, int], list[Range]] = defaultdict(list)
    for r in trace.ranges:
        if r.step is not None:
            by_thread[r.thread].append(r)
    starts = {}
    for thread, ranges in by_thread.items():
        ranges.sort(key=lambda r: r.start)
        starts[thread] = [r.start for r in ranges]
    steps: list[int | None] = []
    for k in kernels:
        launch = trace.launches.get(k.corr) if k.corr is not None else None
        step = None
        if launch is not None and launch[0] in by_thread:
            thread, ts = launch
            ranges = by_thread[thread]
            i = bisect.bisect_right(starts[thread], ts) - 1
            # ranges may nest: the innermost one that contains ts is at most a few back
            for r in ranges[max(0, i - 8): i + 1][::-1]:
                if r.start <= ts <= r.end:
                    step = r.step
                    break
        steps.append(step)
    return steps


def load_trace(path: str | Path) -> Trace:
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(len(SQLITE_MAGIC))
    if head == SQLITE_MAGIC:
        return load_nsys_sqlite(path)
    return load_chrome_trace(path)


# ---- Nsight Systems SQLite ------------------------------------------------------------------


def _pid(global_id: int) -> int:
    # nsys packs ids as (hardware id << 56) | (pid << 24) | tid
    return (global_id >> 24) & 0xFFFFFF


def _tid(global_tid: int) -> int:
    return global_tid & 0xFFFFFF


def load_nsys_sqlite(path: Path) -> Trace:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        kernel_cols = {r[1] for r in db.execute("PRAGMA table_info(CUPTI_ACTIVITY_KIND_KERNEL)")}
        # demangled names are the readable ones; old exports may only have shortName
        name_col = "demangledName" if "demangledName" in kernel_cols else "shortName"
        kernels = [
            Kernel(float(start), float(end), name or "?", device,
                   (_pid(gpid), corr))
            for start, end, device, corr, gpid, name in db.execute(
                f"SELECT k.start, k.end, k.deviceId, k.correlationId, k.globalPid, s.value "
                f"FROM CUPTI_ACTIVITY_KIND_KERNEL AS k "
                f"LEFT JOIN StringIds AS s ON s.id = k.{name_col}")
        ] if "CUPTI_ACTIVITY_KIND_KERNEL" in tables else []
        launches = {}
        for table in ("CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_DRIVER"):
            if table in tables:
                for start, gtid, corr in db.execute(
                        f"SELECT start, globalTid, correlationId FROM {table}"):
                    launches[(_pid(gtid), corr)] = ((_pid(gtid), _tid(gtid)), float(start))
        ranges = []
        if "NVTX_EVENTS" in tables:
            rows = db.execute(
                "SELECT n.start, n.end, n.globalTid, COALESCE(n.text, s.value) "
                "FROM NVTX_EVENTS AS n LEFT JOIN StringIds AS s ON s.id = n.textId "
                "WHERE n.eventType = ? AND n.end IS NOT NULL", (NVTX_PUSH_POP,))
            for start, end, gtid, text in rows:
                parsed = parse_range_name(text or "")
                if parsed is not None:
                    ranges.append(Range(parsed[0], parsed[1], float(start), float(end),
                                        (_pid(gtid), _tid(gtid))))
    finally:
        db.close()
    return Trace(kernels, ranges, launches, source="nsys")


# ---- PyTorch profiler Chrome trace ----------------------------------------------------------


def _open_text(path: Path):
    return gzip.open(path, "rt") if path.suffix == ".gz" else open(path)


def load_chrome_trace(path: Path) -> Trace:
    with _open_text(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    kernels, ranges, launches = [], [], {}
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat", "")
        args = e.get("args") or {}
        # Chrome traces count microseconds; everything here is nanoseconds
        start = float(e["ts"]) * 1e3
        end = start + float(e.get("dur", 0)) * 1e3
        if cat == "kernel":
            corr = args.get("correlation")
            kernels.append(Kernel(start, end, e.get("name", "?"),
                                  int(args.get("device", e.get("pid", 0))),
                                  None if corr is None else (0, int(corr))))
        elif cat in ("cuda_runtime", "cuda_driver"):
            corr = args.get("correlation")
            if corr is not None:
                launches[(0, int(corr))] = ((_int(e.get("pid")), _int(e.get("tid"))), start)
        elif cat in ("user_annotation", "cpu_op"):
            parsed = parse_range_name(e.get("name", ""))
            if parsed is not None:
                ranges.append(Range(parsed[0], parsed[1], start, end,
                                    (_int(e.get("pid")), _int(e.get("tid")))))
    return Trace(kernels, ranges, launches, source="torch")


def _int(value) -> int:
    # pids and tids are numbers in torch's traces, but Chrome traces allow strings
    try:
        return int(value)
    except (TypeError, ValueError):
        return hash(value) & 0xFFFFFFFF
