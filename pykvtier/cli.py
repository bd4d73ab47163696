"""The ``pykvtier`` command: a thin dispatcher over subcommands.

Each subcommand lives in its own module, which provides::

    HELP: str                                            # one line for `pykvtier --help`
    def add_arguments(parser: argparse.ArgumentParser) -> None
    def run(args: argparse.Namespace) -> int             # the exit status

and is listed in :data:`SUBCOMMANDS` (name -> module). To add one (``bench``, ``doctor``,
...), write the module and add a line to :data:`SUBCOMMANDS`, or call
:func:`register_subcommand` before :func:`main`. Modules are imported when the parser is
built, so keep their heavy imports (the native engine, numpy-heavy set-up) inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from typing import Any, Sequence

__all__ = ["SUBCOMMANDS", "register_subcommand", "build_parser", "main"]

#: Subcommand name -> module implementing it (``HELP``, ``add_arguments``, ``run``), or
#: ``"module:attribute"`` naming an object of that module with those three attributes.
SUBCOMMANDS: dict[str, str] = {
    "replay": "pykvtier.replay",
    "doctor": "pykvtier.doctor",
    "bench": "pykvtier.bench",
    "du": "pykvtier.admin:du_command",
    "fsck": "pykvtier.admin:fsck_command",
    "gc": "pykvtier.admin:gc_command",
    "quarantine": "pykvtier.admin:quarantine_command",
}


def register_subcommand(name: str, module: str) -> None:
    """Add (or replace) subcommand ``name``, implemented by ``module``."""
    SUBCOMMANDS[name] = module


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("pykvtier")
    except Exception:  # not installed (a source checkout): no version to report
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pykvtier",
        description="pykvtier: a disk (NVMe / POSIX file system) tier for LLM KV-cache blocks.",
    )
    parser.add_argument("--version", action="version", version=f"pykvtier {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module_name, _, attribute = module_name.partition(":")
        module = importlib.import_module(module_name)
        if attribute:
            module = getattr(module, attribute)
        help_text = getattr(module, "HELP", None) or (module.__doc__ or "").strip().splitlines()[0]
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pykvtier`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help(sys.stderr)
        return 2
    # SIGTERM (kill, timeout, a CI runner's cancel) unwinds as Ctrl-C does: in-flight I/O is
    # drained and temporaries (e.g. replay's temporary root) are removed on the way out.
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return int(run(args) or 0)
    except KeyboardInterrupt:
        print("pykvtier: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print("pykvtier: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class _Terminated(BaseException):
    """SIGTERM arrived (a BaseException, as KeyboardInterrupt: cleanup runs, handlers of
    Exception do not swallow it)."""


def _terminated(signum: int, frame: Any) -> None:
    raise _Terminated()


if __name__ == "__main__":
    sys.exit(main())
