"""What the real-gunicorn tests share: the fake fleet's names and timeouts, starting a router,
bounded waits, unique prompts, sending requests (aiohttp, or raw ``http.client`` for header
bytes aiohttp's client would not send) and reading replies, and the admin API."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import io
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from narwhal.metric_tally import FLUSH_S
from narwhal.testing.asking import http_get
from narwhal.testing.harness import FakeFleet, RouterProcess, children_of, write_config

MODEL = "fake-model"


LEASE_S = 120


ENGINES = ["p0", "p1", "d0", "d1", "b0", "p2", "d2", "sp0", "sp1", "sd0", "sd1"]
# The session fleet's arguments (the default release, 0.33.0), which fixtures.release_fleet reuses.
FLEET_ARGS = ["--model", MODEL, "--lease-s", str(LEASE_S), "--block-size", "4", "--enable-scale-out",
              "--max-model-len", "1048576"]


TIMEOUTS = {
    "prefill_timeout_s": 2.5,
    "first_token_timeout_s": 2.5,
    "decode_read_timeout_s": 1.5,
}


def start_router(
    fleet: FakeFleet, engines: list[dict[str, Any]], tmp: Any, gunicorn_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None, wait_ready: bool = True, **sections: dict[str, Any],
) -> RouterProcess:
    for engine in engines:
        if "url" not in engine:  # an engine of another fleet comes with its own
            engine["url"] = fleet.engines[engine["name"]]
    conf = {
        "server": {"workers": 2},
        "engine": dict(TIMEOUTS),
        "preflight": {"on_start": False},
        "log": {"access_log": str(tmp / "access.log"), "level": "warning"},
        # Fault tests inject many failures: breakers stay out of their way unless a test
        # (test_supervisor) is about breakers. A stream cut after its first token ends as docs/behaviour.md "Failure
        # semantics"
        # says unless a test is about migrations (test_migration turns them on).
        "recovery": {"eject_after": 1000, "max_migrations": 0},
        # Every request through a pair unless a test is about follow-up turns: tests repeat
        # prompts, and a consumer that decoded one would take the repeat alone (docs/behaviour.md
        # "Placement").
        "placement": {"skip_prefill_share": 0},
    }
    for key, values in sections.items():
        conf.setdefault(key, {}).update(values)
    return RouterProcess.start(
        write_config(engines, conf), log_path=str(tmp / "router.log"), gunicorn_args=gunicorn_args,
        workers=int(conf["server"].get("workers", 2)), env=env, wait_ready=wait_ready,
    )


def access_log_of(router: RouterProcess) -> str:
    """The router's access log: ``access.log`` beside ``router.log``, as :func:`start_router` places it."""
    return router.log_path.replace("router.log", "access.log")


def access_line(router: RouterProcess, request_id: str, timeout: float = 5.0) -> dict[str, Any]:
    """The router's access-log line for ``request_id``, once written (bounded wait). The log is
    at :func:`access_log_of`."""
    path = access_log_of(router)

    def find() -> dict[str, Any] | None:
        for entry in complete_lines(path):
            if entry["request_id"] == request_id:
                return dict(entry)
        return None

    wait_until(lambda: find() is not None, timeout, f"the access log line of {request_id}")
    found = find()
    assert found is not None
    return found


def complete_lines(path: str) -> list[Any]:
    """The JSON lines a log file holds so far, parsed, but only those already ended by a newline.

    A reader racing a writer sees a line the kernel is still copying in (Linux page-cache reads
    are not atomic against an ``O_APPEND`` write): the last line without its newline is not
    written yet, so it is left for the next read rather than failing to parse."""
    with open(path, "rb") as f:
        data = f.read()
    return [orjson.loads(raw) for raw in data.split(b"\n")[:-1] if raw.strip()]


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g}s waiting for: {what}")


def settled(read: Any, expected: Any, timeout: float = 5.0) -> Any:
    """``read()`` once it returns ``expected`` (bounded), else its last value, for the caller's
    assert to show. For figures a worker updates just *after* the client has its response."""
    end = time.monotonic() + timeout
    value = read()
    while value != expected and time.monotonic() < end:
        time.sleep(0.05)
        value = read()
    return value


