"""Settings (docs/settings.md): valid loads, file errors, unknown keys and invalid values, each a one-line error naming
the key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from narwhal.settings import Settings, SettingsError, load_settings
from tests.unit.settings_support import (
    BAD_TIMEOUT_TOML,
    NOT_A_NUMBER,
    TWO_ENGINES,
    error_of,
    write,
)

# --------------------------------------------------------------------------- valid loads


def test_defaults_without_file_or_env() -> None:
    s = load_settings(None, environ={})
    assert s.server.bind == "127.0.0.1:8700"
    assert s.server.workers == 2
    assert s.server.max_engines == 64
    assert s.engine.prefill_timeout_s == 30
    assert s.engine.first_token_timeout_s == 30
    assert s.engine.decode_read_timeout_s == 20
    assert (s.handoff.max_age_s, s.handoff.lease_s) == (20, 30)
    assert s.placement.max_queue == 1024
    assert s.recovery.max_retries == 0
    assert s.recovery.retry_budget_ratio == 0.2
    assert s.recovery.eject_after == 3
    assert s.preflight.on_start is True
    assert s.engine_contract is None
    assert s.engines == []


def test_toml_file_is_read(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nworkers = 4\nbind = \"0.0.0.0:9000\"\n" + TWO_ENGINES)
    s = load_settings(path, environ={})
    assert s.server.workers == 4
    assert s.server.bind == "0.0.0.0:9000"
    assert [(e.name, e.url, e.role) for e in s.engines] == [
        ("p0", "http://10.0.0.5:8100", "producer"),
        ("d0", "http://10.0.0.6:8200", "consumer"),
    ]


def test_config_path_from_narwhal_config(tmp_path: Path) -> None:
    path = write(tmp_path, "[request]\ndeadline_s = 12\n")
    s = load_settings(None, environ={"NARWHAL_CONFIG": path})
    assert s.request.deadline_s == 12


def test_env_overrides_toml_nested_value(tmp_path: Path) -> None:
    path = write(tmp_path, "[engine]\nprefill_timeout_s = 10\nfirst_token_timeout_s = 25\n")
    s = load_settings(path, environ={"NARWHAL_ENGINE__FIRST_TOKEN_TIMEOUT_S": "5"})
    assert s.engine.first_token_timeout_s == 5
    assert s.engine.prefill_timeout_s == 10  # the rest of the TOML section survives
    assert s.engine.decode_read_timeout_s == 20


def test_env_without_toml() -> None:
    s = load_settings(None, environ={"NARWHAL_SERVER__WORKERS": "7", "NARWHAL_LOG__LEVEL": "debug"})
    assert s.server.workers == 7
    assert s.log.level == "debug"


def test_load_settings_leaves_os_environ_alone() -> None:
    before = dict(os.environ)
    load_settings(None, environ={"NARWHAL_SERVER__WORKERS": "3"})
    assert dict(os.environ) == before


def test_non_narwhal_env_is_ignored() -> None:
    s = load_settings(None, environ={"PATH": "/usr/bin", "HOME": "/root", "WORKERS": "0"})
    assert s.server.workers == 2


def test_connector_defaults(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, TWO_ENGINES), environ={})
    assert [s.connector_of(e) for e in s.engines] == ["NixlConnector", "NixlConnector"]
    toml = '[engine_contract]\nkv_connector = "X"\n' + TWO_ENGINES.replace(
        'role = "consumer"', 'role = "consumer"\nkv_connector = "Y"'
    )
    s = load_settings(write(tmp_path, toml, "b.toml"), environ={})
    assert [s.connector_of(e) for e in s.engines] == ["X", "Y"]


# --------------------------------------------------------------------------- file errors


def test_named_config_file_missing(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(SettingsError) as info:
        load_settings(missing, environ={})
    assert str(info.value) == f"config: file not found: {missing}"


def test_config_env_naming_missing_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(SettingsError) as info:
        load_settings(None, environ={"NARWHAL_CONFIG": missing})
    assert str(info.value) == f"config: file not found: {missing}"


def test_invalid_toml(tmp_path: Path) -> None:
    path = write(tmp_path, "[server\nworkers = 2\n")
    message = error_of(tmp_path, "[server\nworkers = 2\n")
    assert message.startswith(f"config: {path} is not valid TOML: ")


# --------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("bogus = 1\n", "bogus: unknown setting"),
        ("[bogus]\nx = 1\n", "bogus: unknown table"),
        ("[server]\nworker = 2\n", "server.worker: unknown setting; did you mean server.workers?"),
        ("[request]\ndeadline = 2\n", "request.deadline: unknown setting; did you mean request.deadline_s?"),
        ("[engine]\nfirst_token_timeout = 5\n",
         "engine.first_token_timeout: unknown setting; did you mean engine.first_token_timeout_s?"),
        ("[handoff]\nmax_age = 50\n", "handoff.max_age: unknown setting; did you mean handoff.max_age_s?"),
        ("[placement]\nqueue_timeout = 1\n",
         "placement.queue_timeout: unknown setting; did you mean placement.queue_timeout_s?"),
        ("[preflight]\nonstart = false\n", "preflight.onstart: unknown setting; did you mean preflight.on_start?"),
        ("[log]\nlevels = \"info\"\n", "log.levels: unknown setting; did you mean log.level?"),
        ("[recovery]\neject = 3\n", "recovery.eject: unknown setting; did you mean recovery.eject_after?"),
        ("[engine_contract]\nconnector = \"NixlConnector\"\n",
         "engine_contract.connector: unknown setting; did you mean engine_contract.kv_connector?"),
        (
            '[[engines]]\nname = "p0"\nurl = "http://h:1"\nrole = "producer"\npeers = []\n',
            "engines.0.peers: unknown setting; did you mean engines.0.kv_peers?",
        ),
    ],
)
def test_unknown_toml_key_in_every_section(tmp_path: Path, toml: str, message: str) -> None:
    assert error_of(tmp_path, toml) == message


ENGINE = 'name = "p0"\nurl = "http://h:1"\nrole = "producer"\n'


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        # Pydantic said "Input should be a valid list" and "...instance of EngineSettings".
        ("[engines]\n" + ENGINE, "engines: write [[engines]] (an array of tables, one per entry), not the single "
                                 "table [engines]"),
        ("[[engine]]\n" + ENGINE, "engine: [engine] is one table, not the array of tables [[engine]]; "
                                  "did you mean [[engines]]?"),
        ("[[server]]\nbind = \"0.0.0.0:1\"\n", "server: [server] is one table, not the array of tables [[server]]"),
        ("[servr]\nbind = \"0.0.0.0:1\"\n", "servr: unknown table; did you mean [server]?"),
        ("[engine_contracts]\nmodel = \"m\"\n", "engine_contracts: unknown table; did you mean [engine_contract]?"),
        ("workers = 4\n", "workers: unknown setting; did you mean server.workers (under [server])?"),
        # A misspelt required key is also a missing one: the typo is what to report.
        ('[[engines]]\nname = "p0"\nurl = "http://h:1"\nrol = "producer"\n',
         "engines.0.rol: unknown setting; did you mean engines.0.role?"),
        ('[[engines]]\nname = "p0"\nrole = "producer"\n', "engines.0.url: Field required"),
        ("[server]\nzzz = 1\n", "server.zzz: unknown setting"),
    ],
)
def test_a_misshapen_or_misspelt_setting_says_what_was_meant(tmp_path: Path, toml: str, message: str) -> None:
    assert error_of(tmp_path, toml) == message


def test_the_start_refuses_a_handoff_age_at_the_lease_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "narwhal.toml"
    path.write_text("[handoff]\nmax_age_s = 30\nlease_s = 30\n")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("NARWHAL_")}
    proc = subprocess.run([sys.executable, "-m", "narwhal", "serve", "--config", str(path)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("narwhal: invalid settings: handoff: handoff.max_age_s (30) must be below "
                                  "handoff.lease_s (30)"), proc.stderr


def test_an_entry_beyond_the_bounds_that_fit_the_shared_tables_is_one_line(tmp_path: Path) -> None:
    # docs/behaviour.md: every entry the settings accept fits the descriptors; one beyond their bounds is
    # refused by the settings, naming the key (before: a dozen long names stopped on_starting).
    models = ", ".join(f'"org/m{i}"' for i in range(33))
    path = tmp_path / "narwhal.toml"
    path.write_text('[preflight]\non_start = false\n[[engines]]\nname = "p0"\nurl = "http://127.0.0.1:9"\n'
                    f'role = "producer"\nmodels = [{models}]\n'
                    '[[engines]]\nname = "d0"\nurl = "http://127.0.0.1:10"\nrole = "consumer"\n')
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("NARWHAL_")}
    proc = subprocess.run([sys.executable, "-m", "narwhal", "serve", "--config", str(path)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("narwhal: invalid settings: engines.0.models:") and "at most 32" in last, last


def test_the_start_refuses_a_misshapen_table_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "narwhal.toml"
    path.write_text("[engines]\n" + ENGINE)
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("NARWHAL_")}
    proc = subprocess.run([sys.executable, "-m", "narwhal", "serve", "--config", str(path)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == ("narwhal: invalid settings: engines: write [[engines]] (an array of tables, one per "
                           "entry), not the single table [engines]\n")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("NARWHAL_BOGUS", "NARWHAL_BOGUS: unknown setting"),
        ("NARWHAL_SERVER__WORKER", "NARWHAL_SERVER__WORKER: unknown setting server.worker"),
        (
            "NARWHAL_ENGINE__FIRST_TOKEN_TIMEOUT",
            "NARWHAL_ENGINE__FIRST_TOKEN_TIMEOUT: unknown setting engine.first_token_timeout",
        ),
    ],
)
def test_unknown_env_var(name: str, message: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(None, environ={name: "1"})
    assert str(info.value) == message


def test_unknown_env_var_in_optional_section() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(None, environ={"NARWHAL_ENGINE_CONTRACT__CONNECTOR": "x"})
    # Refused by name like a typo in any section (the optional section is resolved too).
    assert str(info.value) == "NARWHAL_ENGINE_CONTRACT__CONNECTOR: unknown setting engine_contract.connector"


def test_router_own_environment_variable_is_not_an_unknown_setting() -> None:
    # The gunicorn master marks the metrics directory it owns in its own environment; that
    # marker must never be mistaken for a (mistyped) NARWHAL_ setting.
    s = load_settings(None, environ={"_NARWHAL_METRICS_DIR_OWNER": "owned"})
    assert isinstance(s, Settings)


def test_unknown_env_var_is_rejected_whatever_its_case() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(None, environ={"narwhal_bogus": "1"})
    assert str(info.value) == "narwhal_bogus: unknown setting"


# --------------------------------------------------------------------------- invalid values


@pytest.mark.parametrize(
    ("toml", "environ", "message"),
    [
        (
            BAD_TIMEOUT_TOML,
            {},
            NOT_A_NUMBER,
        ),
        ("[engine]\nprefill_timeout_s = 0\n", {}, "engine.prefill_timeout_s: Input should be greater than 0"),
        ("[server]\nworkers = 0\n", {}, "server.workers: Input should be greater than or equal to 1"),
        ("[server]\nbind = \"localhost\"\n", {}, "server.bind: expected HOST:PORT (or unix:PATH, fd://N)"),
        (
            "[log]\nformat = \"xml\"\n",
            {},
            "log.format: Input should be 'json' or 'text'",
        ),
        (
            "",
            {"NARWHAL_SERVER__WORKERS": "0"},
            "server.workers: Input should be greater than or equal to 1 (from NARWHAL_SERVER__WORKERS)",
        ),
        (
            "[engine]\nfirst_token_timeout_s = 3\n",
            {"NARWHAL_ENGINE__FIRST_TOKEN_TIMEOUT_S": "soon"},
            NOT_A_NUMBER + " (from NARWHAL_ENGINE__FIRST_TOKEN_TIMEOUT_S)",
        ),
    ],
)
def test_invalid_value_names_the_key(
    tmp_path: Path, toml: str, environ: dict[str, str], message: str
) -> None:
    assert error_of(tmp_path, toml, environ) == message


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (
            TWO_ENGINES.replace('name = "d0"', 'name = "p0"'),
            "engines: duplicate engine name 'p0'",
        ),
        (
            TWO_ENGINES.replace('role = "producer"', 'role = "producer"\nkv_peers = ["d0", "d9"]'),
            "engines.0.kv_peers: unknown engine 'd9'",
        ),
        (
            TWO_ENGINES.replace('role = "consumer"', 'role = "leader"'),
            "engines.1.role: Input should be 'producer', 'consumer' or 'both'",
        ),
        (
            TWO_ENGINES.replace("http://10.0.0.6:8200", "10.0.0.6:8200"),
            "engines.1.url: expected an http:// or https:// URL",
        ),
        (
            TWO_ENGINES.replace("http://10.0.0.6:8200", "ftp://10.0.0.6"),
            "engines.1.url: expected an http:// or https:// URL",
        ),
        (
            TWO_ENGINES.replace("http://10.0.0.6:8200", "http://"),
            "engines.1.url: expected an http:// or https:// URL",
        ),
        (
            '[[engines]]\nname = "p0"\nrole = "producer"\n',
            "engines.0.url: Field required",
        ),
        (
            TWO_ENGINES.replace("http://10.0.0.6:8200", "http://10.0.0.6:99999"),
            "engines.1.url: expected an http:// or https:// URL with a host and a port 1-65535 (Port out of range "
            "0-65535)",
        ),
        (
            TWO_ENGINES.replace("http://10.0.0.6:8200", "http://10.0.0.6:0"),
            "engines.1.url: expected an http:// or https:// URL with a host and a port 1-65535",
        ),
        (
            TWO_ENGINES.replace("http://10.0.0.6:8200", "http://10.0.0.6:http"),
            "engines.1.url: expected an http:// or https:// URL with a host and a port 1-65535 (Invalid URL: port "
            "can't be converted to integer)",
        ),
        (
            TWO_ENGINES.replace("http://10.0.0.6:8200", "http://:8200"),
            "engines.1.url: expected an http:// or https:// URL with a host and a port 1-65535 (Invalid URL: host "
            "is required for absolute urls with the http scheme)",
        ),
        (
            TWO_ENGINES.replace("http://10.0.0.6:8200", "http://user:pw@10.0.0.6:8200"),
            "engines.1.url: expected an http:// or https:// URL without credentials, query or fragment",
        ),
    ],
)
def test_engines_validation(tmp_path: Path, toml: str, message: str) -> None:
    assert error_of(tmp_path, toml) == message


def test_engine_url_trailing_slash_is_stripped(tmp_path: Path) -> None:
    toml = TWO_ENGINES.replace("http://10.0.0.5:8100", "https://p0.example/")
    s = load_settings(write(tmp_path, toml), environ={})
    assert s.engines[0].url == "https://p0.example"


@pytest.mark.parametrize(
    ("toml", "environ"),
    [
        ("[handoff]\nmax_age_s = 30\nlease_s = 60\n", {}),  # equal to the default prefill_timeout_s
        ("[engine]\nprefill_timeout_s = 50\n", {}),  # above the default max_age_s (20)
        ("", {"NARWHAL_ENGINE__PREFILL_TIMEOUT_S": "45"}),
    ],
)
def test_handoff_max_age_at_or_below_prefill_timeout_is_allowed(
    tmp_path: Path, toml: str, environ: dict[str, str]
) -> None:
    # Advice, not a rule (docs/settings.md writes it as a comment): the router warns at start-up and
    # expires slow handoffs with 504 handoff_expired, which is what such a setting asks for.
    s = load_settings(write(tmp_path, toml), environ=environ)
    assert s.handoff.max_age_s <= s.engine.prefill_timeout_s


def test_handoff_max_age_above_prefill_timeout_is_accepted(tmp_path: Path) -> None:
    toml = "[engine]\nprefill_timeout_s = 10\n[handoff]\nmax_age_s = 10.5\n"
    s = load_settings(write(tmp_path, toml), environ={})
    assert (s.engine.prefill_timeout_s, s.handoff.max_age_s) == (10, 10.5)
