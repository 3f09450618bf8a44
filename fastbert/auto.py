"""fastbert's models in transformers' Auto classes (done on import where transformers is installed).

The registrations are keyed on fastbert.BertConfig, so they take effect when an Auto class is given a
fastbert config; a config.json's own model_type ("bert") keeps loading transformers' BERT:

    config = fastbert.BertConfig.from_pretrained("bert-base-uncased")   # or a local directory
    model = AutoModelForSequenceClassification.from_pretrained("bert-base-uncased", config=config, num_labels=3)
"""
from __future__ import annotations

from fastbert import modeling
from fastbert.config import BertConfig

AUTO_CLASSES = {"AutoModel": "BertModel", "AutoModelForPreTraining": "BertForPreTraining",
                "AutoModelForMaskedLM": "BertForMaskedLM",
                "AutoModelForNextSentencePrediction": "BertForNextSentencePrediction",
                "AutoModelForSequenceClassification": "BertForSequenceClassification",
                "AutoModelForTokenClassification": "BertForTokenClassification",
                "AutoModelForQuestionAnswering": "BertForQuestionAnswering",
                "AutoModelForMultipleChoice": "BertForMultipleChoice"}


def register() -> None:
    """Map fastbert.BertConfig to fastbert's class in each of transformers' Auto model classes.
    exist_ok: fastbert's config shares transformers' class name and model_type ("bert"), which the
    registry would otherwise refuse as taken."""
    import transformers

    for auto_name, model_name in AUTO_CLASSES.items():
        getattr(transformers, auto_name).register(BertConfig, modeling.MODEL_CLASSES[model_name], exist_ok=True)
