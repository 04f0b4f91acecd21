"""``narwhal`` command line: ``serve``, ``preflight``, ``demo`` and ``fake-engine``."""

from __future__ import annotations

import argparse
import os
import sys

from narwhal.settings import CONFIG_ENV, load_settings_or_exit


def _serve(args: argparse.Namespace, extra: list[str]) -> int:
    if args.config:
        os.environ[CONFIG_ENV] = os.path.abspath(args.config)
    load_settings_or_exit()  # fail here, with one line, before gunicorn starts
    from narwhal.gunicorn_hooks import CONFIG_FILE

    argv = [sys.executable, "-m", "gunicorn", "-c", CONFIG_FILE, *extra]
    os.execv(sys.executable, argv)
    return 0  # pragma: no cover - execv does not return


def _preflight_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help=f"TOML settings file (default: ${CONFIG_ENV})")
    parser.add_argument("--json", action="store_true", help="print a JSON document instead of the table")
    parser.add_argument(
        "--timeout", type=float, default=None, metavar="S",
        help="bound on every request in seconds (default: engine.first_token_timeout_s)",
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="narwhal", description="Router for disaggregated vLLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the router under gunicorn (extra gunicorn flags after --)")
    serve.add_argument("--config", help=f"TOML settings file (default: ${CONFIG_ENV})")
    demo = sub.add_parser("demo", help="a fake fleet (2 producers, 2 consumers) and the router on 127.0.0.1")
    demo.add_argument("--port", type=int, default=8000, help="router port (default 8000; 0 picks one)")
    demo.add_argument("--workers", type=int, default=2)
    sub.add_parser("fake-engine", help="run fake vLLM engines (see narwhal fake-engine --help)", add_help=False)
    preflight = sub.add_parser(
        "preflight", help="check every engine against the contract and probe every permitted KV transfer"
    )
    _preflight_arguments(preflight)

    if argv[:1] == ["fake-engine"]:
        from narwhal.fake_engine import main as fake_main

        return fake_main(argv[1:])
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args, extra)
    if args.command == "preflight":
        from narwhal.preflight import main as preflight_main

        return preflight_main(args)
    from narwhal.demo import run_demo

    return run_demo(port=args.port, workers=args.workers)


if __name__ == "__main__":
    raise SystemExit(main())
