"""The real-server tests' raw client (``tests.real_gunicorn.support.http_request``) reads the
answer a server sent before it closed on a request still being sent (a 431 for headers too
large), as curl does, instead of failing the test on the send's broken pipe."""

from __future__ import annotations

import socket
import threading
import types
from typing import Any

from tests.real_gunicorn.support import http_request

_ANSWER = b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 2\r\nConnection: close\r\n\r\nno"


def _answer_early_and_close(server: socket.socket) -> None:
    conn, _ = server.accept()
    conn.recv(100)  # the rest left unread: the close resets the connection
    conn.sendall(_ANSWER)
    conn.close()


def test_an_answer_sent_before_the_request_was_all_sent_is_read() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        thread = threading.Thread(target=_answer_early_and_close, args=(server,))
        thread.start()
        router: Any = types.SimpleNamespace(url=f"http://127.0.0.1:{server.getsockname()[1]}")
        # Headers beyond the sockets' buffers: the body is sent after the server closed.
        big = [(f"x-big-{i}", "v" * 6000) for i in range(400)]
        answer = http_request(router, "POST", "/v1/completions", b"{}", headers=big, timeout=10)
        thread.join(10)
    assert (answer.status, answer.body) == (431, b"no")
