"""The entry points a user types: ``narwhal serve``, ``gunicorn -c gunicorn.conf.py``, ``narwhal demo``."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import pytest

from narwhal.testing.asking import http_get
from narwhal.testing.harness import FakeFleet, children_of, router_roles, stop_gunicorn, write_config
from tests.real_gunicorn.support import MODEL, wait_until

ROOT = Path(__file__).resolve().parents[3]


def _listening_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    sock.set_inheritable(True)
    return sock


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("NARWHAL_")}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.update(extra)
    return env


def _stop(proc: subprocess.Popen[bytes], config: str) -> bytes:
    """Stop the router, remove its config; return what it wrote to stderr."""
    stop_gunicorn(proc)
    assert proc.stderr is not None
    err = proc.stderr.read()
    proc.stderr.close()
    os.unlink(config)
    return err


def _post(url: str, body: dict) -> tuple[int, bytes]:
    import urllib.request

    req = urllib.request.Request(url, data=orjson.dumps(body), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status, resp.read()


@pytest.mark.parametrize(
    "command",
    [
        [sys.executable, "-m", "narwhal", "serve", "--config", "{config}"],
        [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py"],
    ],
    ids=["narwhal-serve", "gunicorn-conf"],
)
def test_the_router_starts_serves_and_stops_cleanly(fleet: FakeFleet, command: list[str]) -> None:
    config = write_config(
        [{"name": "p0", "url": fleet.engines["p0"], "role": "producer"},
         {"name": "d0", "url": fleet.engines["d0"], "role": "consumer"}],
        {"preflight": {"on_start": False}, "log": {"access_log": ""}},
    )
    sock = _listening_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    env = _clean_env(NARWHAL_SERVER__BIND=f"fd://{sock.fileno()}", NARWHAL_CONFIG=config)
    argv = [part.replace("{config}", config) for part in command]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, pass_fds=[sock.fileno()], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    sock.close()
    try:
        wait_until(lambda: http_get(url + "/ready")[0] == 200, 20, "router ready")
        status, raw = _post(url + "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 2})
        assert status == 200 and orjson.loads(raw)["choices"][0]["text"] == " t0 t1"
        # 2 workers and the supervisor, each named in its title; nothing below them.
        wait_until(lambda: len(router_roles(proc.pid)["supervisor"]) == 1, 10, "the supervisor named")
        roles = router_roles(proc.pid)
        children = children_of(proc.pid)
        assert len(roles["worker"]) == 2 and len(children) == 3 and roles["other"] == []
        assert sum(len(children_of(c)) for c in children) == 0
        created = _metrics_dirs_of(children)
        assert len(created) == 1
    finally:
        err = _stop(proc, config)
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err
    # The metrics directory the master created is gone with it.
    assert not any(os.path.exists(path) for path in created)


def test_demo_prints_how_to_use_it_and_stops_everything_on_ctrl_c() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "narwhal", "demo", "--port", "0"],
        cwd=ROOT, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        banner = b""
        deadline = time.monotonic() + 30
        while b"Press Ctrl-C" not in banner and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            banner += line
        text = banner.decode()
        assert "curl -N http://127.0.0.1:" in text and "from openai import OpenAI" in text
        url = re.search(r"routing on (http://127\.0\.0\.1:\d+)", text)
        assert url is not None, text
        status, raw = _post(url.group(1) + "/v1/chat/completions",
                            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert status == 200
        started = _descendants(proc.pid)
        assert len(started) >= 4  # the fleet, the gunicorn master and its 2 workers
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in started),
               20, "every process the demo started is gone")


def _descendants(root: int) -> set[int]:
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent_of[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parent_of.items() if ppid in frontier} - found
        found |= frontier
    return found



def test_kill_9_of_the_master_takes_every_process_with_it_and_leaves_nothing(fleet: FakeFleet) -> None:
    config = write_config(
        [{"name": "p0", "url": fleet.engines["p0"], "role": "producer"},
         {"name": "d0", "url": fleet.engines["d0"], "role": "consumer"}],
        {"preflight": {"on_start": False}, "log": {"access_log": ""}},
    )
    shm_before = set(os.listdir("/dev/shm"))
    sock = _listening_socket()
    port = sock.getsockname()[1]
    env = _clean_env(NARWHAL_SERVER__BIND=f"fd://{sock.fileno()}", NARWHAL_CONFIG=config)
    proc = subprocess.Popen([sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py"], cwd=ROOT,
                            env=env, pass_fds=[sock.fileno()], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    sock.close()
    try:
        wait_until(lambda: http_get(f"http://127.0.0.1:{port}/ready")[0] == 200, 20, "router ready")
        wait_until(lambda: len(_descendants(proc.pid)) == 3, 10, "2 workers and the supervisor")
        family = _descendants(proc.pid)
        proc.kill()
        proc.wait()
        wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in family), 10,
                   "workers and supervisor gone with the master")
    finally:
        os.unlink(config)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with pytest.raises(ConnectionRefusedError):  # nobody listens on the port any more
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert set(os.listdir("/dev/shm")) == shm_before


def _metrics_dirs_of(pids: list[int]) -> set[str]:
    """The prometheus multiprocess directories these processes have files mapped from."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    path = line.split()[-1]
                    if "/narwhal-metrics-" in path:
                        found.add(os.path.dirname(path))
        except OSError:
            continue
    return found


