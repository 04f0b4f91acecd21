"""Start and stop real processes on 127.0.0.1: a fake fleet and the router under gunicorn.

Shared by ``narwhal demo``, the integration tests and the perf suite, so all three run the
exact same processes a user would. The router's listening socket is created here and
handed to gunicorn as ``fd://N``: no "find a free port, then race for it" window.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from narwhal.fake_engine.release import DEFAULT_VERSION
from narwhal.testing.asking import http_ok, worker_answered, worker_ready

# Files written for a process's lifetime (settings files, router logs nobody named): removed when
# the process that wrote them exits, so a test session or a perf run leaves nothing in /tmp. A
# caller that wants one kept moves it away first (its own path is then not ours to remove).
_SCRATCH: list[str] = []


def _scratch_file(prefix: str, suffix: str) -> tuple[int, str]:
    """``mkstemp`` whose file is removed at exit, if it is still there."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=suffix)
    _SCRATCH.append(path)
    return fd, path


@atexit.register
def _remove_scratch() -> None:
    for path in _SCRATCH:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _wait(predicate: Any, timeout: float, what: str, proc: subprocess.Popen[Any] | None = None) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}")
        if predicate():
            return
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not ready after {timeout:g}s")


def _die_with_parent() -> None:
    """In the child before exec: whatever launched us (a test run, the demo) may be killed
    without a chance to clean up; its fleets and routers must not outlive it."""
    from narwhal.supervisor.process import set_parent_death_signal

    set_parent_death_signal(signal.SIGTERM)


class FakeFleet:
    """One ``narwhal fake-engine`` process hosting several engines and a control server."""

    def __init__(
        self, proc: subprocess.Popen[bytes], control: str, engines: dict[str, str], version: str = DEFAULT_VERSION
    ) -> None:
        self.proc = proc
        self.control = control
        self.engines = engines
        self.version = version  # the vLLM release its engines started as (--vllm-version)

    @classmethod
    def start(
        cls, names: Sequence[str], *, args: Sequence[str] = (), timeout: float = 30.0
    ) -> FakeFleet:
        """Start ``narwhal fake-engine`` with ``names`` and wait for its ready file; killed if it never comes."""
        fd, ready = tempfile.mkstemp(prefix="narwhal-fleet-", suffix=".json")
        os.close(fd)
        os.unlink(ready)
        cmd = [sys.executable, "-m", "narwhal", "fake-engine", "--ready-file", ready, *args]
        for name in names:
            cmd += ["--engine", name]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        try:
            _wait(lambda: os.path.exists(ready), timeout, "fake fleet", proc)
            with open(ready) as f:
                info = json.load(f)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            if os.path.exists(ready):
                os.unlink(ready)
        args = list(args)
        version = args[args.index("--vllm-version") + 1] if "--vllm-version" in args[:-1] else DEFAULT_VERSION
        return cls(proc, info["control"], info["engines"], version)

    def control_request(self, method: str, path: str, body: Any = None) -> Any:
        """One call to the fleet's control server; its JSON answer (None when empty)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.control + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=10) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def stats(self, name: str) -> dict[str, Any]:
        """Engine ``name``'s ``/fake/stats`` counters."""
        stats: dict[str, Any] = self.control_request("GET", f"/engines/{name}/stats")
        return stats

    def set_model(self, name: str, **model: Any) -> dict[str, Any]:
        """Change engine ``name``'s load and cache models (``max_num_seqs``, ``prefix_cache`` …)."""
        view: dict[str, Any] = self.control_request("PUT", f"/engines/{name}/model", model)
        return view

    def set_background(self, name: str, requests: int, hold_s: float = 1.0) -> None:
        """Make engine ``name`` serve ``requests`` requests for someone else (0: stop)."""
        self.control_request("PUT", f"/engines/{name}/background", {"requests": requests, "hold_s": hold_s})

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s; returns once the process is gone."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class DeadEngine:
    """An engine address on 127.0.0.1 where nothing answers: a consumer that cannot be reached.

    ``refusing``: a socket bound but not listening, so every connect is refused at once (a
    stopped engine). Otherwise ``hanging``: listening with a backlog of 0, never accepting, and
    its accept queue already full, so the kernel drops every new SYN and a connect hangs until
    the caller's own bound (a host gone silent) — without an address off this machine.
    """

    def __init__(self, *, refusing: bool) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        address = self._sock.getsockname()
        self.url = f"http://127.0.0.1:{address[1]}"
        self._filler: socket.socket | None = None
        if not refusing:
            self._sock.listen(0)
            # One connection nobody accepts fills a queue of backlog 0 (Linux: full beyond it).
            self._filler = socket.create_connection(address, timeout=5)

    def close(self) -> None:
        """Close the sockets: the address is free again."""
        for sock in (self._filler, self._sock):
            if sock is not None:
                sock.close()


