"""``Type=notify`` in deploy/systemd/narwhal.service is true of the real process tree.

systemd (``NotifyAccess=main``) accepts ``READY=1`` only from the unit's main pid, and
``systemctl start`` returns when it arrives. gunicorn's arbiter sends it once ``on_starting``
(shared memory, the preflight at start, the supervisor) has run and the listeners exist;
``narwhal serve`` execs gunicorn in place, so the sender must be the very pid systemd started.
The socket here plays systemd's part: the kernel stamps each datagram with its sender's pid.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import orjson

from narwhal.testing.asking import http_get
from narwhal.testing.harness import FakeFleet, stop_gunicorn, write_config
from tests.real_gunicorn.support import wait_until

ROOT = Path(__file__).resolve().parents[3]
UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _receive(sock: socket.socket) -> tuple[bytes, int]:
    """One notification and the pid the kernel says sent it."""
    data, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(UCRED.size))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            return data, UCRED.unpack(payload[: UCRED.size])[0]
    raise AssertionError("no sender credentials on the notification")


def test_ready_comes_from_the_main_pid_after_the_preflight(fleet: FakeFleet, tmp_path: Path) -> None:
    name = f"narwhal-notify-{uuid.uuid4().hex}"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    notify.bind("\0" + name)  # abstract: no path length limit, nothing left on disk
    notify.settimeout(60)
    config = write_config(
        [{"name": "p0", "url": fleet.engines["p0"], "role": "producer"},
         {"name": "d0", "url": fleet.engines["d0"], "role": "consumer"}],
        {"preflight": {"on_start": True}, "log": {"access_log": ""}},
    )
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.set_inheritable(True)
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("NARWHAL_")}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.update(NOTIFY_SOCKET="@" + name, NARWHAL_SERVER__BIND=f"fd://{listener.fileno()}")
    stderr_path = tmp_path / "stderr.log"
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "narwhal", "serve", "--config", config], cwd=ROOT, env=env,
            pass_fds=[listener.fileno()], stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
        )
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()
    try:
        message, sender = _receive(notify)
        # Everything the start printed before READY=1 is already in the file.
        before_ready = stderr_path.read_text()
        # Stop only once the workers serve: a worker forked during the stop would miss it.
        wait_until(lambda: http_get(url + "/health")[0] == 200, 30, "workers serving")
    finally:
        stop_gunicorn(proc)
        notify.close()
        os.unlink(config)
    assert message == b"READY=1\nSTATUS=Gunicorn arbiter booted"
    assert sender == proc.pid
    # log.format = "json" (the default): the start-up preflight report is one JSON line too.
    reports = [line for line in map(orjson.loads, re.findall(r"^\{.*\}$", before_ready, re.MULTILINE))
               if line.get("logger") == "narwhal.preflight"]
    # One progress line per engine and pair as each ended, then the report.
    assert sorted(r["message"].split(": ok")[0] for r in reports[:-1]) == [
        "preflight: engine d0", "preflight: engine p0", "preflight: pair p0 -> d0"], before_ready
    assert reports[-1]["message"] == "preflight: ok (2 engines, 1 pairs)", before_ready
    assert reports[-1]["level"] == "info" and [e["name"] for e in reports[-1]["preflight"]["engines"]] == ["p0", "d0"]
    assert proc.returncode == 0
