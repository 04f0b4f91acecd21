"""``NARWHAL_`` variables of every kind (docs/settings.md): a bad one is one line naming the variable and
the form expected, through ``load_settings`` and through the real start-up paths (``narwhal
serve`` and ``gunicorn -c gunicorn.conf.py``), never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from narwhal.settings import load_settings
from tests.unit.settings_support import REPO, VENV_PYTHON, assert_one_line_exit, clean_env, error_of, run

STRINGS = 'expected a JSON list of strings, such as ["key1", "key2"]'
ENGINES = 'expected a JSON list of objects, such as [{"name": "p0", "url": "http://10.0.0.5:8100", "role": "producer"}]'
ONE_ENGINE = '[{"name": "p0", "url": "http://10.0.0.5:8100", "role": "both"}]'


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        # Values pydantic-settings must decode as JSON: once its own traceback, exit 1.
        ("NARWHAL_SERVER__API_KEYS", "k1,k2", f"server.api_keys: {STRINGS} (from NARWHAL_SERVER__API_KEYS)"),
        ("NARWHAL_SERVER__API_KEYS", '["k1"', f"server.api_keys: {STRINGS} (from NARWHAL_SERVER__API_KEYS)"),
        ("NARWHAL_SERVER__API_KEYS", "", f"server.api_keys: {STRINGS} (from NARWHAL_SERVER__API_KEYS)"),
        ("NARWHAL_SERVER__API_KEYS", '{"k": 1}', f"server.api_keys: {STRINGS} (from NARWHAL_SERVER__API_KEYS)"),
        ("narwhal_server__api_keys", "k1", f"server.api_keys: {STRINGS} (from narwhal_server__api_keys)"),
        ("NARWHAL_ENGINES", "p0", f"engines: {ENGINES} (from NARWHAL_ENGINES)"),
        ("NARWHAL_ENGINES", '{"name": "p0"}', f"engines: {ENGINES} (from NARWHAL_ENGINES)"),
        ("NARWHAL_SERVER", "workers=4",
         'server: expected a JSON object of its keys, such as {"bind": ...} (from NARWHAL_SERVER)'),
        ("NARWHAL_ENGINE_CONTRACT", "0.11.0",
         'engine_contract: expected a JSON object of its keys, such as {"model": ...} (from NARWHAL_ENGINE_CONTRACT)'),
        # JSON of the right kind, wrong inside: pydantic's line, naming the variable that set it.
        ("NARWHAL_SERVER__API_KEYS", "[1]",
         "server.api_keys.0: Input should be a valid string (from NARWHAL_SERVER__API_KEYS)"),
        ("NARWHAL_ENGINES", '[{"name": "p0"}]', "engines.0.url: Field required (from NARWHAL_ENGINES)"),
        ("NARWHAL_TRACING", '{"enabled": "x"}',
         "tracing.enabled: Input should be a valid boolean, unable to interpret input (from NARWHAL_TRACING)"),
        # Plain values of the wrong type.
        ("NARWHAL_SERVER__WORKERS", "abc",
         "server.workers: Input should be a valid integer, unable to parse string as an integer "
         "(from NARWHAL_SERVER__WORKERS)"),
        ("NARWHAL_PLACEMENT__PREFIX_AFFINITY", "maybe",
         "placement.prefix_affinity: Input should be a valid boolean, unable to interpret input "
         "(from NARWHAL_PLACEMENT__PREFIX_AFFINITY)"),
        ("NARWHAL_LOG__LEVEL", "loud",
         "log.level: Input should be 'debug', 'info', 'warning', 'error' or 'critical' (from NARWHAL_LOG__LEVEL)"),
        # Names inside a list or a plain value: pydantic-settings cannot set those.
        ("NARWHAL_ENGINES__0__URL", "http://x:1",
         "NARWHAL_ENGINES__0__URL: unknown setting; engines is set whole, in NARWHAL_ENGINES"),
        ("NARWHAL_SERVER__WORKERS__MAX", "3",
         "NARWHAL_SERVER__WORKERS__MAX: unknown setting; server.workers is set whole, in NARWHAL_SERVER__WORKERS"),
        ("NARWHAL_SERVER__API_KEYS__0", "k1",
         "NARWHAL_SERVER__API_KEYS__0: unknown setting; server.api_keys is set whole, in NARWHAL_SERVER__API_KEYS"),
    ],
)
def test_a_bad_environment_value_is_one_line_naming_the_variable_and_the_form(
    tmp_path: Path, name: str, value: str, message: str
) -> None:
    assert error_of(tmp_path, None, {name: value}) == message


def test_list_and_object_settings_take_json_from_the_environment() -> None:
    s = load_settings(None, environ={
        "NARWHAL_SERVER__API_KEYS": '["k1", "k,2"]',
        "NARWHAL_ENGINES": ONE_ENGINE,
        "NARWHAL_ENGINE_CONTRACT": '{"model": "m", "engine_version": ">=0.11"}',
        "NARWHAL_RECOVERY": '{"eject_after": 5}',
    })
    assert s.server.api_keys == ["k1", "k,2"]
    assert [(e.name, e.role) for e in s.engines] == [("p0", "both")]
    assert s.engine_contract is not None and s.engine_contract.engine_version == ">=0.11"
    assert s.recovery.eject_after == 5
    assert load_settings(None, environ={"NARWHAL_ENGINE_CONTRACT": "null"}).engine_contract is None


START = {
    "NARWHAL_SERVER__API_KEYS": ("k1,k2", f"server.api_keys: {STRINGS} (from NARWHAL_SERVER__API_KEYS)"),
    "NARWHAL_ENGINES": ("p0", f"engines: {ENGINES} (from NARWHAL_ENGINES)"),
    "NARWHAL_SERVER__WORKERS": ("abc", "server.workers: Input should be a valid integer, unable to parse string "
                                "as an integer (from NARWHAL_SERVER__WORKERS)"),
}


@pytest.mark.parametrize("name", sorted(START))
@pytest.mark.parametrize("how", ["serve", "gunicorn"])
def test_the_start_up_paths_exit_with_that_one_line(tmp_path: Path, name: str, how: str) -> None:
    value, message = START[name]
    if how == "serve":
        proc = run([VENV_PYTHON, "-m", "narwhal", "serve"], clean_env(**{name: value}), tmp_path)
        assert proc.returncode == 2
    else:
        args = [VENV_PYTHON, "-m", "gunicorn", "-c", str(REPO / "gunicorn.conf.py")]
        proc = run(args, clean_env(**{name: value}), tmp_path)
    assert_one_line_exit(proc, message.split(":")[0])
    assert proc.stderr == f"narwhal: invalid settings: {message}\n"