def scrape(router: RouterProcess) -> str:
    return http_get(router.url + "/metrics")[1].decode()


def value(text: str, name: str, **labels: str) -> float:
    """The sample of ``name`` with exactly ``labels`` in a scrape (0.0 when absent)."""
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = re.escape(name) + (r"\{" + re.escape(inner) + r"\}" if labels else "") + r" ([0-9.e+-]+)$"
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def at_rest(router: RouterProcess, *names: str, timeout: float = 10.0) -> str:
    """A scrape taken once every series whose name starts with one of ``names`` has held still
    for two tally flushes (bounded wait): the baseline of a counter delta.

    Why: a worker adds a request's counts up in its tally and writes them every ``FLUSH_S``
    (``narwhal.metric_tally``), after the client already has its answer; a scrape answered by
    the other worker may miss them. A baseline taken at once can therefore lack the previous
    test's last requests, which then land in this test's delta. Two flushes with nothing moving
    mean every count of a request that had ended before this call is in the scrape."""
    def watched(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith(names)]

    end = time.monotonic() + timeout
    text = scrape(router)
    last, since = watched(text), time.monotonic()
    while time.monotonic() - since <= 2 * FLUSH_S:
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {names} to hold still")
        time.sleep(0.05)
        text = scrape(router)
        if (now := watched(text)) != last:
            last, since = now, time.monotonic()
    return text


def unique_prompt(words: int = 12) -> str:
    tag = uuid.uuid4().hex
    return " ".join([tag] + [f"w{i}" for i in range(words - 1)])


def records(fleet: FakeFleet, engine: str, prompt: str) -> list[dict[str, Any]]:
    tag = prompt.split()[0]
    return fleet.control_request("GET", f"/engines/{engine}/requests?contains={tag}")["requests"]


def records_anywhere(fleet: FakeFleet, prompt: str, engines: list[str]) -> dict[str, list[dict[str, Any]]]:
    return {name: recs for name in engines if (recs := records(fleet, name, prompt))}


@dataclass
class Reply:
    status: int
    headers: Any
    raw: bytes

    @property
    def json(self) -> Any:
        return orjson.loads(self.raw)

    @property
    def events(self) -> list[bytes]:
        """The data payloads of an SSE body, in order."""
        out = []
        for event in self.raw.split(b"\n\n"):
            if event.startswith(b"data: "):
                out.append(event[6:])
        return out

    @property
    def text(self) -> str:
        """The generated text of a completions or chat stream."""
        parts = []
        for data in self.events:
            if data == b"[DONE]":
                continue
            obj = orjson.loads(data)
            for choice in obj.get("choices", []):
                parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        return "".join(parts)


def completion(prompt: str, *, stream: bool = True, max_tokens: int = 4, fake: Any = None, **extra: Any) -> dict:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "stream": stream, "max_tokens": max_tokens}
    if fake is not None:
        body["narwhal_fake"] = fake
    body.update(extra)
    return body


def chat(prompt: str, *, stream: bool = True, max_tokens: int = 4, fake: Any = None, **extra: Any) -> dict:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "stream": stream,
        "max_tokens": max_tokens,
    }
    if fake is not None:
        body["narwhal_fake"] = fake
    body.update(extra)
    return body


async def send(
    base: str,
    path: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
    method: str = "POST",
) -> Reply:
    data: Any = raw if raw is not None else (orjson.dumps(body) if body is not None else None)
    if isinstance(data, bytes) and len(data) > 1024 * 1024:
        data = io.BytesIO(data)  # aiohttp warns about large raw bodies
    hdrs = {"Content-Type": "application/json"}
    hdrs.update(headers or {})
    async with aiohttp.ClientSession() as session:
        async with session.request(method, base + path, data=data, headers=hdrs) as resp:
            return Reply(resp.status, resp.headers, await resp.read())


def router_addr(router: RouterProcess) -> tuple[str, int]:
    parts = urlsplit(router.url)
    assert parts.hostname == "127.0.0.1" and parts.port
    return parts.hostname, parts.port


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # names lower-cased
    body: bytes


