"""``narwhal`` command line: ``serve``, ``preflight``, ``status``, ``demo``, ``fake-engine`` and ``--version``.

Every command's output goes through ``main``, which is the one place a closed pipe is handled:
``narwhal preflight --json | head`` ends with one line on stderr and exit status 141 (128 +
SIGPIPE, what a program killed by SIGPIPE reports), not a traceback, and not a second one from
the interpreter's last flush of what is still buffered for the closed pipe.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from narwhal import DISTRIBUTION, __version__
from narwhal.settings import load_settings_or_exit
from narwhal.settings.env import CONFIG_ENV

# 128 + SIGPIPE: the status a shell reports for a writer its reader left (`set -o pipefail`).
CLOSED_PIPE_STATUS = 141


def _serve(args: argparse.Namespace, extra: list[str]) -> int:
    if args.config:
        os.environ[CONFIG_ENV] = os.path.abspath(args.config)
    settings = load_settings_or_exit()  # fail here, with one line, before gunicorn starts
    refusal = settings.discovery.refusal(len(settings.engines))
    if refusal is not None:
        print(f"narwhal: invalid settings: {refusal}", file=sys.stderr, flush=True)
        return 2
    from narwhal.master.gunicorn_hooks import CONFIG_FILE

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
    """``narwhal``'s entry point: the command's exit status; a reader that closed stdout is said once, no traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _run(argv)
    except BrokenPipeError:
        return _closed_pipe(argv)


def _closed_pipe(argv: list[str]) -> int:
    """The reader of stdout went away (``| head``): say so once, exit like a SIGPIPE'd writer."""
    # What is still buffered for the closed pipe would raise again when the interpreter
    # flushes stdout at exit: point the descriptor at /dev/null so that flush succeeds.
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    command = next((a for a in argv if not a.startswith("-")), "")
    with contextlib.suppress(OSError):
        print(f"narwhal{' ' + command if command else ''}: output not fully written: "
              "the reader closed the pipe", file=sys.stderr, flush=True)
    return CLOSED_PIPE_STATUS


def _run(argv: list[str]) -> int:
    from narwhal.demo import DEFAULT_PORT

    parser = argparse.ArgumentParser(prog="narwhal", description="Router for disaggregated vLLM serving")
    parser.add_argument("--version", action="version", version=f"{DISTRIBUTION} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the router under gunicorn (extra gunicorn flags after --)")
    serve.add_argument("--config", help=f"TOML settings file (default: ${CONFIG_ENV})")
    demo = sub.add_parser("demo", help="a fake fleet (2 producers, 2 consumers) and the router on 127.0.0.1")
    demo.add_argument(
        "--port", type=int, default=DEFAULT_PORT,
        help=f"router port (default {DEFAULT_PORT}, off vLLM's own 8000; 0 picks a free one)",
    )
    demo.add_argument("--workers", type=int, default=2)
    sub.add_parser("fake-engine", help="run fake vLLM engines (see narwhal fake-engine --help)", add_help=False)
    preflight = sub.add_parser(
        "preflight", help="check every engine against the contract and probe every permitted KV transfer"
    )
    _preflight_arguments(preflight)
    from narwhal import status as status_command

    status = sub.add_parser("status", help="the engines as a running router sees them (and --settings)")
    status_command.add_arguments(status)
    from narwhal import sizing

    workers = sub.add_parser("workers", help="measure the server.workers this host needs (fake engines, 127.0.0.1)")
    sizing.add_arguments(workers)

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
        from narwhal.preflight.check import main as preflight_main

        return preflight_main(args)
    if args.command == "status":
        return status_command.main(args)
    if args.command == "workers":
        return sizing.main(args)
    from narwhal.demo import run_demo

    return run_demo(port=args.port, workers=args.workers)


if __name__ == "__main__":
    raise SystemExit(main())
