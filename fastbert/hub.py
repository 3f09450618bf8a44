"""Where a checkpoint is: a local directory, or a hub id resolved through the HF cache (huggingface_hub),
offline included (HF_HUB_OFFLINE=1 or local_files_only=True read the cache only)."""
from __future__ import annotations

import os

# transformers' from_pretrained arguments that say where to find the files
HUB_ARGUMENTS = ("cache_dir", "revision", "subfolder", "token", "local_files_only", "force_download")
# the files a model needs: config and weights, single or sharded
CHECKPOINT_PATTERNS = ("config.json", "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin",
                       "pytorch_model.bin.index.json")
# the files of a tokenizer, fetched too for the commands that tokenize (finetune, embed, convert): BERT's and
# the family's (byte-level BPE's vocab.json + merges.txt, XLM-R's and CamemBERT's SentencePiece model)
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "sentencepiece.bpe.model", "spiece.model")


def resolve(name_or_path: str | os.PathLike, cache_dir=None, revision=None, subfolder: str = "", token=None,
            local_files_only: bool = False, force_download: bool = False, tokenizer: bool = False) -> str:
    """The local directory holding the checkpoint `name_or_path` names (with its tokenizer files when
    `tokenizer`). Raises NotADirectoryError for a file, FileNotFoundError saying what was tried when it is
    neither an existing directory nor a hub id found in the cache or online."""
    path = os.fspath(name_or_path)
    if os.path.isdir(path):
        return os.path.join(path, subfolder) if subfolder else path
    accepted = "a local checkpoint directory (config.json + model.safetensors) or a hub id such as 'org/name'"
    if os.path.isfile(path):
        raise NotADirectoryError(f"{path!r} is a file, not a checkpoint directory; expected {accepted}")
    try:
        import huggingface_hub
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:
        raise FileNotFoundError(f"{path!r}: no such directory; expected {accepted} "
                                "(hub ids need huggingface_hub: pip install huggingface_hub)") from None
    try:
        validate_repo_id(path)
    except HFValidationError:
        raise FileNotFoundError(f"{path!r}: no such directory, and not a valid hub id; expected {accepted}") from None
    patterns = [f"{subfolder}/{p}" if subfolder else p
                for p in CHECKPOINT_PATTERNS + (TOKENIZER_FILES if tokenizer else ())]
    try:
        snapshot = huggingface_hub.snapshot_download(
            path, revision=revision, cache_dir=cache_dir, token=token, local_files_only=local_files_only,
            force_download=force_download, allow_patterns=patterns)
    except Exception as exc:  # not cached while offline, no such repo or revision, no network: all say the same
        offline = huggingface_hub.constants.is_offline_mode() or local_files_only
        where = "in the HF cache (offline mode)" if offline else "in the HF cache or on the hub"
        raise FileNotFoundError(f"{path!r}: no such directory, and not found {where} "
                                f"({type(exc).__name__}: {exc}); expected {accepted}") from exc
    return os.path.join(snapshot, subfolder) if subfolder else snapshot
