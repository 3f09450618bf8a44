"""fastbert: BERT whose hot paths are Triton kernels, a drop-in for HuggingFace transformers' BERT."""
from fastbert.config import BertConfig
from fastbert.hf import from_hf
from fastbert.modeling import (
    BertForMaskedLM,
    BertForMultipleChoice,
    BertForNextSentencePrediction,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
)

__version__ = "0.1.0"
__all__ = [
    "BertConfig", "BertModel", "BertForPreTraining", "BertForMaskedLM", "BertForNextSentencePrediction",
    "BertForSequenceClassification", "BertForTokenClassification", "BertForQuestionAnswering",
    "BertForMultipleChoice", "from_hf", "__version__",
]
