"""The parent's side: each measurement in a subprocess of its own, the longest-context search, the table.

Isolation: a system that crashes, runs out of GPU memory or is killed by the host's out-of-memory killer takes
only its own process down; its result is then its error (the worker's record, or the exit status and the last
lines of its output), never a missing row. While the worker runs, the parent samples the resident memory of its
whole process tree (every :data:`SAMPLE_S` seconds); the host peak reported is the larger of that high-water
mark and the worker's own ``VmHWM``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from hf_longctx.benchmarking import free_port, table_header, table_row

from .measure import is_out_of_memory
from .workload import Workload

SAMPLE_S = 0.2
TAIL_LINES = 12


def tree_rss_bytes(pid: int) -> int:
    """Resident bytes of process ``pid`` and all its descendants now (0 once it is gone)."""
    try:
        import psutil
    except ImportError:  # without psutil: the process alone, from /proc
        try:
            pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
            return pages * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0
    try:
        root = psutil.Process(pid)
        total = 0
        for proc in [root, *root.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except psutil.Error:
                pass
        return total
    except psutil.Error:
        return 0


@dataclass
class TreeSampler:
    """Samples :func:`tree_rss_bytes` of ``pid`` on a thread until :meth:`stop`; ``peak`` in bytes."""

    pid: int
    every_s: float = SAMPLE_S
    peak: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss_bytes(self.pid))
            self._stop.wait(self.every_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def tail(text: str, lines: int = TAIL_LINES) -> list[str]:
    return text.rstrip().splitlines()[-lines:]


def worker_command(system: str, work: Workload, out: Path, python: str = sys.executable) -> list[str]:
    return [python, "-m", "hf_longctx.lab.peers.worker", "--system", system, "--workload", json.dumps(work.to_dict()),
            "--out", str(out)]


def run_system(system: str, work: Workload, timeout_s: float, env: dict | None = None) -> dict:
    """Measure ``system`` on ``work`` in a fresh process (its own session, so that a timeout ends all of it).

    Always returns a result: the worker's, or an ``error`` naming the exit status (a signal: ``killed by
    SIGKILL``, as the host's out-of-memory killer does), the timeout, and the output's last lines."""
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as tmp:
        out = Path(tmp) / "result.json"
        log = Path(tmp) / "log.txt"
        child_env = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        started = time.perf_counter()
        with open(log, "w") as sink:
            proc = subprocess.Popen(worker_command(system, work, out), stdout=sink, stderr=subprocess.STDOUT,
                                    env=child_env, start_new_session=True)
            sampler = TreeSampler(proc.pid)
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)  # the worker's own session: it and its children
                proc.wait()
            tree_peak = sampler.stop()
        output = log.read_text(errors="replace")
        result = json.loads(out.read_text()) if out.exists() else {
            "system": system, "tokens_per_step": work.seq, "layers": work.layers, "tiny": work.tiny,
            "error": exit_error(proc.returncode, timed_out, timeout_s, output)}
    result["wall_s"] = round(time.perf_counter() - started, 1)
    own = result.get("worker_host_peak_gib") or 0.0
    result["host_peak_gib"] = max(own, tree_peak / 2**30) or None
    if result.get("error"):
        result["error"].setdefault("output_tail", tail(output))
    return result


def exit_error(code: int, timed_out: bool, timeout_s: float, output: str) -> dict:
    """The error of a worker that wrote no result."""
    if timed_out:
        kind, message = "Timeout", f"no result within {timeout_s:.0f} s"
    elif code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        kind, message = "Killed", f"killed by {name}" + (" (the host's out-of-memory killer sends SIGKILL)"
                                                          if name == "SIGKILL" else "")
    else:
        kind, message = "ExitStatus", f"exit status {code} without a result"
    return {"type": kind, "message": message, "last_lines": tail(output),
            "out_of_memory": is_out_of_memory(output) or message.startswith("killed by SIGKILL")}


# ---------------------------------------------------------------------------------------------------------- search

@dataclass
class Search:
    """The longest context one system trained a step at: ``longest`` (0: not even ``start`` nor anything down to
    ``granularity``), the first length that failed above it (None: none failed up to ``limit``), every attempt."""

    system: str
    longest: int
    failed_at: int | None
    attempts: list[dict]


def search_longest(system: str, attempt: Callable[[int], dict], start: int, limit: int,
                   granularity: int) -> Search:
    """Double from ``start`` while a step trains (up to ``limit``), then bisect between the longest that trained
    and the shortest that did not until they are ``granularity`` apart (lengths are multiples of it).

    If ``start`` itself fails, halve down to ``granularity`` first. ``attempt(seq)`` returns a result (a failure
    has ``error``); each is kept in ``attempts`` with its length, so that a failure that is not a lack of memory
    shows with its reason."""
    if granularity < 1 or start < granularity or limit < start:
        raise ValueError(f"need 1 <= granularity <= start <= limit, got {granularity}, {start}, {limit}")
    attempts: list[dict] = []

    def fits(seq: int) -> bool:
        r = attempt(seq)
        attempts.append({"seq": seq, "ok": not r.get("error"), "error": r.get("error"), "result": r})
        return not r.get("error")

    good, bad = 0, None
    seq = start
    while seq <= limit:  # up while it fits
        if not fits(seq):
            bad = seq
            break
        good = seq
        seq *= 2
    if good == 0:  # the start failed: down until something fits
        seq = start // 2 // granularity * granularity
        while seq >= granularity:
            if fits(seq):
                good = seq
                break
            bad = seq
            seq = seq // 2 // granularity * granularity
    while bad is not None and bad - good > granularity and good > 0:
        mid = (good + bad) // 2 // granularity * granularity
        if mid <= good:
            break
        if fits(mid):
            good = mid
        else:
            bad = mid
    return Search(system, good, bad, attempts)


def search_workload(work: Workload, seq: int) -> Workload:
    """The workload of a search attempt: ``seq`` tokens, one step after a first one. The second step is the one
    that counts: optimizers that allocate their states in their first step (torch's AdamW, the Trainer's) hold them
    through it, as they do through every step of a real run."""
    return replace(work, seq=seq, steps=1, warmup=1)


# ----------------------------------------------------------------------------------------------------------- table

COLUMNS = ["system", "tokens/step", "step s", "tokens/s", "MFU", "MFU w/ recompute", "GPU peak GiB (alloc/resv)",
           "host peak GiB", "longest context"]


def _pct(x: float | None) -> str | None:
    return None if x is None else f"{100 * x:.1f}%"


def _gib(x: float | None) -> str | None:
    return None if x is None else f"{x:.1f}"


def _tokens(n: int | None) -> str | None:
    if n is None:
        return None
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def result_row(r: dict, longest: int | None) -> list:
    if r.get("error"):
        e = r["error"]
        return [r["system"], _tokens(r.get("tokens_per_step")), None, f"failed: {e['type']}", None, None, None,
                _gib(r.get("host_peak_gib")), _tokens(longest)]
    alloc, resv = r.get("gpu_peak_allocated_gib"), r.get("gpu_peak_reserved_gib")
    gpu = f"{alloc:.1f} / {resv:.1f}" if alloc is not None and resv is not None else None
    return [r["system"], _tokens(r["tokens_per_step"]), f"{r['step_s']:.2f}", f"{r['tokens_per_s']:.0f}",
            _pct(r.get("mfu")), _pct(r.get("mfu_with_recompute")), gpu, _gib(r.get("host_peak_gib")),
            _tokens(longest)]


def _ratio(ours: float | None, best: float | None) -> str | None:
    if not ours or not best:
        return None
    return f"{ours / best:.2f}x"


def ratio_row(results: Sequence[dict], longest: dict[str, int]) -> list:
    """hf_longctx over the best peer, column by column (the best: highest tokens/s and MFU, lowest peaks, longest
    context); ``-`` where either side has no number."""
    ours = next((r for r in results if r["system"] == "hf_longctx" and not r.get("error")), None)
    peers = [r for r in results if r["system"] != "hf_longctx" and not r.get("error")]

    def best(key: str, low: bool = False) -> float | None:
        values = [r[key] for r in peers if r.get(key)]
        return (min if low else max)(values) if values else None

    def mine(key: str) -> float | None:
        return ours.get(key) if ours else None

    peer_longest = max((v for k, v in longest.items() if k != "hf_longctx"), default=None)
    return ["hf_longctx / best peer", None, _ratio(best("step_s", low=True), mine("step_s")),
            _ratio(mine("tokens_per_s"), best("tokens_per_s")), _ratio(mine("mfu"), best("mfu")),
            _ratio(mine("mfu_with_recompute"), best("mfu_with_recompute")),
            _ratio(mine("gpu_peak_allocated_gib"), best("gpu_peak_allocated_gib", low=True)),
            _ratio(mine("host_peak_gib"), best("host_peak_gib", low=True)),
            _ratio(longest.get("hf_longctx"), peer_longest)]


def markdown_table(results: Sequence[dict], longest: dict[str, int] | None = None) -> str:
    """One row per result (a failed one shows its error type), then the ratio row: hf_longctx over the best peer
    (step time: the best peer's over ours, so above 1 is faster for every column but the peaks)."""
    longest = longest or {}
    rows = [table_row(result_row(r, longest.get(r["system"]))) for r in results]
    return "\n".join([table_header(COLUMNS), *rows, table_row(ratio_row(results, longest))])
