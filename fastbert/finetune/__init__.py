"""Fine-tuning (`fastbert finetune`) and feature extraction (`fastbert embed`): the second half of BERT.

readers   CSV / TSV / JSONL tables, CoNLL, SQuAD JSON -> examples (errors name the file and line)
encoding  tokenizer loading, [CLS] A [SEP] B [SEP] packing, padding to the batch's longest sequence
tasks     classification, regression, token classification, multiple choice; squad: question answering
metrics   accuracy, F1, Matthews, Pearson, Spearman, SQuAD EM / F1, entity-level F1
train     the loop with the paper's recipe; cli: the command; embed: the feature-based approach
"""
from fastbert.finetune.train import TASKS, FinetuneConfig, finetune

__all__ = ["TASKS", "FinetuneConfig", "finetune"]
