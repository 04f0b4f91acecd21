"""``GET /version`` and ``narwhal_build_info``: what a router runs and which engine version it pins.

Through real gunicorn (2 workers, multiprocess metrics): each worker publishes the same build
info, and the scrape must show it once, not once per worker.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import orjson
import pytest

from narwhal.settings import load_settings
from narwhal.testing.asking import http_get
from narwhal.testing.harness import FakeFleet, RouterProcess
from narwhal.worker.app import version_document
from tests.real_gunicorn.support import start_router

VERSION = metadata.version("narwhal-router")
PIN = ">=0.33,<0.34"


@pytest.fixture(scope="module")
def pinned_router(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    engines = [{"name": "p0", "role": "producer"}, {"name": "d0", "role": "consumer"}]
    proc = start_router(fleet, engines, tmp_path_factory.mktemp("version"),
                        engine_contract={"model": "fake-model", "engine_version": PIN})
    yield proc
    proc.stop()


def test_version_names_the_router_and_the_pinned_engine_version(pinned_router: RouterProcess) -> None:
    status, body = http_get(pinned_router.url + "/version")
    assert status == 200
    assert orjson.loads(body) == {"version": VERSION, "engine_version": PIN}


def test_build_info_is_one_series_across_the_workers(pinned_router: RouterProcess) -> None:
    text = http_get(pinned_router.url + "/metrics")[1].decode()
    lines = [line for line in text.splitlines() if line.startswith("narwhal_build_info")]
    assert lines == [f'narwhal_build_info{{engine_version="{PIN}",version="{VERSION}"}} 1.0']
    assert re.search(r"^# TYPE narwhal_build_info gauge$", text, re.MULTILINE)


def test_without_a_contract_the_pin_is_null(tmp_path: Path) -> None:
    config = tmp_path / "narwhal.toml"
    config.write_text("")
    assert version_document(load_settings(str(config), environ={})) == {"version": VERSION, "engine_version": None}
