"""Process accounting from /proc: CPU time and memory of process trees, host CPU, file limits.

Why /proc and not psutil: the figures the issue asks for are defined on /proc (utime+stime of
``/proc/<pid>/stat``, ``VmRSS`` of ``/proc/<pid>/status``, ``Pss`` of ``smaps_rollup``), the
suite must not add a dependency, and reading a few small files per process is cheap enough to
do at the edges of every measurement window.

CPU of a tree is ``utime + stime + cutime + cstime`` summed over the live processes: a worker
that exits between two snapshots has its time folded into its parent's ``cutime`` once it is
reaped, so the difference of two snapshots stays right even when gunicorn replaces a worker.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterable
from dataclasses import dataclass

CLK_TCK = os.sysconf("SC_CLK_TCK")


def raise_nofile_limit() -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit (children inherit it); return both."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            # Some kernels cap at nr_open below an "infinite" hard limit: take what is allowed.
            try:
                with open("/proc/sys/fs/nr_open") as f:
                    cap = min(hard, int(f.read()))
                resource.setrlimit(resource.RLIMIT_NOFILE, (cap, hard))
            except (ValueError, OSError):
                pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (all its threads' children)."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(p) for p in f.read().split())
        except OSError:
            continue
    return out


def tree(pids: Iterable[int]) -> list[int]:
    """``pids`` and every live descendant, each once."""
    seen: list[int] = []
    todo = list(pids)
    while todo:
        pid = todo.pop()
        if pid in seen or not os.path.exists(f"/proc/{pid}"):
            continue
        seen.append(pid)
        todo.extend(children_of(pid))
    return seen


def cpu_ticks(pid: int) -> int:
    """utime + stime + cutime + cstime of one process, in clock ticks (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return 0
    # The command name may hold spaces and parentheses: split after the last ')'.
    fields = data[data.rindex(b")") + 2 :].split()
    # fields[0] is field 3 (state): utime is field 14, stime 15, cutime 16, cstime 17.
    return int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])


def cpu_seconds(pids: Iterable[int]) -> float:
    """CPU seconds used so far by the trees rooted at ``pids``."""
    return sum(cpu_ticks(p) for p in tree(pids)) / CLK_TCK


def role(pid: int) -> str:
    """What a process is, from gunicorn's process titles: master, worker or other (e.g. a supervisor)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read(64)
    except OSError:
        return "other"
    if cmd.startswith(b"gunicorn: worker"):
        return "workers"
    if cmd.startswith(b"gunicorn: master"):
        return "master"
    return "other"


def cpu_by_role(pids: Iterable[int]) -> dict[str, float]:
    """CPU seconds of the trees rooted at ``pids``, split by :func:`role`."""
    out: dict[str, float] = {}
    for pid in tree(pids):
        name = role(pid)
        out[name] = out.get(name, 0.0) + cpu_ticks(pid) / CLK_TCK
    return out


def self_cpu_seconds() -> float:
    """This process (the load generator), threads included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(slots=True)
class Memory:
    rss_kib: int = 0
    pss_kib: int = 0
    processes: int = 0


def self_cpu_ns() -> int:
    """This process's CPU time in nanoseconds, summed over its threads' ``schedstat`` (finer than
    clock ticks: the supervisor tools measure milliseconds per second)."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total


def _status_kib(pid: int, key: bytes) -> int:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def memory(pids: Iterable[int]) -> Memory:
    """Summed VmRSS and Pss (KiB) of the trees rooted at ``pids``.

    RSS double-counts pages that forked workers still share with the master; Pss splits them,
    so it is the fairer "what does this router cost" figure. Both are reported.
    """
    mem = Memory()
    for pid in tree(pids):
        mem.rss_kib += _status_kib(pid, b"VmRSS:")
        mem.pss_kib += _pss_kib(pid)
        mem.processes += 1
    return mem


@dataclass(slots=True)
class HostCpu:
    """/proc/stat's aggregate line (all CPUs), in clock ticks, split the way the report needs.

    ``tasks`` is user + nice + system: what processes' utime/stime add up to, so "tasks minus our
    processes" is other people's work on a shared host. Interrupt time (loopback networking runs
    largely in softirq) and steal (a noisy hypervisor neighbour) are kept apart.
    """

    tasks: int
    irq: int
    steal: int
    total: int

    @classmethod
    def read(cls) -> HostCpu:
        with open("/proc/stat") as f:
            p = [int(x) for x in f.readline().split()[1:]] + [0] * 8
        # user nice system idle iowait irq softirq steal (guest time is already inside user)
        return cls(p[0] + p[1] + p[2], p[5] + p[6], p[7], sum(p[:8]))

    def delta(self, before: HostCpu) -> dict[str, float]:
        """CPU seconds (all cores together) per kind between ``before`` and this reading."""
        return {
            "tasks": (self.tasks - before.tasks) / CLK_TCK,
            "irq": (self.irq - before.irq) / CLK_TCK,
            "steal": (self.steal - before.steal) / CLK_TCK,
            "total": (self.total - before.total) / CLK_TCK,
        }


def loadavg() -> tuple[float, float, float]:
    one, five, fifteen = os.getloadavg()
    return one, five, fifteen