def http_request(
    router: RouterProcess,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: list[tuple[str, str | bytes]] | None = None,
    timeout: float = 30.0,
) -> Answer:
    """One request over ``http.client``: header values go out as given (bytes unchanged, str
    as latin-1), which aiohttp's client would refuse or re-encode."""
    host, port = router_addr(router)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        sent = {k.lower() for k, _ in headers or ()}
        if "content-type" not in sent and body is not None:
            conn.putheader("Content-Type", "application/json")
        for name, value in headers or ():
            conn.putheader(name, value)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        try:
            conn.endheaders(body)
        except (BrokenPipeError, ConnectionResetError) as cut:
            # The router may answer (431: headers too large) and close before the body is sent;
            # its answer is still there to read, as curl reads it. No answer: the send's error.
            try:
                return _answer(conn.getresponse())
            except (OSError, http.client.HTTPException):
                raise cut from None
        return _answer(conn.getresponse())
    finally:
        conn.close()


def _answer(resp: http.client.HTTPResponse) -> Answer:
    data = resp.read()
    return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data)


def assert_openai_error(status: int, headers: dict[str, str], body: bytes) -> dict[str, Any]:
    obj = orjson.loads(body)
    assert set(obj) == {"error"}, body[:500]
    err = obj["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status, err
    assert isinstance(err["message"], str) and isinstance(err["type"], str), err
    return err


def expected_text(n: int) -> str:
    return "".join(f" t{i}" for i in range(n))


def error_of(reply: Reply) -> dict[str, Any]:
    body = reply.json
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def terminal_error(reply: Reply) -> dict[str, Any]:
    """The terminal error event of a stream that ended after HTTP 200 (no [DONE] after it)."""
    events = reply.events
    assert events, reply.raw
    assert b"[DONE]" not in events, reply.raw
    last = orjson.loads(events[-1])
    assert set(last) == {"error"}, last
    return last["error"]


TOKEN = "admin-secret"


AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def admin(router: RouterProcess, method: str = "GET", path: str = "/admin/engines") -> dict:
    reply = await send(router.url, path, method=method, headers=AUTH)
    assert reply.status == 200, reply.raw
    return reply.json


async def engine_entry(router: RouterProcess, name: str) -> dict:
    return next(e for e in (await admin(router))["engines"] if e["name"] == name)


async def wait_state(router: RouterProcess, name: str, state: str, timeout: float = 10) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        entry = await engine_entry(router, name)
        if entry["state"] == state:
            return entry
        await asyncio.sleep(0.02)
    raise AssertionError(f"{name} never became {state}: {entry}")


async def readmit_all(router: RouterProcess, names: list[str]) -> None:
    for name in names:
        await admin(router, "POST", f"/admin/engines/{name}/readmit")


@contextlib.asynccontextmanager
async def sessions_per_worker(router: RouterProcess, workers: int) -> AsyncIterator[dict[int, aiohttp.ClientSession]]:
    """One keep-alive session per worker, keyed by the worker's pid.

    A connection stays with the worker that accepted it, and ``/health`` names that worker.
    """
    sessions: dict[int, aiohttp.ClientSession] = {}
    spare: list[aiohttp.ClientSession] = []
    end = time.monotonic() + 20
    try:
        while len(sessions) < workers and time.monotonic() < end:
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
            async with session.get(router.url + "/health") as resp:
                pid = (await resp.json())["worker"]
            if pid in sessions:
                spare.append(session)
            else:
                sessions[pid] = session
        assert len(sessions) == workers, f"could not reach {workers} workers"
        yield sessions
    finally:
        for session in [*sessions.values(), *spare]:
            await session.close()


async def post(session: aiohttp.ClientSession, router: RouterProcess, body: dict) -> tuple[int, bytes]:
    async with session.post(router.url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.read()


def workers_of(router: RouterProcess) -> set[int]:
    """The router's live worker pids: booted per its log and still its children."""
    booted = {int(pid) for pid in re.findall(r"Booting worker with pid: (\d+)", router.log_text())}
    return booted & set(children_of(router.proc.pid))
