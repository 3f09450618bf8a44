"""fastbert: BERT whose hot paths are Triton kernels, a drop-in for HuggingFace transformers' BERT.

The public names are imported on first use (PEP 562), so that `fastbert --version`, `fastbert
prepare-data` and its worker processes do not load torch (about 250 MB of memory per process).
Any of them imports fastbert.architectures first, which registers the models with transformers' Auto
classes where transformers is installed (see fastbert.auto).
"""
import importlib
import importlib.abc
import importlib.util
import os
import sys

__version__ = "0.1.0"


class _CheckoutKernels(importlib.abc.MetaPathFinder):
    """`fastbert.kernels` of a checkout: kernels/ beside this fastbert/, as setup.py's package_dir maps it, also
    where the checkout runs without an install (PYTHONPATH=checkout, as the GPU check may) or where another
    checkout is the one installed (its mapping would pair this fastbert with its kernels). An installed copy
    (fastbert/kernels is a folder or a link) is left to the usual import."""

    def find_spec(self, name, path=None, target=None):
        here = os.path.dirname(os.path.abspath(__file__))
        kernels = os.path.join(os.path.dirname(here), "kernels")
        if (name != "fastbert.kernels" or os.path.exists(os.path.join(here, "kernels"))
                or not os.path.isfile(os.path.join(kernels, "__init__.py"))):
            return None
        return importlib.util.spec_from_file_location(name, os.path.join(kernels, "__init__.py"),
                                                      submodule_search_locations=[kernels])


sys.meta_path.insert(0, _CheckoutKernels())
# public name -> (module that defines it, its name there)
_EXPORTS = {
    "BertConfig": ("fastbert.config", "BertConfig"),
    "from_hf": ("fastbert.architectures", "from_hf"),
    "apply": ("fastbert.in_place", "apply"),
    "load_config": ("fastbert.architectures", "load_config"),
    "CapturedForward": ("fastbert.captured", "CapturedForward"),
    **{name: ("fastbert.modeling", name) for name in (
        "BertModel", "BertForPreTraining", "BertForMaskedLM", "BertForNextSentencePrediction",
        "BertForSequenceClassification", "BertForTokenClassification", "BertForQuestionAnswering",
        "BertForMultipleChoice")},
    **{name: ("fastbert.family_config", name) for name in (
        "RobertaConfig", "XLMRobertaConfig", "CamembertConfig", "ElectraConfig", "MPNetConfig", "DistilBertConfig",
        "ModernBertConfig")},
    **{name: ("fastbert.family", name) for name in (
        "RobertaModel", "RobertaForMaskedLM", "XLMRobertaModel", "XLMRobertaForMaskedLM", "CamembertModel",
        "CamembertForMaskedLM", "ElectraModel", "ElectraForMaskedLM", "ElectraForPreTraining", "DistilBertModel",
        "DistilBertForMaskedLM", "MPNetModel", "MPNetForMaskedLM")},
    **{name: ("fastbert.modernbert", name) for name in (
        "ModernBertModel", "ModernBertForMaskedLM", "ModernBertForSequenceClassification",
        "ModernBertForTokenClassification")},
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fastbert' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    importlib.import_module("fastbert.architectures")  # the models and their Auto registration come first
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
