"""How the `fastbert` commands talk: one handler on the `fastbert` logger (library code only calls
`logging.getLogger("fastbert.<part>")`) and one way to turn a user's mistake into a message and exit code 2.
Below the subcommands (they import it) and fastbert.cli, which routes to them."""
from __future__ import annotations

import logging
import sys
from collections.abc import Callable

# what a user's input or environment can cause (bad files and options, a full disk, a held lock): a
# message and exit code 2, never a traceback. Programming errors keep their traceback.
USER_ERRORS = (ValueError, OSError, ImportError)
LOG = logging.getLogger("fastbert")


class _CommandFormatter(logging.Formatter):
    """Progress lines as they are; warnings and errors prefixed like argparse's: "fastbert CMD: error: ..."."""

    def __init__(self, command: str):
        super().__init__("%(message)s")
        self.prefix = f"fastbert {command}: " if command else "fastbert: "

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        if record.levelno >= logging.WARNING:
            return f"{self.prefix}{record.levelname.lower()}: {message}"
        return message


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is at each message (a test framework swaps it), not as it was at set-up."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_logging(command: str = "") -> None:
    """Send the `fastbert` logger's INFO and above to stderr through one handler (a second call replaces
    it, with the new command's name in warnings and errors)."""
    for handler in [h for h in LOG.handlers if isinstance(h, _StderrHandler)]:
        LOG.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(_CommandFormatter(command))
    LOG.addHandler(handler)
    LOG.setLevel(logging.INFO)


def run_command(command: str, body: Callable[[], int | None]) -> int:
    """Run a subcommand's body with logging configured; a user error becomes one message and exit code 2, a
    Ctrl-C one message and the shell's 130 (what each command leaves then is docs/reliability.md's)."""
    configure_logging(command)
    try:
        return body() or 0
    except USER_ERRORS as exc:
        LOG.error("%s", exc)
        return 2
    except KeyboardInterrupt:
        LOG.error("interrupted by Ctrl-C: stopped before the end")
        return 130