def test_a_unix_socket_bind_serves_through_every_worker(fleet: FakeFleet, tmp_path: Path) -> None:
    # unix:PATH listeners go through narwhal.worker.accept like TCP ones (no TCP_NODELAY there).
    config = write_config(
        [{"name": "p0", "url": fleet.engines["p0"], "role": "producer"},
         {"name": "d0", "url": fleet.engines["d0"], "role": "consumer"}],
        {"preflight": {"on_start": False}, "log": {"access_log": ""}},
    )
    path = str(tmp_path / "narwhal.sock")
    env = _clean_env(NARWHAL_SERVER__BIND=f"unix:{path}", NARWHAL_CONFIG=config)
    proc = subprocess.Popen([sys.executable, "-m", "narwhal", "serve", "--config", config], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    seen: set[int] = set()

    def health() -> bool:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(5)
                s.connect(path)
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
        except OSError:
            return False
        head, _, body = data.partition(b"\r\n\r\n")
        if head.startswith(b"HTTP/1.1 200"):
            seen.add(int(orjson.loads(body)["worker"]))
        return len(seen) == 2

    try:
        wait_until(health, 20, "both workers answering on the unix socket")
    finally:
        err = _stop(proc, config)
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err


def test_narwhal_workers_measures_a_worker_count_with_what_the_wheel_carries(tmp_path: Path) -> None:
    # deploy/README.md "Sizing": the sweep from an installed router (fake engines and gunicorn on
    # 127.0.0.1), not only the perf suite in a clone: one count, briefly; everything it started
    # is gone once it returns.
    scratch = set(Path(tempfile.gettempdir()).glob("narwhal-workers-*"))
    proc = subprocess.run([sys.executable, "-m", "narwhal", "workers", "--counts", "1", "--seconds", "0.5",
                           "--concurrency", "8"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=_clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = re.search(r"^ +1 worker\(s\): +([0-9.]+) req/s, +([0-9]+) µs of router CPU per request$", proc.stdout, re.M)
    assert row is not None and float(row.group(1)) > 0 and int(row.group(2)) > 0, proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1].startswith("server.workers = 1  "), proc.stdout
    # Its fake engines (the only processes with its model's name) stopped with it.
    left = lambda: subprocess.run(["pgrep", "-f", "sizing-model"], capture_output=True).returncode != 1  # noqa: E731
    wait_until(lambda: not left(), 10, "narwhal workers' fake engines gone")
    assert set(Path(tempfile.gettempdir()).glob("narwhal-workers-*")) == scratch  # its router logs too
