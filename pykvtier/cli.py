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
    """Entry point of the ``pykvtier`` console script (``argv`` None: ``sys.argv[1:]``).

    SIGINT (Ctrl-C) and SIGTERM (kill, timeout, a CI runner's cancel) stop a command the same
    way: it unwinds (in-flight I/O drained, temporaries such as replay's temporary root
    removed), then one line on stderr and exit 128 + the signal (130, 143). Once that line is
    being written, further signals are dropped: until main() returns, or, as the console
    script (``argv`` None), until the process exits.
    """
    stop = _Stop()
    try:
        stop.install()
        parser = build_parser()
        args = parser.parse_args(argv)
        run = getattr(args, "_run", None)
        if run is None:
            parser.print_help(sys.stderr)
            return 2
        return int(run(args) or 0)
    except (KeyboardInterrupt, _Terminated) as exc:
        stop.reporting = True  # first (a plain store: no signal handler runs before it)
        signum = stop.first or (signal.SIGINT if isinstance(exc, KeyboardInterrupt)
                                else signal.SIGTERM)
        print(_NOTICES[signum], file=sys.stderr)
        return 128 + signum
    finally:
        if argv is not None or not stop.reporting:
            stop.uninstall()


_NOTICES = {signal.SIGINT: "pykvtier: interrupted", signal.SIGTERM: "pykvtier: terminated (SIGTERM)"}


class _Terminated(BaseException):
    """SIGTERM arrived (a BaseException, as KeyboardInterrupt: cleanup runs, handlers of
    Exception do not swallow it)."""


class _Stop:
    """main()'s SIGINT/SIGTERM handler (main thread only; a signal ignored when main() starts,
    e.g. SIGINT of a background job, stays ignored): raises KeyboardInterrupt / _Terminated
    for each signal until main() reports the stop, then drops them. ``first``: the signal
    reported (the first one, whatever a later one raised while the command unwound)."""

    def __init__(self) -> None:
        self.first: int | None = None
        self.reporting = False
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in _NOTICES:
            previous = signal.getsignal(signum)
            if previous is None or previous == signal.SIG_IGN:
                continue  # installed outside Python, or ignored: left as it is
            self._previous[signum] = previous
            signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.reporting:
            return
        if self.first is None:
            self.first = signum
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise _Terminated()


if __name__ == "__main__":
    sys.exit(main())
