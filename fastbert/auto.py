"""fastbert's models in transformers' Auto classes (fastbert.architectures registers them on import where
transformers is installed).

The registrations are keyed on fastbert's config classes, so they take effect when an Auto class is given a
fastbert config; a config.json's own model_type ("bert", "roberta", ...) keeps loading transformers' class:

    config = fastbert.BertConfig.from_pretrained("bert-base-uncased")   # or a local directory
    model = AutoModelForSequenceClassification.from_pretrained("bert-base-uncased", config=config, num_labels=3)
"""
from __future__ import annotations

# transformers' Auto class -> the head it builds (fastbert's class is the architecture's name + the head)
AUTO_HEADS = {"AutoModel": "Model", "AutoModelForPreTraining": "ForPreTraining",
              "AutoModelForMaskedLM": "ForMaskedLM", "AutoModelForNextSentencePrediction": "ForNextSentencePrediction",
              "AutoModelForSequenceClassification": "ForSequenceClassification",
              "AutoModelForTokenClassification": "ForTokenClassification",
              "AutoModelForQuestionAnswering": "ForQuestionAnswering",
              "AutoModelForMultipleChoice": "ForMultipleChoice"}


def register(config_classes, model_classes: dict[str, type]) -> None:
    """Map each fastbert config class to fastbert's class of each head it has, in transformers' Auto classes.
    exist_ok: fastbert's configs share transformers' model_types, which the registry would otherwise refuse
    as taken."""
    import transformers

    for config_class in config_classes:
        prefix = config_class.__name__.removesuffix("Config")
        for auto_name, head in AUTO_HEADS.items():
            # an architecture without a ForPreTraining class pretrains its masked LM, as transformers' mapping says
            model_class = model_classes.get(prefix + head) or (
                model_classes.get(prefix + "ForMaskedLM") if head == "ForPreTraining" else None)
            if model_class is not None and model_class.config_class is config_class:
                getattr(transformers, auto_name).register(config_class, model_class, exist_ok=True)
