"""A real DNS server on 127.0.0.1 for the discovery tests, run as its own process.

``python -m tests.dns_server RECORDS_JSON`` serves, over UDP and TCP on one ephemeral port it
prints as ``PORT <n>`` on its first line, the records of a JSON file re-read on every query, so
a test changes the fleet by rewriting the file (atomically: write, then rename)::

    {"vllm-prefill.test.": {"A": ["127.0.0.2"], "AAAA": [],
                            "SRV": [[0, 0, 8100, "p0.test."]]},
     "p0.test.": {"A": ["127.0.0.2"]}}

A name that is absent answers NXDOMAIN; a name whose value is ``"SERVFAIL"`` answers SERVFAIL.
Built on dnslib (a well-kept DNS package) so that the router's resolver meets real DNS
messages, never a patched resolver (docs/behaviour.md "Engines that come and go").
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
from typing import Any

from dnslib import AAAA, QTYPE, RCODE, RR, SRV, A, DNSRecord
from dnslib.server import BaseResolver, DNSLogger, DNSServer

TTL = 1


class FileResolver(BaseResolver):  # type: ignore[misc]  # dnslib has no type hints
    def __init__(self, path: str) -> None:
        self.path = path

    def resolve(self, request: DNSRecord, handler: Any) -> DNSRecord:
        reply = request.reply()
        qname = str(request.q.qname)
        qtype = QTYPE[request.q.qtype]
        with open(self.path) as f:
            records = json.load(f)
        entry = records.get(qname)
        if entry is None:
            reply.header.rcode = RCODE.NXDOMAIN
        elif entry == "SERVFAIL":
            reply.header.rcode = RCODE.SERVFAIL
        else:
            for value in entry.get(qtype, []):
                if qtype == "A":
                    reply.add_answer(RR(qname, QTYPE.A, rdata=A(value), ttl=TTL))
                elif qtype == "AAAA":
                    reply.add_answer(RR(qname, QTYPE.AAAA, rdata=AAAA(value), ttl=TTL))
                elif qtype == "SRV":
                    prio, weight, port, target = value
                    reply.add_answer(RR(qname, QTYPE.SRV, rdata=SRV(prio, weight, port, target), ttl=TTL))
        return reply


def free_port() -> int:
    """A port free for both UDP and TCP on 127.0.0.1 (dnslib binds each by number)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port = udp.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
                try:
                    tcp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return int(port)


def main(argv: list[str]) -> int:
    resolver = FileResolver(argv[0])
    port = free_port()
    quiet = DNSLogger(logf=lambda _line: None)  # one line per query otherwise
    servers = [DNSServer(resolver, address="127.0.0.1", port=port, tcp=tcp, logger=quiet) for tcp in (False, True)]
    for server in servers:
        server.start_thread()
    print(f"PORT {port}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    done.wait()
    for server in servers:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
