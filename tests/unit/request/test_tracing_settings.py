"""[tracing]: validated at start (one line naming the key, the missing extra included), and
with tracing off nothing on the request path imports OpenTelemetry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from narwhal import settings as settings_module
from narwhal.settings import SettingsError, load_settings


def _error(tmp_path: Path, toml: str) -> str:
    path = tmp_path / "narwhal.toml"
    path.write_text(toml)
    with pytest.raises(SettingsError) as info:
        load_settings(str(path), environ={})
    return str(info.value)


def test_tracing_is_off_by_default_with_the_documented_defaults() -> None:
    tracing = load_settings(None, environ={}).tracing
    assert (tracing.enabled, tracing.endpoint, tracing.service_name, tracing.sample_ratio) == (
        False, "http://127.0.0.1:4318/v1/traces", "narwhal", 1.0)


def test_enabled_without_the_extra_is_one_line_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settings_module, "_tracing_installed", lambda: False)
    assert _error(tmp_path, "[tracing]\nenabled = true\n") == (
        "tracing: enabled = true needs the tracing extra: install Narwhal with [tracing], e.g. pip install "
        "'.[tracing]' in a clone (opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)"
    )


def test_enabled_with_the_extra_loads(tmp_path: Path) -> None:
    path = tmp_path / "narwhal.toml"
    path.write_text('[tracing]\nenabled = true\nendpoint = "https://otel.example:4318/v1/traces"\n')
    assert load_settings(str(path), environ={}).tracing.enabled is True


@pytest.mark.parametrize(("toml", "key"), [
    ("sample_ratio = 1.5", "tracing.sample_ratio"),
    ('endpoint = "otel:4318"', "tracing.endpoint"),
    ('service_name = ""', "tracing.service_name"),
    ("enable = true", "tracing.enable"),
])
def test_bad_values_name_the_key(tmp_path: Path, toml: str, key: str) -> None:
    assert _error(tmp_path, f"[tracing]\n{toml}\n").startswith(key + ": ")


def test_with_tracing_off_the_request_path_never_imports_opentelemetry() -> None:
    code = (
        "import sys, narwhal.front.app, narwhal.front.gunicorn_hooks, narwhal.request.router, narwhal.settings;"
        "narwhal.settings.load_settings(None, environ={});"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
