"""fastbert: BERT whose hot paths are Triton kernels, a drop-in for HuggingFace transformers' BERT.

The model classes are imported on first use (PEP 562), so that `fastbert --version`, `fastbert
prepare-data` and its worker processes do not load torch (about 250 MB of memory per process).
"""
import importlib

__version__ = "0.1.0"
# public name -> module that defines it
_EXPORTS = {
    "BertConfig": "fastbert.config",
    "from_hf": "fastbert.hf",
    **{name: "fastbert.modeling" for name in (
        "BertModel", "BertForPreTraining", "BertForMaskedLM", "BertForNextSentencePrediction",
        "BertForSequenceClassification", "BertForTokenClassification", "BertForQuestionAnswering",
        "BertForMultipleChoice")},
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fastbert' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
