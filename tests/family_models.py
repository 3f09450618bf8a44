"""Tiny random models of BERT's family built with transformers' own classes, their batches and losses, for
tests/test_family*.py: RoBERTa, XLM-RoBERTa, CamemBERT, DistilBERT, ELECTRA (embedding_size != hidden_size)
and MPNet, at sizes the Triton interpreter runs in seconds."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

# architecture -> transformers' class-name prefix
PREFIXES = {"roberta": "Roberta", "xlm-roberta": "XLMRoberta", "camembert": "Camembert", "distilbert": "DistilBert",
            "electra": "Electra", "mpnet": "MPNet"}
ARCHITECTURES = tuple(PREFIXES)
HEADS = ("Model", "ForMaskedLM", "ForPreTraining", "ForSequenceClassification", "ForTokenClassification",
         "ForQuestionAnswering", "ForMultipleChoice", "ForCausalLM")
VOCAB, SEQ, LENGTHS, NUM_LABELS, CHOICES = 64, 13, (13, 6, 1), 2, 2  # transformers' default num_labels (QA needs 2)
# RoBERTa-type models and MPNet count positions from pad_token_id + 1: 40 positions hold SEQ tokens either way
SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
# the Triton attention takes head dims of 32, 64 and 128
TRITON_SIZES = dict(hidden_size=64, intermediate_size=128)


def hf_config(arch: str, **overrides):
    """transformers' config of `arch` at the tiny sizes, no dropout; overrides by BertConfig's names (DistilBERT's
    config gets them under its own)."""
    values = dict(SIZES, vocab_size=VOCAB, **overrides)
    if arch == "distilbert":
        names = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
                 "intermediate_size": "hidden_dim", "hidden_dropout_prob": "dropout",
                 "attention_probs_dropout_prob": "attention_dropout"}
        values = {names.get(k, k): v for k, v in values.items()}
        values.update(qa_dropout=0.0, seq_classif_dropout=0.0)
    if arch in ("roberta", "xlm-roberta", "camembert"):
        values.setdefault("type_vocab_size", 1)  # as roberta-base's config.json
    if arch == "electra":
        values.setdefault("embedding_size", 16)  # the discriminator's narrower tables, projected by embeddings_project
    return getattr(transformers, PREFIXES[arch] + "Config")(**values)


def head_class(arch: str, head: str):
    """transformers' class for the head, or None where the architecture has none."""
    return getattr(transformers, PREFIXES[arch] + head, None)


def arch_heads():
    """(arch, head) for every head transformers has for each architecture."""
    return [(arch, head) for arch in ARCHITECTURES for head in HEADS if head_class(arch, head) is not None]


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter drawn anew (LayerNorm weights around 1, MPNet's bias table at scale 1): transformers'
    initialisation leaves LayerNorms at the identity and biases at zero, where a weight read from the wrong
    module or a bias left out would go unseen."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float64)
            if "norm" in name.lower() and name.endswith("weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif "relative_attention_bias" in name:
                param.copy_(noise)
            else:
                param.copy_(0.1 * noise)
    return model


def hf_model(arch: str, head: str = "Model", seed: int = 0, **overrides):
    """transformers' model of the head with random weights, in eval mode (no dropout anyway)."""
    config = hf_config(arch, **overrides)
    if head == "ForCausalLM":
        config.is_decoder = False  # the MLM-style encoder fastbert accelerates (a decoder is refused)
    torch.manual_seed(seed)
    return randomize(head_class(arch, head)(config), seed).eval()


def padded_batch(config, lengths=LENGTHS, seq=SEQ, seed=0) -> dict:
    """input_ids [B, S] (pad_token_id past each length, the real ids away from the special ones) and
    attention_mask [B, S]."""
    generator = torch.Generator().manual_seed(seed)
    mask = (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(5, config.vocab_size, (len(lengths), seq), generator=generator)
    return dict(input_ids=ids.masked_fill(mask == 0, config.pad_token_id), attention_mask=mask)


def head_inputs(config, head: str, seed: int = 0) -> dict:
    """The padded batch and the labels of `head` (none for the base model); padding labelled -100."""
    generator = torch.Generator().manual_seed(seed + 1)
    inputs = padded_batch(config, seed=seed)
    mask = inputs["attention_mask"]
    batch = mask.shape[0]
    token_labels = torch.randint(0, config.vocab_size, mask.shape, generator=generator).masked_fill(mask == 0, -100)
    if head in ("ForMaskedLM", "ForCausalLM"):
        inputs["labels"] = token_labels
    elif head == "ForPreTraining":  # ELECTRA's discriminator: was each token replaced
        inputs["labels"] = torch.randint(0, 2, mask.shape, generator=generator)
    elif head == "ForSequenceClassification":
        inputs["labels"] = torch.randint(0, NUM_LABELS, (batch,), generator=generator)
    elif head == "ForTokenClassification":
        inputs["labels"] = torch.randint(0, NUM_LABELS, mask.shape, generator=generator).masked_fill(mask == 0, -100)
    elif head == "ForQuestionAnswering":
        # transformers' span loss is a softmax over every position, padding included, where fastbert's
        # attention output is zero by design (README, differences): its loss is compared on full rows
        inputs["attention_mask"] = mask = torch.ones_like(mask)
        inputs["input_ids"] = padded_batch(config, lengths=(SEQ,) * batch, seed=seed)["input_ids"]
        inputs["start_positions"] = torch.randint(0, SEQ, (batch,), generator=generator)
        inputs["end_positions"] = torch.minimum(inputs["start_positions"] + 1, torch.tensor(SEQ - 1))
    elif head == "ForMultipleChoice":  # [B, choices, S]: the batch and its rows reversed as a second choice
        inputs = {k: torch.stack([v, v.flip(0)], 1) for k, v in inputs.items()}
        inputs["labels"] = torch.randint(0, CHOICES, (batch,), generator=generator)
    return inputs


def flattened(inputs, start: int) -> dict:
    """The padded batch packed as transformers' DataCollatorWithFlattening packs it: input_ids [1, T],
    position_ids restarting at `start` in each sequence, cu_seq_lens_q / max_length_q (and _k)."""
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, position_ids_start=start)
    rows = [{"input_ids": ids[mask.bool()].tolist()} for ids, mask in zip(inputs["input_ids"],
                                                                           inputs["attention_mask"])]
    packed = collator(rows)
    del packed["labels"]
    return packed


def to_device(inputs: dict, device) -> dict:
    """The batch's tensors on `device` (the tests' device fixture: the GPU where there is one)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def real_tokens(output: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The entries of a per-token output [..., S, ...] (leading dims those of mask) on real tokens."""
    return output[mask.bool()] if tuple(output.shape[:mask.dim()]) == tuple(mask.shape) else output


def base_loss(output, mask: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A scalar that reads every real token's last hidden state (and the pooled output where there is one)
    through fixed random weights, so that every parameter of a base model gets a gradient."""
    generator = torch.Generator().manual_seed(seed + 2)
    hidden = output.last_hidden_state[mask.bool()]  # [T, H]
    weights = torch.randn(hidden.shape, generator=generator, dtype=torch.float64).to(hidden)
    loss = (hidden * weights).sum()
    pooled = getattr(output, "pooler_output", None)
    if pooled is not None:
        loss = loss + (pooled * torch.randn(pooled.shape, generator=generator, dtype=torch.float64).to(pooled)).sum()
    return loss


def named_outputs(output) -> dict:
    """The tensor fields of a transformers output (loss, logits, hidden states, ...)."""
    return {k: v for k, v in output.items() if isinstance(v, torch.Tensor)}
