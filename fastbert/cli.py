"""The `fastbert` command. Each subcommand lives in its own module with a `main(argv) -> int`;
this file only routes to it, importing nothing heavy until a subcommand is chosen. It also owns how
the commands talk: one handler on the `fastbert` logger (library code only calls
`logging.getLogger("fastbert.<part>")`) and one way to turn a user's mistake into a message and exit code 2."""
from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable

# subcommand -> (module with main(argv), one-line help)
COMMANDS = {
    "bench": ("fastbert.bench.cli", "benchmark kernels and models against PyTorch, torch.compile and transformers"),
    "prepare-data": ("fastbert.data.prepare", "corpus -> WordPiece tokenizer -> MLM + NSP example shards"),
    "pretrain": ("fastbert.train.pretrain", "pretrain BERT (MLM + NSP), one process or under torchrun"),
    "convert": ("fastbert.convert", "re-save an HF BERT directory cleanly; --check compares it with transformers"),
    "finetune": ("fastbert.finetune.cli", "fine-tune on classification, regression, tagging, SQuAD or SWAG"),
    "embed": ("fastbert.finetune.embed", "contextual embeddings of chosen layers (feature-based BERT) -> .npy"),
}
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
    """Run a subcommand's body with logging configured; a user error becomes one message and exit code 2."""
    configure_logging(command)
    try:
        return body() or 0
    except USER_ERRORS as exc:
        LOG.error("%s", exc)
        return 2


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: fastbert <command> [options]", "       fastbert --version", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "`fastbert <command> --help` describes a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        from fastbert import __version__
        print(f"fastbert {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"fastbert: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    configure_logging(argv[0])
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
