"""``narwhal status``: the fleet as a running router sees it, without curl and JSON.

One row per engine from ``GET /admin/engines`` — role, state, failure streak, unreachable,
vLLM version, load and holdings — and, with ``--settings``, the running settings from
``GET /admin/settings`` (secrets redacted). The router's address and admin token come from
the flags, else from the settings file (``server.bind``, ``server.admin_token``), so on the
router's own host ``narwhal status --config narwhal.toml`` is enough.

Invariant: read-only (two GETs); a router that cannot be reached or refuses the token is one
line on stderr and exit status 1, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any

from narwhal.settings import load_settings_or_exit
from narwhal.settings.env import CONFIG_ENV

COLUMNS = ("NAME", "ROLE", "STATE", "STREAK", "UNREACHABLE", "VERSION", "LOAD", "HOLDINGS")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``narwhal status``'s flags."""
    parser.add_argument("--config", help=f"TOML settings file, for the address and token (default: ${CONFIG_ENV})")
    parser.add_argument("--url", help="the router's base URL (default: from server.bind)")
    parser.add_argument("--token", help="the admin token (default: server.admin_token)")
    parser.add_argument("--settings", action="store_true", help="also print the running settings, secrets redacted")
    parser.add_argument("--json", action="store_true", help="print the admin API's JSON instead of the table")


def main(args: argparse.Namespace) -> int:
    """Print the table (and the settings); 0, or 1 when the router could not be asked."""
    url, token = args.url, args.token
    if url is None or token is None:
        settings = load_settings_or_exit(args.config)
        url = url or _url_of(settings.server.bind)
        token = token if token is not None else settings.server.admin_token
    try:
        engines = _get(url, "/admin/engines", token)
        effective = _get(url, "/admin/settings", token) if args.settings else None
    except StatusError as exc:
        print(f"narwhal status: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"engines": engines["engines"], **({"settings": effective} if effective else {})}, indent=2))
        return 0
    print(table(engines["engines"]))
    if effective is not None:
        print()
        print(json.dumps(effective, indent=2, sort_keys=True))
    return 0


class StatusError(Exception):
    """The router could not be asked (unreachable, the token refused, an answer not JSON)."""


def _url_of(bind: str) -> str:
    """``server.bind`` as a URL to reach it from the same host (``0.0.0.0``/``[::]``: loopback)."""
    host, _, port = bind.rpartition(":")
    host = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]", "": "127.0.0.1"}.get(host, host)
    return f"http://{host}:{port}"


def _get(url: str, path: str, token: str) -> Any:
    request = urllib.request.Request(url.rstrip("/") + path, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        hint = " (check --token or server.admin_token)" if exc.code == 401 else ""
        raise StatusError(f"{path} answered {exc.code}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise StatusError(f"cannot reach the router at {url}: {getattr(exc, 'reason', exc)}") from None
    except ValueError:
        raise StatusError(f"{path} did not answer JSON") from None


def table(engines: list[dict[str, Any]]) -> str:
    """The engines as aligned columns (:data:`COLUMNS`)."""
    rows = [COLUMNS] + [_row(e) for e in engines]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def _row(engine: dict[str, Any]) -> tuple[str, ...]:
    load = engine.get("load") or {}
    shown_load = "-" if not load else " ".join(
        f"{k}={load[k]}" for k in ("running", "waiting", "kv_usage") if load.get(k) is not None) or "-"
    holdings = engine.get("holdings") or {}
    shown_holdings = "-" if not holdings else " ".join(
        f"{k}={v}" for k, v in holdings.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)) or "-"
    return (str(engine.get("name")), str(engine.get("role")), str(engine.get("state")),
            str(engine.get("failure_streak", 0)), "yes" if engine.get("unreachable") else "no",
            str(engine.get("version") or "-"), shown_load, shown_holdings)
