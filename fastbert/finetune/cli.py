"""`fastbert finetune`: fine-tune a checkpoint of BERT or its family on one of the paper's task families.

The family: RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, DistilBERT and MPNet, each with the tokenizer it ships.

    fastbert finetune --task classification --model DIR --train train.tsv --eval dev.tsv \\
        --text-column sentence1 --text-pair-column sentence2 --label-column label --out mrpc/

docs/finetuning.md gives the command for each task family.
"""
from __future__ import annotations

import argparse
import logging
import sys

from fastbert.command import run_command
from fastbert.finetune.readers import TABLE_FORMATS
from fastbert.finetune.train import PAPER_LEARNING_RATES, PRECISIONS, TASKS, FinetuneConfig, finetune
from fastbert.train.pretrain import TrainingError


class _DefaultsFormatter(argparse.HelpFormatter):
    """argparse's help with "(default: X)" after an option that has a default of its own, unless its help
    already says what the default is; switches (--no-progress) get none: a default of True there reads as
    the switch being on."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, argparse.SUPPRESS) or action.nargs == 0 or "default" in text:
            return text
        return f"{text} (default: %(default)s)".lstrip()


def parser() -> argparse.ArgumentParser:
    defaults = FinetuneConfig("classification", "", "")
    p = argparse.ArgumentParser(prog="fastbert finetune", description=__doc__.split("\n")[0].split(": ", 1)[1],
                                formatter_class=_DefaultsFormatter)
    p.add_argument("--task", required=True, choices=TASKS, help="the task family (docs/finetuning.md: one section each)")
    p.add_argument("--model", required=True, help="HF directory of BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, "
                                                 "DistilBERT or MPNet (transformers' or a fastbert pretraining run's) "
                                                 "or a hub id (read from the HF cache)")
    p.add_argument("--train", required=True, help="training file (CSV/TSV/JSONL, CoNLL, or SQuAD JSON by task)")
    p.add_argument("--eval", help="evaluation file in the same format; the best epoch on it is saved")
    p.add_argument("--out", default=defaults.out, help="output directory (HF format)")
    p.add_argument("--tokenizer", help="tokenizer.json, vocab.txt (BERT) or a tokenizer directory "
                                       "(default: the model directory's)")
    p.add_argument("--cased", dest="lowercase", action="store_const", const=False, default=None,
                   help="keep case when reading a vocab.txt (default: tokenizer_config.json's do_lower_case)")

    tables = p.add_argument_group("table columns (classification, regression, multiple-choice)")
    tables.add_argument("--format", choices=TABLE_FORMATS, help="default: from the file's extension")
    tables.add_argument("--text-column", help="first segment (default: sentence; sent1 for multiple-choice)")
    tables.add_argument("--text-pair-column",
                        help="second segment (default: none; sent2 for multiple-choice, where it starts every "
                             "ending); an empty string means none")
    tables.add_argument("--label-column", default=defaults.label_column,
                        help="the label: a class name (classification), a number (regression), the right ending's "
                             "index (multiple-choice)")
    tables.add_argument("--choice-columns", default=",".join(defaults.choice_columns),
                        help="comma-separated ending columns (multiple-choice)")

    qa = p.add_argument_group("question answering (SQuAD v1.1 / v2.0)")
    qa.add_argument("--doc-stride", type=int, default=defaults.doc_stride,
                    help="tokens between the starts of consecutive windows over a long context")
    qa.add_argument("--max-query-length", type=int, default=defaults.max_query_length,
                    help="questions are cut to this many tokens")
    qa.add_argument("--max-answer-length", type=int, default=defaults.max_answer_length,
                    help="longest predicted answer, in tokens")
    qa.add_argument("--n-best", type=int, default=defaults.n_best, help="start and end candidates per window")
    qa.add_argument("--null-score-diff-threshold", type=float, default=defaults.null_score_diff_threshold,
                    help="v2.0: answer nothing when the null score exceeds the best span's by more than this")
    qa.add_argument("--version-2-with-negative", dest="version_2", action="store_const", const=True, default=None,
                    help="allow the null answer (default: iff the training file has unanswerable questions)")

    recipe = p.add_argument_group("the recipe (the paper's defaults)")
    recipe.add_argument("--max-seq-length", type=int, help="default 128; 384 for question-answering")
    recipe.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per optimizer step")
    recipe.add_argument("--epochs", type=int, default=defaults.epochs, help="passes over the training file")
    recipe.add_argument("--learning-rate", type=float, default=defaults.learning_rate,
                        help="peak learning rate, any positive number; the paper searches "
                             + ", ".join(f"{lr:g}" for lr in PAPER_LEARNING_RATES))
    recipe.add_argument("--warmup-proportion", type=float, default=defaults.warmup_proportion,
                        help="share of the steps over which the learning rate rises linearly; it then falls "
                             "linearly to 0")
    recipe.add_argument("--weight-decay", type=float, default=defaults.weight_decay, help="AdamW's weight decay, on weight matrices (not biases, LayerNorm)")
    recipe.add_argument("--dropout", type=float, default=defaults.dropout,
                        help="hidden and attention dropout (the classifier's follows the hidden one)")
    recipe.add_argument("--seed", type=int, default=defaults.seed,
                        help="seeds the new head's initialisation, the shuffling and dropout")
    recipe.add_argument("--max-steps", type=int, help="stop after this many steps (smoke runs)")
    recipe.add_argument("--eval-batch-size", type=int, default=defaults.eval_batch_size,
                        help="sequences per evaluation batch")
    recipe.add_argument("--metric", help="metric that picks the best epoch (default: accuracy; pearson for "
                                         "regression; entity f1 for tagging; f1 for question answering)")

    run = p.add_argument_group("run")
    run.add_argument("--device", help="default: cuda when available, else cpu")
    run.add_argument("--backend", choices=("auto", "triton", "torch"), help="default: the checkpoint's config")
    run.add_argument("--precision", choices=PRECISIONS, default=defaults.precision,
                     help="auto (the default): bf16 autocast on a GPU that supports it, fp32 elsewhere")
    run.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    return p


def config_from_args(args: argparse.Namespace) -> FinetuneConfig:
    values = vars(args)
    values["choice_columns"] = tuple(c.strip() for c in values["choice_columns"].split(",") if c.strip())
    return FinetuneConfig(**values)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)

    def run() -> int:
        try:
            result = finetune(config_from_args(args))
        except TrainingError as exc:  # the run went wrong, not the user's input
            logging.getLogger("fastbert").error("%s", exc)
            return 1
        if result["best"] is not None:
            print(f"best (epoch {result['best']['epoch']}): "
                  + ", ".join(f"{k} {v:.4f}" for k, v in result["best"].items() if k not in ("epoch", "step")))
        return 0

    return run_command("finetune", run)


if __name__ == "__main__":
    sys.exit(main())
