"""[tracing]: validated at start (one line naming the key, the missing extra included), and
with tracing off nothing on the request path imports OpenTelemetry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from narwhal.settings import SettingsError, TracingSettings, load_settings
from narwhal.settings import sections as settings_module


def _error(tmp_path: Path, toml: str) -> str:
    path = tmp_path / "narwhal.toml"
    path.write_text(toml)
    with pytest.raises(SettingsError) as info:
        load_settings(str(path), environ={})
    return str(info.value)


def test_tracing_is_off_by_default_and_leaves_the_rest_to_the_otel_variables() -> None:
    tracing = load_settings(None, environ={}).tracing
    assert (tracing.enabled, tracing.endpoint, tracing.service_name, tracing.sample_ratio) == (
        False, None, None, None)


_OTEL = ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_EXPORTER_OTLP_ENDPOINT",
         "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG")


@pytest.fixture
def otel_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in _OTEL:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _tracing(**values: object) -> TracingSettings:
    return TracingSettings.model_validate(values)


def test_unset_values_are_the_otel_variables_and_narwhals_own_win(otel_env: pytest.MonkeyPatch) -> None:
    from narwhal.request import tracing

    unset = _tracing()
    assert tracing.endpoint(unset) == "http://127.0.0.1:4318/v1/traces"
    assert tracing.resource(unset).attributes["service.name"] == "narwhal"
    assert tracing.sampler(unset).get_description() == ParentBased(TraceIdRatioBased(1.0)).get_description()
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")
    otel_env.setenv("OTEL_SERVICE_NAME", "router-eu")
    otel_env.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    assert tracing.endpoint(unset) == "http://collector:4318/v1/traces"  # the general one + /v1/traces
    assert tracing.resource(unset).attributes["service.name"] == "router-eu"
    assert tracing.sampler(unset).get_description() == ParentBased(TraceIdRatioBased(0.25)).get_description()
    otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "https://traces.example/otlp")
    otel_env.setenv("OTEL_TRACES_SAMPLER", "always_off")
    assert tracing.endpoint(unset) == "https://traces.example/otlp"  # the traces one, as given
    assert tracing.sampler(unset) is None  # the SDK builds the sampler the variables name
    own = _tracing(endpoint="http://mine:4318/v1/traces", service_name="mine", sample_ratio=0.5)
    assert tracing.endpoint(own) == "http://mine:4318/v1/traces"
    assert tracing.resource(own).attributes["service.name"] == "mine"
    assert tracing.sampler(own).get_description() == ParentBased(TraceIdRatioBased(0.5)).get_description()


def test_a_service_name_in_otel_resource_attributes_counts(otel_env: pytest.MonkeyPatch) -> None:
    from narwhal.request import tracing

    otel_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attrs,deployment.environment=prod")
    assert tracing.resource(_tracing()).attributes["service.name"] == "from-attrs"
    assert tracing.resource(_tracing(service_name="mine")).attributes["service.name"] == "mine"


def test_a_sampler_arg_that_is_no_ratio_samples_everything(otel_env: pytest.MonkeyPatch) -> None:
    from narwhal.request import tracing

    otel_env.setenv("OTEL_TRACES_SAMPLER_ARG", "lots")
    assert tracing.sampler(_tracing()).get_description() == ParentBased(TraceIdRatioBased(1.0)).get_description()


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
        "import sys, narwhal.worker.app, narwhal.master.gunicorn_hooks, narwhal.request.router, narwhal.settings;"
        "narwhal.settings.load_settings(None, environ={});"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
