"""The `fastbert` command. Each subcommand lives in its own module with a `main(argv) -> int`;
this file only routes to it, importing nothing heavy until a subcommand is chosen (how the commands log
and report a user's mistake is fastbert.command's)."""
from __future__ import annotations

import importlib
import sys

from fastbert.command import run_command

# subcommand -> (module with main(argv), one-line help)
COMMANDS = {
    "bench": ("fastbert.bench.cli", "benchmark kernels and models against PyTorch, torch.compile and transformers"),
    "prepare-data": ("fastbert.data.prepare", "corpus -> WordPiece tokenizer -> MLM + NSP example shards"),
    "pretrain": ("fastbert.train.pretrain", "pretrain BERT (MLM + NSP), one process or under torchrun"),
    "convert": ("fastbert.convert", "re-save an HF BERT directory cleanly; --check compares it with transformers"),
    "finetune": ("fastbert.finetune.cli", "fine-tune on classification, regression, tagging, SQuAD or SWAG"),
    "embed": ("fastbert.finetune.embed", "contextual embeddings of chosen layers (feature-based BERT) -> .npy"),
}
def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: fastbert <command> [options]", "       fastbert --version", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "`fastbert <command> --help` describes a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv:  # a usage error, as argparse treats a missing required argument: usage on stderr, exit 2
        print(f"fastbert: no command given\n\n{usage()}", file=sys.stderr)
        return 2
    if argv[0] == "--version":
        from fastbert import __version__
        print(f"fastbert {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"fastbert: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    # the import under run_command too: a Ctrl-C while the command's modules load (seconds: torch,
    # transformers) is its message and 130, a missing dependency its message and 2
    return run_command(argv[0], lambda: importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
