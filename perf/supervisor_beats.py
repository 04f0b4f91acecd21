"""The supervisor's heartbeat against fleets of fake engines: the longest gap between two beats.

Why: the master's keeper kills a supervisor whose beat is older than ``STALE_S`` (3 s), so the
longest gap between beats is the margin a fleet of that size leaves. With 32 engines and 2
workers on 2 cores one start in four lost its supervisor this way, on an idle fleet.

How: for each fleet size, one fake-engine process hosting N engines (half producers, half
consumers, every pair permitted), the router under real gunicorn with its defaults (preflight at
start, ``/metrics`` read every 100 ms, health checks every 5 s, JSON log) and 2 workers, idle.
From the moment gunicorn's master exists, this process maps the master's shared memory
read-only (``/proc/<master>/fd``: the memfd) and samples the heartbeat word every
``--sample-ms``; a gap is the difference between two successive heartbeat values the same
supervisor wrote, so sampling slower than the beat only merges beats into a longer gap (an
overestimate by at most one sample). Beats before the first are not gaps: the keeper gives a
starting supervisor ``STARTUP_S`` for it. Any supervisor restart and any "stopped beating"
line in the router's log are reported too.

Usage: ``python -m perf.supervisor_beats [--engines 8,32,128] [--seconds 30] [--runs 1]
[--workers 2] [--sample-ms 2]``. Prints one line per run and a table.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from narwhal.shm import layout as L
from narwhal.testing.harness import FakeFleet, RouterProcess, write_config
from perf.load.procs import children_of

MODEL = "fake-model"


@dataclass
class Beats:
    """What the sampler saw: the gaps between beats per supervisor, and the supervisors."""

    gaps: list[float] = field(default_factory=list)
    supervisors: list[int] = field(default_factory=list)
    first_beat_at: float | None = None  # seconds after the master appeared
    bad_samples: int = 0  # a heartbeat after now or long before the master: not a beat, not counted
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def longest(self) -> float:
        return max(self.gaps, default=0.0)


def _master(before: set[int]) -> int | None:
    for pid in children_of(os.getpid()):
        if pid in before:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"gunicorn" in f.read():
                    return pid
        except OSError:
            continue
    return None


def _memfd(pid: int) -> int | None:
    """The master's shared region, opened read-only through ``/proc`` (None until it exists)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:narwhal-fleet"):
                return os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
        except OSError:
            continue
    return None


def sample(beats: Beats, before: set[int], every_s: float) -> None:
    """Find the master, map its region, then record beat gaps until ``beats.stop``."""
    fd = None
    while fd is None and not beats.stop.is_set():
        master = _master(before)
        fd = _memfd(master) if master is not None else None
        if fd is None:
            time.sleep(0.005)
    if fd is None:
        return
    seen_at, seen_at_ns = time.monotonic(), time.monotonic_ns()
    mm = mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    last_pid, last_ns = 0, 0
    try:
        while not beats.stop.wait(every_s):
            pid = L.U32.unpack_from(mm, L.SUPERVISOR_PID_OFFSET)[0]
            ns = L.U64.unpack_from(mm, L.HEARTBEAT_OFFSET)[0]
            if ns == last_ns or pid == 0:  # pid 0: the first beat is half written (time first)
                continue
            if not seen_at_ns - 60 * 10**9 <= ns <= time.monotonic_ns():
                beats.bad_samples += 1
                if os.environ.get("BEATS_DEBUG"):
                    print(f"bad sample pid={pid} ns={ns} last=({last_pid},{last_ns}) now={time.monotonic_ns()} "
                          f"seen={seen_at_ns}", flush=True)
                continue
            if pid != last_pid:  # a (new) supervisor's first beat: no gap before it
                beats.supervisors.append(pid)
                if beats.first_beat_at is None:
                    beats.first_beat_at = time.monotonic() - seen_at
            else:
                beats.gaps.append((ns - last_ns) / 1e9)
            last_pid, last_ns = pid, ns
    finally:
        mm.close()
        os.close(fd)


def _config(fleet: FakeFleet, engines: int, workers: int, tmp: Path) -> str:
    producers = engines // 2
    specs = [{"name": name, "url": url, "role": "producer" if i < producers else "consumer"}
             for i, (name, url) in enumerate(fleet.engines.items())]
    sections: dict[str, dict[str, Any]] = {"server": {"workers": workers, "max_engines": max(64, engines)},
                "log": {"access_log": str(tmp / "access.log")}}
    return write_config(specs, sections)


def run_once(engines: int, seconds: float, workers: int, every_s: float) -> tuple[Beats, int, float]:
    """One start of the router against ``engines`` fakes: its beats, "stopped beating" lines, ready time."""
    names = [f"p{i}" for i in range(engines // 2)] + [f"d{i}" for i in range(engines - engines // 2)]
    tmp = Path(tempfile.mkdtemp(prefix="narwhal-beats-"))
    fleet = FakeFleet.start(names, args=["--model", MODEL], timeout=60)
    beats = Beats()
    try:
        config = _config(fleet, engines, workers, tmp)
        sampler = threading.Thread(target=sample, args=(beats, set(children_of(os.getpid())), every_s), daemon=True)
        sampler.start()
        started = time.monotonic()
        router = RouterProcess.start(config, log_path=str(tmp / "router.log"), workers=workers, timeout=120)
        ready = time.monotonic() - started
        try:
            time.sleep(max(seconds - ready, 0.0))  # the window counts from the start, as the did
        finally:
            beats.stop.set()
            sampler.join(5)
            log = router.log_text()
            router.stop()
        return beats, log.count("stopped beating"), ready
    finally:
        beats.stop.set()
        fleet.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.supervisor_beats", description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="8,32,128", help="fleet sizes, comma-separated (default 8,32,128)")
    parser.add_argument("--seconds", type=float, default=30.0, help="window per start, from the start (default 30)")
    parser.add_argument("--runs", type=int, default=1, help="starts per fleet size (default 1)")
    parser.add_argument("--workers", type=int, default=2, help="gunicorn workers (default 2)")
    parser.add_argument("--sample-ms", type=float, default=2.0, help="heartbeat sampling period (default 2 ms)")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.engines.split(",") if n.strip()]
    rows = []
    for engines in sizes:
        longest: list[float] = []
        for run in range(args.runs):
            beats, stale_lines, ready = run_once(engines, args.seconds, args.workers, args.sample_ms / 1000)
            p99 = statistics.quantiles(beats.gaps, n=100)[98] if len(beats.gaps) >= 100 else beats.longest
            print(f"{engines} engines, run {run + 1}: {len(beats.gaps)} gaps, longest {beats.longest * 1000:.0f} ms, "
                  f"p99 {p99 * 1000:.0f} ms, supervisors {len(beats.supervisors)}, 'stopped beating' lines "
                  f"{stale_lines}, ready after {ready:.1f} s, bad samples {beats.bad_samples}", flush=True)
            longest.append(beats.longest)
            rows.append((engines, run + 1, beats, stale_lines))
        print(f"{engines} engines: longest gap over {args.runs} run(s) {max(longest) * 1000:.0f} ms", flush=True)
    print("\n| engines | run | beats | longest gap (ms) | supervisors | 'stopped beating' |")
    print("|---:|---:|---:|---:|---:|---:|")
    for engines, run, beats, stale_lines in rows:
        print(f"| {engines} | {run} | {len(beats.gaps)} | {beats.longest * 1000:.0f} | {len(beats.supervisors)} "
              f"| {stale_lines} |")
    return 1 if any(stale for *_, stale in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
