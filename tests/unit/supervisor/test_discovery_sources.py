"""Discovery sources read for real (docs/behaviour.md "Engines that come and go"): files edited on disk, a DNS server
process on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from narwhal.settings.discovery import DiscoverySettings, DnsSource
from narwhal.supervisor.discovery.sources import DnsReader, SourceInvalid, SourceUnreadable, read_engines_file

ROOT = Path(__file__).resolve().parents[3]


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------- the file


def test_a_toml_file_names_engines_or_gets_role_host_port(tmp_path: Path) -> None:
    path = tmp_path / "engines.toml"
    path.write_text('[[engines]]\nurl = "http://127.0.0.2:8100"\nrole = "producer"\n\n'
                    '[[engines]]\nname = "d0"\nurl = "http://127.0.0.3:8200/"\nrole = "consumer"\n')
    assert [(s.name, s.url, s.role) for s in read_engines_file(str(path))] == [
        ("producer-127.0.0.2-8100", "http://127.0.0.2:8100", "producer"),
        ("d0", "http://127.0.0.3:8200", "consumer"),
    ]


def test_a_json_file_reads_the_same(tmp_path: Path) -> None:
    path = tmp_path / "engines.json"
    path.write_text(json.dumps({"engines": [{"url": "http://127.0.0.2:8100", "role": "both"}]}))
    assert [s.name for s in read_engines_file(str(path))] == ["both-127.0.0.2-8100"]


@pytest.mark.parametrize(("text", "line"), [
    ('[[engines]]\nurl = "http://h:1"\nrole = "decoder"\n',
     "engines.0.role: Input should be 'producer', 'consumer' or 'both'"),
    ('[[engines]]\nurl = "http://h:1"\nrole = "producer"\n\n[[engines]]\nurl = "h:2"\nrole = "consumer"\n',
     "engines.1.url: expected an http:// or https:// URL"),
    ('[[engines]]\nurl = "http://h:1"\nrole = "producer"\nmax_inflight = 3\n',
     "engines.0.max_inflight: unknown setting"),
    ('[[engines]]\nname = "x"\nurl = "http://h:1"\nrole = "producer"\n\n'
     '[[engines]]\nname = "x"\nurl = "http://h:2"\nrole = "consumer"\n', "duplicate engine name 'x'"),
    ('[engines]\nurl = "http://h:1"\n', "engines: expected a list of entries ([[engines]])"),
    ('[server]\nworkers = 3\n', "expected only [[engines]] entries"),
    # an unnamed entry's port out of range raised a plain ValueError
    ('[[engines]]\nurl = "http://h:99999"\nrole = "producer"\n', "engines.0.url: Port out of range 0-65535"),
])
def test_a_file_that_parses_but_is_wrong_is_refused_with_the_entry_and_key(
    tmp_path: Path, text: str, line: str
) -> None:
    path = tmp_path / "engines.toml"
    path.write_text(text)
    with pytest.raises(SourceInvalid) as err:
        read_engines_file(str(path))
    assert str(err.value) == f"{path}: {line}"


def test_a_missing_or_unparsable_file_is_unreadable_not_invalid(tmp_path: Path) -> None:
    with pytest.raises(SourceUnreadable, match="cannot read .*: No such file or directory"):
        read_engines_file(str(tmp_path / "gone.toml"))
    (tmp_path / "half.toml").write_text('[[engines]]\nurl = "http://h:1\n')
    with pytest.raises(SourceUnreadable, match="does not parse"):
        read_engines_file(str(tmp_path / "half.toml"))


# ------------------------------------------------------------------------------------- DNS


@pytest.fixture()
def dns_server(tmp_path: Path) -> Iterator[tuple[Path, int, subprocess.Popen[str]]]:
    records = tmp_path / "records.json"
    records.write_text("{}")
    proc = subprocess.Popen([sys.executable, "-m", "tests.dns_server", str(records)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()  # blocks until the server is bound, or EOF if it died
    assert first.startswith("PORT "), first
    try:
        yield records, int(first.split()[1]), proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()


def reader(port: int) -> DnsReader:
    return DnsReader(DiscoverySettings(resolver=f"127.0.0.1:{port}"), timeout_s=1.0)


def test_a_records_are_engines_on_the_configured_port(dns_server: tuple[Path, int, subprocess.Popen[str]]) -> None:
    records, port, _ = dns_server
    write_atomically(records, json.dumps({"prefill.test.": {"A": ["127.0.0.3", "127.0.0.2"], "AAAA": ["::1"]}}))
    source = DnsSource(name="prefill.test", port=8100, role="producer")
    specs = asyncio.run(reader(port).read(source))
    assert [(s.name, s.url) for s in specs] == [
        ("producer-127.0.0.2-8100", "http://127.0.0.2:8100"),
        ("producer-127.0.0.3-8100", "http://127.0.0.3:8100"),
        ("producer---1-8100", "http://[::1]:8100"),
    ]


def test_a_dns_name_gives_its_caps_to_every_engine_it_lists(
    dns_server: tuple[Path, int, subprocess.Popen[str]]
) -> None:
    records, port, _ = dns_server
    write_atomically(records, json.dumps({"decode.test.": {"A": ["127.0.0.2", "127.0.0.3"]}}))
    source = DnsSource(name="decode.test", port=8200, role="consumer", max_inflight_decode=85)
    specs = asyncio.run(reader(port).read(source))
    assert [(s.max_inflight_decode, s.max_inflight_prefill) for s in specs] == [(85, None), (85, None)]


def test_srv_records_give_each_engine_its_port(dns_server: tuple[Path, int, subprocess.Popen[str]]) -> None:
    records, port, _ = dns_server
    write_atomically(records, json.dumps({
        "_vllm._tcp.decode.test.": {"SRV": [[0, 0, 8201, "d1.test."], [0, 0, 8200, "d0.test."]]},
        "d0.test.": {"A": ["127.0.0.4"]}, "d1.test.": {"A": ["127.0.0.5"]},
    }))
    source = DnsSource(name="_vllm._tcp.decode.test", srv=True, role="consumer", scheme="https")
    specs = asyncio.run(reader(port).read(source))
    assert [s.url for s in specs] == ["https://127.0.0.4:8200", "https://127.0.0.5:8201"]


def test_a_name_scaled_to_zero_is_an_empty_answer(dns_server: tuple[Path, int, subprocess.Popen[str]]) -> None:
    _, port, _ = dns_server
    assert asyncio.run(reader(port).read(DnsSource(name="gone.test", port=1, role="producer"))) == []


def test_servfail_and_a_server_gone_are_unreadable(dns_server: tuple[Path, int, subprocess.Popen[str]]) -> None:
    records, port, proc = dns_server
    write_atomically(records, json.dumps({"broken.test.": "SERVFAIL"}))
    with pytest.raises(SourceUnreadable, match="DNS A broken.test"):
        asyncio.run(reader(port).read(DnsSource(name="broken.test", port=1, role="producer")))
    proc.terminate()
    proc.wait(timeout=10)
    with pytest.raises(SourceUnreadable, match="DNS A prefill.test"):
        asyncio.run(reader(port).read(DnsSource(name="prefill.test", port=1, role="producer")))


def test_the_dns_settings_say_what_is_missing() -> None:
    with pytest.raises(ValueError, match="a port is needed unless srv = true"):
        DnsSource(name="x.test", role="producer")
    with pytest.raises(ValueError, match="expected HOST:PORT of a DNS server"):
        DiscoverySettings(resolver="127.0.0.1")