def write_config(engines: Sequence[Mapping[str, Any]], sections: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """Write a TOML settings file for the given engines; return its path (removed when this
    process exits)."""
    lines: list[str] = []
    for section, values in (sections or {}).items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml(v)}" for k, v in values.items()]
        lines.append("")
    for engine in engines:
        lines.append("[[engines]]")
        lines += [f"{k} = {_toml(v)}" for k, v in engine.items()]
        lines.append("")
    fd, path = _scratch_file("narwhal-", ".toml")
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines))
    return path


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table (``dns = [{name = ..., port = ...}]``)
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def _listen(port: int) -> socket.socket:
    """A listening 127.0.0.1 socket that gunicorn inherits (``fd://N``): no port race."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def _config_file(root: str | None, env: dict[str, str]) -> str:
    """The gunicorn configuration to run: this package's, or that of the tree at ``root``
    (whose directory then goes first on ``PYTHONPATH`` in ``env``)."""
    from narwhal.master.gunicorn_hooks import CONFIG_FILE

    if root is None:
        return CONFIG_FILE
    # `python -m` puts the working directory first on sys.path: run from there.
    # Where that tree keeps its gunicorn configuration: the master package since the packages by
    # process, the front package since the layers, narwhal itself in older commits (--baseline
    # runs them all).
    name = os.path.basename(CONFIG_FILE)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
    for package in ("master", "front"):
        path = os.path.join(root, "narwhal", package, name)
        if os.path.exists(path):
            return path
    return os.path.join(root, "narwhal", name)


class RouterProcess:
    """The router under real gunicorn (master + workers) on an inherited 127.0.0.1 socket."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log_path: str) -> None:
        self.proc = proc
        self.url = url
        self.log_path = log_path

    @classmethod
    def start(
        cls,
        config_path: str,
        *,
        port: int = 0,
        env: Mapping[str, str] | None = None,
        wait_ready: bool = True,
        timeout: float = 30.0,
        log_path: str | None = None,
        gunicorn_args: Sequence[str] = (),
        root: str | None = None,
        workers: int = 1,
    ) -> RouterProcess:
        """Start gunicorn on a fresh 127.0.0.1 socket and wait until ``workers`` workers serve.

        Waiting for every worker matters to whoever opens many connections at once next:
        a worker still starting accepts none of them, and keep-alive keeps them where they
        landed (see ``narwhal.worker.accept``).

        ``root``: a directory holding another ``narwhal`` package (e.g. an older commit, for
        the perf suite's ``--baseline``) to run instead of this one, with this one's dependencies.
        """
        sock = _listen(port)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("NARWHAL_")}
        full_env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        full_env.update(env or {})
        full_env["NARWHAL_CONFIG"] = os.path.abspath(config_path)
        full_env["NARWHAL_SERVER__BIND"] = f"fd://{sock.fileno()}"
        if log_path is None:
            fd, log_path = _scratch_file("narwhal-router-", ".log")
            os.close(fd)
        inherit = log_path == "-"  # the caller's terminal (the demo)
        log = open(os.devnull if inherit else log_path, "ab")
        cmd = [sys.executable, "-m", "gunicorn", "-c", _config_file(root, full_env), *gunicorn_args]
        proc = subprocess.Popen(
            cmd,
            cwd=root,
            env=full_env,
            pass_fds=[sock.fileno()],
            stdout=None if inherit else log,
            stderr=None if inherit else log,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        log.close()
        sock.close()
        router = cls(proc, url, log_path)
        try:
            router._wait_serving(workers, wait_ready, timeout)
        except BaseException:
            router.stop()
            raise
        return router

    def _wait_serving(self, workers: int, wait_ready: bool, timeout: float) -> None:
        url, proc = self.url, self.proc
        _wait(lambda: http_ok(url + "/health"), timeout, "router", proc)
        seen: set[int] = set()
        _wait(lambda: worker_answered(url, seen) >= workers, timeout, f"router: {workers} workers", proc)
        if wait_ready:
            ready: set[int] = set()
            _wait(lambda: worker_ready(url, ready) >= workers, timeout, f"router /ready on {workers} workers", proc)

    def log_text(self) -> str:
        """Everything the router wrote to its log file so far."""
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Stop gunicorn with ``sig`` (:func:`stop_gunicorn`); its exit status."""
        return stop_gunicorn(self.proc, sig, timeout)


def process_title(pid: int) -> str:
    """What ``ps`` shows for ``pid`` (``setproctitle`` rewrites ``/proc/PID/cmdline``); "" once gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


from narwhal.supervisor.process import TITLE as SUPERVISOR_TITLE  # noqa: E402
from narwhal.worker.admin import children_of  # noqa: E402  (the master's children, as admin counts them)


def router_roles(master: int) -> dict[str, list[int]]:
    """The master's children by the role their title names: the supervisor, and workers
    (gunicorn's ``worker [narwhal]``; a worker forked a moment ago still bears the master's
    title, and counts as a worker)."""
    roles: dict[str, list[int]] = {"master": [master], "worker": [], "supervisor": [], "other": []}
    for child in children_of(master):
        title = process_title(child)
        if title.startswith(SUPERVISOR_TITLE):
            roles["supervisor"].append(child)
        elif "worker" in title or "master" in title:
            roles["worker"].append(child)
        elif title:
            roles["other"].append(child)
    return roles




def stop_gunicorn(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
    """Signal the master, and repeat the signal to workers that are still there a second later.

    A worker forked a moment before the master's signal still runs the master's handlers
    until gunicorn installs its own, and loses the signal; the master never repeats it, so
    such a worker would live on until the graceful timeout. Quick starts and stops (tests,
    the demo) hit this window.
    """
    if proc.poll() is not None:
        return proc.returncode
    workers = children_of(proc.pid)
    proc.send_signal(sig)
    try:
        proc.wait(1.0)
    except subprocess.TimeoutExpired:
        for pid in workers:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode
