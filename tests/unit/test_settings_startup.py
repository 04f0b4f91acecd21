"""A bad setting stops the start with one line and exit status 2, never a traceback: narwhal serve, gunicorn
direct, the conf file."""

from __future__ import annotations

from pathlib import Path

import pytest

from narwhal.settings import SettingsError, load_settings
from tests.unit.settings_support import (
    BAD_TIMEOUT_TOML,
    NOT_A_NUMBER,
    REPO,
    VENV_PYTHON,
    assert_one_line_exit,
    clean_env,
    error_of,
    run,
    write,
)

# --------------------------------------------------------------------------- start-up: no traceback


def test_serve_with_bad_config_file_exits_2_with_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, BAD_TIMEOUT_TOML)
    proc = run([VENV_PYTHON, "-m", "narwhal", "serve", "--config", path], clean_env(), tmp_path)
    assert proc.returncode == 2
    assert_one_line_exit(proc, "engine.first_token_timeout_s: ")
    assert proc.stderr.strip() == "narwhal: invalid settings: " + NOT_A_NUMBER


def test_serve_with_missing_config_file_exits_2(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    proc = run([VENV_PYTHON, "-m", "narwhal", "serve", "--config", missing], clean_env(), tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"narwhal: invalid settings: config: file not found: {missing}"


def test_serve_with_bad_env_exits_2_with_one_line(tmp_path: Path) -> None:
    proc = run([VENV_PYTHON, "-m", "narwhal", "serve"], clean_env(NARWHAL_SERVER__WORKERS="0"), tmp_path)
    assert proc.returncode == 2
    assert_one_line_exit(proc, "server.workers: ")
    assert proc.stderr.strip() == (
        "narwhal: invalid settings: server.workers: Input should be greater than or equal to 1"
        " (from NARWHAL_SERVER__WORKERS)"
    )


def test_gunicorn_direct_with_bad_config_exits_with_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, BAD_TIMEOUT_TOML)
    proc = run(
        [VENV_PYTHON, "-m", "gunicorn", "-c", "python:narwhal.master.gunicorn_conf"],
        clean_env(NARWHAL_CONFIG=path),
        tmp_path,
    )
    assert_one_line_exit(proc, "engine.first_token_timeout_s: ")


def test_gunicorn_conf_file_with_bad_env_exits_with_one_line(tmp_path: Path) -> None:
    proc = run(
        [VENV_PYTHON, "-m", "gunicorn", "-c", str(REPO / "gunicorn.conf.py")],
        clean_env(NARWHAL_SERVER__WORKERS="0"),
        tmp_path,
    )
    assert_one_line_exit(proc, "server.workers: ")


def test_an_invalid_engine_version_specifier_stops_the_start(tmp_path: Path) -> None:
    toml = '[engine_contract]\nmodel = "m"\nengine_version = ">=zero"\n'
    with pytest.raises(SettingsError) as info:
        load_settings(write(tmp_path, toml), environ={})
    assert str(info.value) == "engine_contract.engine_version: invalid PEP 440 specifier '>=zero'"


NOT_A_VERSION = (
    "engine_contract.engine_version: invalid PEP 440 version 'not a version!' (expected a version such as "
    "0.11.0 or a specifier set such as >=0.11,<0.12)"
)
NOT_A_VERSION_TOML = '[engine_contract]\nmodel = "m"\nengine_version = "not a version!"\n'


def test_an_engine_version_that_is_no_pep440_version_stops_the_start(tmp_path: Path) -> None:
    # It used to start, and then every probe failed forever.
    assert error_of(tmp_path, NOT_A_VERSION_TOML) == NOT_A_VERSION
    assert error_of(tmp_path, '[engine_contract]\nengine_version = "0.11.*"\n') == (
        "engine_contract.engine_version: invalid PEP 440 version '0.11.*' (expected a version such as 0.11.0 "
        "or a specifier set such as >=0.11,<0.12)"
    )


def test_an_engine_version_from_the_environment_is_checked_too(tmp_path: Path) -> None:
    message = error_of(
        tmp_path, '[engine_contract]\nmodel = "m"\n', {"NARWHAL_ENGINE_CONTRACT__ENGINE_VERSION": "not a version!"}
    )
    assert message == NOT_A_VERSION + " (from NARWHAL_ENGINE_CONTRACT__ENGINE_VERSION)"


def test_serve_with_an_invalid_engine_version_exits_2_with_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, NOT_A_VERSION_TOML)
    proc = run([VENV_PYTHON, "-m", "narwhal", "serve", "--config", path], clean_env(), tmp_path)
    assert proc.returncode == 2
    assert_one_line_exit(proc, "engine_contract.engine_version: ")
    assert proc.stderr == "narwhal: invalid settings: " + NOT_A_VERSION + "\n"


def test_gunicorn_with_an_invalid_engine_version_exits_with_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, NOT_A_VERSION_TOML)
    proc = run(
        [VENV_PYTHON, "-m", "gunicorn", "-c", str(REPO / "gunicorn.conf.py")], clean_env(NARWHAL_CONFIG=path), tmp_path
    )
    assert_one_line_exit(proc, "engine_contract.engine_version: ")
    assert proc.stderr.strip() == "narwhal: invalid settings: " + NOT_A_VERSION


def test_an_exact_or_specifier_engine_version_is_accepted(tmp_path: Path) -> None:
    for pin in ("0.11.0", "0.11", "0.11.1.dev3+g0123abc", ">=0.10,<0.12", "~=0.11.0", "==0.11.*", ""):
        toml = f'[engine_contract]\nmodel = "m"\nengine_version = "{pin}"\n'
        assert load_settings(write(tmp_path, toml), environ={}).engine_contract.engine_version == pin
