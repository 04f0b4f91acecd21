"""``[discovery]`` wired into the settings: the layout's engine slots, and the start refused
with one line when there is nothing to route to (docs/behaviour.md "Engines that come and go")."""

from __future__ import annotations

import subprocess
from pathlib import Path

from narwhal.settings import load_settings
from tests.unit.settings_support import VENV_PYTHON, clean_env, error_of, write

NO_ENGINE = ("narwhal: invalid settings: engines: no engine to route to: add [[engines]] entries "
             "or a [discovery] source (file or dns)")


def test_discovery_is_a_section_of_the_settings(tmp_path: Path) -> None:
    toml = ('[discovery]\ninterval_s = 1\nfile = "/etc/narwhal/engines.toml"\nresolver = "127.0.0.1:5353"\n'
            '[[discovery.dns]]\nname = "vllm-prefill.ai.svc.cluster.local"\nport = 8000\nrole = "producer"\n')
    s = load_settings(write(tmp_path, toml), environ={})
    assert s.discovery.enabled and s.discovery.interval_s == 1
    assert [d.name for d in s.discovery.dns] == ["vllm-prefill.ai.svc.cluster.local"]
    assert s.engine_slots == 256  # discovery.max_engines' default once a source is set


def test_without_a_source_the_slots_are_server_max_engines(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, '[server]\nmax_engines = 7\n[discovery]\nmax_engines = 9\n'), environ={})
    assert not s.discovery.enabled and s.engine_slots == 7
    s = load_settings(write(tmp_path, '[server]\nmax_engines = 7\n[discovery]\nfile = "x.toml"\nmax_engines = 9\n'),
                      environ={})
    assert s.engine_slots == 9


def test_static_engines_beyond_discovery_max_engines_name_that_key(tmp_path: Path) -> None:
    toml = ('[discovery]\nfile = "x.toml"\nmax_engines = 1\n'
            '[[engines]]\nname = "a"\nurl = "http://10.0.0.1:1"\nrole = "both"\n'
            '[[engines]]\nname = "b"\nurl = "http://10.0.0.2:1"\nrole = "both"\n')
    assert error_of(tmp_path, toml) == "engines: 2 engines exceed discovery.max_engines"


def test_a_dns_source_without_port_or_srv_names_the_key(tmp_path: Path) -> None:
    toml = '[[discovery.dns]]\nname = "x.local"\nrole = "producer"\n'
    assert error_of(tmp_path, toml).startswith("discovery.dns.0: ")


def test_serve_with_no_engine_and_no_source_refuses_with_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nworkers = 1\n")
    proc = subprocess.run([VENV_PYTHON, "-m", "narwhal", "serve", "--config", path], env=clean_env(),
                          cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip() == NO_ENGINE


def test_gunicorn_with_no_engine_and_no_source_refuses_with_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nworkers = 1\nbind = "127.0.0.1:0"\n')
    proc = subprocess.run([VENV_PYTHON, "-m", "gunicorn", "-c", "python:narwhal.master.gunicorn_conf"],
                          env=clean_env(NARWHAL_CONFIG=path), cwd=tmp_path, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode != 0
    assert NO_ENGINE in proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr
