"""fastbert as a drop-in for transformers' BERT (issue 19's defects): each test does the same thing with
transformers and with fastbert and asserts that both behave alike (results, exception types, what is accepted)."""
import copy

import pytest
import torch

import fastbert
import fastbert.validation

transformers = pytest.importorskip("transformers")


def tiny_hf(name="BertModel", **fields):
    """A transformers BERT with random weights, small enough for the interpreter."""
    config = transformers.BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=16, **fields)
    torch.manual_seed(0)
    return getattr(transformers, name)(config).eval()


def tiny_modernbert_config(**fields):
    """transformers' ModernBERT config at the tiny sizes, its special token ids inside the small vocabulary."""
    return transformers.ModernBertConfig(**{**dict(vocab_size=120, hidden_size=32, intermediate_size=48,
                                                   num_hidden_layers=2, num_attention_heads=2, pad_token_id=0,
                                                   bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2),
                                            **fields})


def test_from_pretrained_loading_info_and_mismatched_sizes_as_transformers(tmp_path):
    tiny_hf("BertForSequenceClassification", num_labels=2).save_pretrained(tmp_path / "two")
    for cls in (transformers.BertForSequenceClassification, fastbert.BertForSequenceClassification):
        # no mismatch: the flag is accepted, the info is sets as transformers' LoadStateDictInfo.to_dict()
        model, info = cls.from_pretrained(tmp_path / "two", ignore_mismatched_sizes=True, output_loading_info=True)
        assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), cls
        assert info["mismatched_keys"] == set(), cls
        # a head of another size: RuntimeError without the flag, a fresh head and its report with it
        with pytest.raises(RuntimeError):
            cls.from_pretrained(tmp_path / "two", num_labels=3)
        model, info = cls.from_pretrained(tmp_path / "two", num_labels=3, ignore_mismatched_sizes=True,
                                          output_loading_info=True)
        assert model.classifier.weight.shape == (3, 32), cls
        assert {key for key, _, _ in info["mismatched_keys"]} == {"classifier.weight", "classifier.bias"}, cls
        assert ("classifier.weight", (2, 32), (3, 32)) in {
            (key, tuple(a), tuple(b)) for key, a, b in info["mismatched_keys"]}, cls


def test_from_pretrained_without_a_path_takes_config_and_state_dict():
    theirs = tiny_hf()
    config = fastbert.BertConfig.from_dict(theirs.config.to_dict())
    ours = fastbert.BertModel.from_pretrained(None, config=config, state_dict=theirs.state_dict())
    ids = torch.randint(1, 120, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).last_hidden_state, theirs(input_ids=ids).last_hidden_state,
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="config"):
        fastbert.BertModel.from_pretrained(None, state_dict=theirs.state_dict())


@pytest.mark.parametrize("selection", [[0, -1], [1], (0,), 2, -1, [], [0, 9]])
def test_output_hidden_states_selects_layers_as_transformers(selection):
    """transformers takes an index or indices for output_hidden_states: those hidden states come back, the
    others are None (out of range selects nothing; an empty list is no hidden states)."""
    theirs = tiny_hf()
    ours = fastbert.from_hf(theirs).eval()
    ids = torch.randint(1, 120, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    with torch.no_grad():
        expected = theirs(input_ids=ids, attention_mask=mask, output_hidden_states=selection).hidden_states
        for model in (ours, fastbert.from_hf(theirs, unpad=True).eval()):
            got = model(input_ids=ids, attention_mask=mask, output_hidden_states=selection).hidden_states
            if expected is None:
                assert got is None
                continue
            assert [h is None for h in got] == [h is None for h in expected], selection
            for a, b in zip(got, expected):
                if b is not None:
                    torch.testing.assert_close(a[mask.bool()], b[mask.bool()], atol=1e-5, rtol=1e-5)


def test_forward_ignores_keywords_transformers_ignores(caplog, monkeypatch):
    """sentence-transformers calls a module twice on one features dict; the second call passes back the
    token_embeddings the first wrote into it. transformers' BERT takes **kwargs and ignores such names:
    fastbert gives the same result and says once which name it ignored; decoder arguments with a value
    stay an error."""
    monkeypatch.setattr(fastbert.validation, "_REPORTED_UNKNOWN", set())  # earlier tests may have used the names
    theirs = tiny_hf()
    ours = fastbert.from_hf(theirs).eval()
    ids = torch.randint(1, 120, (2, 7), generator=torch.Generator().manual_seed(0))
    # and head_mask, which transformers 5's BERT no longer implements: even all zeros change nothing
    extra = {"token_embeddings": torch.zeros(2, 7, 32), "sentence_embedding": torch.zeros(2, 32),
             "head_mask": torch.zeros(2, 2)}
    with torch.no_grad():
        expected = theirs(input_ids=ids, **extra).last_hidden_state
        with caplog.at_level("WARNING", logger="fastbert"):
            for _ in range(2):
                torch.testing.assert_close(ours(input_ids=ids, **extra).last_hidden_state, expected,
                                           atol=1e-5, rtol=1e-5)
    ignored = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(ignored) == 1 and all(name in ignored[0] for name in extra)
    with pytest.raises(ValueError, match="encoder_hidden_states"):
        ours(input_ids=ids, encoder_hidden_states=torch.zeros(2, 7, 32))


def test_apply_then_resize_token_embeddings_takes_the_new_ids_and_keeps_buffers():
    """After fastbert.apply, transformers' resize_token_embeddings grows the table the accelerated encoder
    reads: a new token id runs (no "input_ids ... >= vocab_size") and gives transformers' numbers; the
    non-persistent position_ids / token_type_ids buffers of transformers' embeddings stay."""
    theirs = tiny_hf("BertForMaskedLM")
    ours = fastbert.apply(tiny_hf("BertForMaskedLM"))
    assert torch.equal(ours.bert.embeddings.position_ids, theirs.bert.embeddings.position_ids)
    assert torch.equal(ours.bert.embeddings.token_type_ids, theirs.bert.embeddings.token_type_ids)
    for model in (theirs, ours):
        torch.manual_seed(1)
        model.resize_token_embeddings(124)
    ids = torch.tensor([[2, 121, 123, 5]])
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, theirs(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="vocab_size"):
        ours(input_ids=torch.tensor([[124]]))


def test_apply_accelerates_an_lm_head_model_that_is_not_a_decoder():
    """BertLMHeadModel with is_decoder=False is an MLM-style encoder with an LM head: fastbert.apply gives
    transformers' logits and loss; with is_decoder=True it is refused, naming the field."""
    theirs = tiny_hf("BertLMHeadModel")
    ours = fastbert.apply(tiny_hf("BertLMHeadModel"))
    ids = torch.randint(1, 120, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = theirs(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="is_decoder"):
        fastbert.apply(tiny_hf("BertLMHeadModel", is_decoder=True))


@pytest.mark.parametrize("tied", [True, False])
def test_resize_token_embeddings_updates_sizes_and_survives_post_init(tied):
    """As transformers: model.vocab_size and config.vocab_size follow the new size, and post_init afterwards
    (as code that builds on a model calls it) re-initialises none of the rows resize set."""
    for model in (tiny_hf("BertForMaskedLM", tie_word_embeddings=tied),
                  fastbert.from_hf(tiny_hf("BertForMaskedLM", tie_word_embeddings=tied))):
        model.resize_token_embeddings(124)
        assert model.vocab_size == model.config.vocab_size == 124, type(model)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        model.post_init()
        for key, value in model.state_dict().items():
            assert torch.equal(value, before[key]), (type(model), key)


def test_config_has_transformers_attributes_and_is_checked_when_a_model_is_built():
    """transformers' BertConfig accepts hidden_size=256 with 12 heads (or is_decoder=True) and fails only
    when a model is built; fastbert's config does the same, and its model build names the field."""
    theirs, ours = transformers.BertConfig(), fastbert.BertConfig()
    for name in ("is_decoder", "add_cross_attention", "use_cache", "bos_token_id", "eos_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name
    transformers.BertConfig(hidden_size=256)
    config = fastbert.BertConfig(hidden_size=256)
    with pytest.raises(ValueError, match=r"hidden_size \(256\) must be divisible by num_attention_heads \(12\)"):
        fastbert.BertModel(config)
    config.num_attention_heads = 8  # a config edited after construction is checked as it is at build time
    assert fastbert.BertModel(config.replace(num_hidden_layers=1, vocab_size=50)).config.num_attention_heads == 8
    with pytest.raises(ValueError, match="is_decoder=True is not supported"):
        fastbert.BertModel(fastbert.BertConfig.tiny(is_decoder=True))


def test_apply_and_build_take_a_config_without_pad_token_id():
    """transformers builds BERT with pad_token_id=None (no padding row), and a user may set it so after
    construction: fastbert builds and accelerates such a model with transformers' numbers."""
    theirs = tiny_hf()
    theirs.config.pad_token_id = None  # edited after construction
    edited = tiny_hf()
    edited.config.pad_token_id = None
    fastbert.apply(edited)
    ids = torch.randint(1, 120, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(edited(input_ids=ids).last_hidden_state, theirs(input_ids=ids).last_hidden_state,
                                   atol=1e-5, rtol=1e-5)
    assert fastbert.BertModel(fastbert.BertConfig.tiny(pad_token_id=None)).embeddings.word_embeddings.padding_idx is None


@pytest.mark.parametrize("name", ["DistilBertForMaskedLM", "MPNetForMaskedLM", "MPNetModel", "DistilBertModel"])
def test_models_without_token_types_take_and_ignore_them_as_transformers(name):
    """transformers' DistilBERT and MPNet accept token_type_ids and ignore them (a tokenizer's or client's
    batch may carry them); fastbert's classes of the same name give the result without them."""
    prefix = "DistilBert" if name.startswith("DistilBert") else "MPNet"
    model = getattr(fastbert, name)(getattr(fastbert, prefix + "Config").tiny()).eval()
    ids = torch.randint(2, 1024, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=ids)[0]
        given = model(input_ids=ids, token_type_ids=torch.ones_like(ids))[0]
    assert torch.equal(plain, given)


def test_config_loads_what_transformers_loads_and_the_model_refuses_it(tmp_path):
    """hidden_size=32 with 12 heads: transformers builds, saves and loads the config (an override of the same
    kind too) and refuses the model; fastbert's config loads it alike and its model build names the fields."""
    transformers.BertConfig(hidden_size=32, num_attention_heads=12).save_pretrained(tmp_path)
    theirs, ours = transformers.BertConfig.from_pretrained(tmp_path), fastbert.BertConfig.from_pretrained(tmp_path)
    assert (ours.hidden_size, ours.num_attention_heads) == (theirs.hidden_size, theirs.num_attention_heads) == (32, 12)
    overridden = {cls.from_pretrained(tmp_path, num_attention_heads=5).num_attention_heads
                  for cls in (transformers.BertConfig, fastbert.BertConfig)}
    assert overridden == {5}
    with pytest.raises(ValueError, match=r"hidden size \(32\) is not a multiple of the number of attention heads"):
        transformers.BertModel(theirs)
    with pytest.raises(ValueError, match=r"hidden_size \(32\) must be divisible by num_attention_heads \(12\)"):
        fastbert.BertModel(ours)
    with pytest.raises(ValueError, match="backend"):  # fastbert's own switches, which transformers never sees
        fastbert.BertConfig.from_pretrained(tmp_path, backend="cuda")


@pytest.mark.parametrize("arch", ["bert", "roberta", "distilbert", "electra"])
def test_resize_with_untied_weights_initialises_new_output_rows_as_transformers(arch):
    """With tie_word_embeddings=False, transformers gives the new decoder rows the mean of the old decoder rows
    (sampled around it at 1e-9 of their covariance) and a decoder bias the mean of the old bias: fastbert's own
    model resized alike gives transformers' logits for the new ids, and the input rows as before."""
    from family_models import hf_model, randomize
    if arch == "bert":
        theirs = randomize(tiny_hf("BertForMaskedLM", tie_word_embeddings=False))
    else:
        theirs = hf_model(arch, "ForMaskedLM", tie_word_embeddings=False)
    ours = fastbert.from_hf(theirs)
    size = theirs.config.vocab_size + 5
    for model in (theirs, ours):
        torch.manual_seed(1)
        model.resize_token_embeddings(size)
    head = ours.vocabulary_head()  # the decoder and the bias its logits add
    torch.testing.assert_close(head.decoder.weight, theirs.get_output_embeddings().weight, atol=1e-4, rtol=0)
    torch.testing.assert_close(head.bias, theirs.get_output_embeddings().bias, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours.get_input_embeddings().weight, theirs.get_input_embeddings().weight, atol=1e-4,
                               rtol=0)
    ids = torch.tensor([[5, size - 1, size - 3, 7, 9]])
    with torch.no_grad():
        expected = theirs.eval()(input_ids=ids).logits
        torch.testing.assert_close(ours.eval()(input_ids=ids).logits, expected, atol=1e-4, rtol=0)
    assert expected.shape[-1] == size
    ours_state, theirs_state = ours.state_dict(), theirs.state_dict()  # the unused head bias too, left as it was
    assert {k: v.shape for k, v in ours_state.items()} == {k: v.shape for k, v in theirs_state.items()}


def test_resize_refuses_a_pad_to_multiple_of_that_is_not_an_integer_as_transformers():
    """transformers raises ValueError for pad_to_multiple_of=1.3; so does fastbert, before nn.Embedding's TypeError."""
    for model in (tiny_hf("BertForMaskedLM"), fastbert.from_hf(tiny_hf("BertForMaskedLM"))):
        with pytest.raises(ValueError, match=r"1\.3.*integer|integer.*1\.3"):
            model.resize_token_embeddings(124, pad_to_multiple_of=1.3)
        assert model.get_input_embeddings().num_embeddings == 120  # left as it was
    resized = fastbert.from_hf(tiny_hf("BertForMaskedLM")).resize_token_embeddings(121, pad_to_multiple_of=8)
    assert resized.num_embeddings == tiny_hf("BertForMaskedLM").resize_token_embeddings(121, 8).num_embeddings == 128


@pytest.mark.parametrize("arch", ["bert", "roberta", "distilbert", "electra", "mpnet", "modernbert"])
def test_applied_forward_keeps_the_signature_of_transformers_forward(arch):
    """Code reads a forward's signature (Trainer keeps the dataset columns it names, sentence-transformers the
    features): after apply it is transformers' own, and positional arguments mean what they mean there."""
    import inspect

    from family_models import hf_model, padded_batch
    if arch == "modernbert":
        from test_modernbert import hf_model as modernbert
        theirs = modernbert("Model")
    else:
        theirs = tiny_hf() if arch == "bert" else hf_model(arch)
    expected = inspect.signature(theirs.forward)
    ours = fastbert.apply(copy.deepcopy(theirs))
    assert inspect.signature(ours.forward) == expected
    head = fastbert.apply(tiny_hf("BertForSequenceClassification"))
    assert inspect.signature(head.bert.forward) == inspect.signature(tiny_hf().forward)
    batch = padded_batch(theirs.config, lengths=(7, 4), seq=7)
    named = [p for p in expected.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    # up to six (BERT's sixth is encoder_hidden_states, which fastbert's own forward takes by keyword only)
    positional = [batch["input_ids"], batch["attention_mask"]] + [None] * (min(len(named), 6) - 2)
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        torch.testing.assert_close(ours(*positional)[0][mask], theirs(*positional)[0][mask], atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match=r"forward\(\) takes \d+ positional arguments but \d+ were given"):
        ours(*[None] * (len(named) + 1))  # more than transformers' forward takes


def test_a_mismatched_head_is_reported_in_transformers_words(tmp_path, caplog):
    """transformers' load report says MISMATCH, "Reinit due to size mismatch - ckpt: ... vs model: ..." for a head
    of another size; fastbert's one warning line says the same of each key."""
    tiny_hf("BertForSequenceClassification", num_labels=2).save_pretrained(tmp_path)
    with caplog.at_level("WARNING", logger="fastbert"):
        fastbert.BertForSequenceClassification.from_pretrained(tmp_path, num_labels=3, ignore_mismatched_sizes=True)
    assert "mismatched keys (reinit due to size mismatch)" in caplog.text
    assert "classifier.weight ckpt: (2, 32) vs model: (3, 32)" in caplog.text


def test_from_pretrained_under_a_meta_device_is_refused_as_transformers(tmp_path):
    """transformers refuses from_pretrained inside `with torch.device("meta")` (it would load nothing), a
    RuntimeError; fastbert too, where it loaded the weights onto the CPU regardless."""
    tiny_hf().save_pretrained(tmp_path)
    for cls in (transformers.BertModel, fastbert.BertModel):
        with pytest.raises(RuntimeError, match="meta"), torch.device("meta"):
            cls.from_pretrained(tmp_path)
    assert fastbert.BertModel.from_pretrained(tmp_path).embeddings.word_embeddings.weight.device.type == "cpu"


def test_fused_paths_read_a_weight_held_outside_the_parameter_dict():
    # what a reparametrisation may do: the parameter deleted, a tensor attribute in its place. The fused paths read
    # parameters from the modules' parameter dicts (fastbert.modeling.weight_and_bias); they must read this one
    # where calling the module would
    torch.manual_seed(0)
    model = fastbert.BertModel(fastbert.BertConfig.tiny(backend="torch")).eval()
    doubled = copy.deepcopy(model)
    ids = torch.randint(5, 100, (2, 8))
    for m in (model, doubled):
        layer = m.encoder.layer[0]
        modules = (layer.attention.self.query, layer.intermediate.dense, layer.output.LayerNorm)
        for module in modules:
            if m is doubled:
                module.weight.data *= 2
            else:
                weight = module.weight.detach() * 2
                del module.weight
                module.weight = weight
                assert "weight" not in module._parameters
    with torch.no_grad():
        torch.testing.assert_close(model(ids).last_hidden_state, doubled(ids).last_hidden_state, rtol=0, atol=0)


def test_a_layers_children_read_as_nn_module_reads_them_whatever_a_tool_does_to_them():
    # fastbert's layers read their children through class attributes (fastbert.modeling.Submodule) rather than
    # nn.Module.__getattr__: a swap, a direct write of _modules (add_module, what some tools do), a deletion and a
    # plain attribute in a deleted child's place must read as they read on a module without those attributes
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = torch.nn.Linear(4, 4)

    ours = fastbert.BertModel(fastbert.BertConfig.tiny()).encoder.layer[0].intermediate
    theirs = Plain()
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    for module in (ours, theirs):
        module.dense = first
        assert module.dense is first
        module.add_module("dense", second)
        assert module.dense is second
        module._modules["dense"] = first
        assert module.dense is first
        module.dense = None
        assert module.dense is None and "dense" in module._modules
        del module.dense
        assert not hasattr(module, "dense")
        with pytest.raises(AttributeError, match=f"'{type(module).__name__}' object has no attribute 'dense'"):
            module.dense
        module.dense = 3  # no child of that name now: a plain attribute
        assert module.dense == 3 and "dense" not in module._modules


@pytest.mark.parametrize("name", ["Bert", "DistilBert", "MPNet", "ModernBert"])
def test_a_forward_reads_no_child_of_a_layer_through_nn_module_getattr(name, monkeypatch):
    # each such read fails a lookup first and, on Python 3.11, builds an AttributeError: 15 reads a BERT layer,
    # a tenth of an inference forward's host instructions. Torch's own modules (Linear, LayerNorm) read their
    # parameters so; fastbert's classes declare their children (fastbert.modeling.Submodule)
    config = getattr(fastbert, name + "Config").tiny()
    model = getattr(fastbert, name + "Model")(config).eval()
    fallbacks = []
    getattr_of_modules = torch.nn.Module.__getattr__

    def counted(module, attribute):
        fallbacks.append((type(module), attribute))
        return getattr_of_modules(module, attribute)

    monkeypatch.setattr(torch.nn.Module, "__getattr__", counted)
    with torch.no_grad():
        model(torch.randint(5, 100, (2, 8)), attention_mask=torch.tensor([[1] * 8, [1] * 5 + [0] * 3]))
    layers = [m for m in model.modules() if isinstance(m, fastbert.modeling.EncoderLayer)]
    ours = {type(m) for layer in layers for m in layer.modules() if type(m).__module__.startswith("fastbert.")}
    assert len(layers) == config.num_hidden_layers and fallbacks
    assert not [(cls.__name__, attribute) for cls, attribute in fallbacks if cls in ours]


@pytest.mark.parametrize("name", ["BertModel", "RobertaModel"])
def test_a_base_model_without_its_pooler_is_copied_without_one(name):
    """transformers' base model built with add_pooling_layer=False has no pooler and pooler_output None: from_hf's
    copy has none either (not a pooler of random weights), nor has its to_hf."""
    config_class = getattr(transformers, name.replace("Model", "Config"))
    config = config_class(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=64, max_position_embeddings=20)
    theirs = getattr(transformers, name)(config, add_pooling_layer=False).eval()
    ours = fastbert.from_hf(theirs).eval()
    ids = torch.randint(3, 120, (2, 7), generator=torch.Generator().manual_seed(0))
    expected, actual = theirs(input_ids=ids), ours(input_ids=ids)
    assert ours.pooler is None and actual.pooler_output is None and expected.pooler_output is None
    torch.testing.assert_close(actual.last_hidden_state, expected.last_hidden_state, atol=1e-5, rtol=1e-5)
    assert ours.to_hf().pooler is None
    assert fastbert.from_hf(getattr(transformers, name)(config)).pooler is not None  # with one, copied with it


def test_any_nonzero_mask_value_is_a_token_as_in_transformers():
    """transformers attends wherever an integer attention_mask is nonzero: a mask of 0s and 2s gives the result of
    0s and 1s, on fastbert's PyTorch path as on its kernels (it doubled the real rows' attention output)."""
    theirs = tiny_hf()
    ours = fastbert.from_hf(theirs).eval()
    ids = torch.randint(1, 120, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    real = mask.bool()
    with torch.no_grad():
        expected = theirs(input_ids=ids, attention_mask=mask).last_hidden_state[real]
        for twos in (mask * 2, (mask * 2).to(torch.uint8)):
            actual = ours(input_ids=ids, attention_mask=twos).last_hidden_state[real]
            torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_gelu_python_is_the_exact_gelu():
    """transformers' hidden_act "gelu_python" is the exact (erf) GELU written in Python: fastbert takes it as "gelu"
    (it was refused)."""
    theirs = tiny_hf(hidden_act="gelu_python")
    ours = fastbert.from_hf(theirs).eval()
    ids = torch.randint(1, 120, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).last_hidden_state, theirs(input_ids=ids).last_hidden_state,
                                   atol=1e-5, rtol=1e-5)


def test_a_sequence_longer_than_the_position_table_runs_with_position_ids_inside_it():
    """transformers' BERT runs a sequence longer than max_position_embeddings when its position_ids stay inside
    the table (they index it): so does fastbert; without position_ids the length is refused, naming the limit."""
    theirs = tiny_hf()  # max_position_embeddings 16
    ours = fastbert.from_hf(theirs).eval()
    ids = torch.randint(1, 120, (2, 20), generator=torch.Generator().manual_seed(0))
    positions = (torch.arange(20) % 16)[None, :]
    with torch.no_grad():
        expected = theirs(input_ids=ids, position_ids=positions).last_hidden_state
        torch.testing.assert_close(ours(input_ids=ids, position_ids=positions).last_hidden_state, expected,
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"sequence length 20 is longer than max_position_embeddings \(16\)"):
        ours(input_ids=ids)
    with pytest.raises(ValueError, match="position_ids"):
        ours(input_ids=ids, position_ids=torch.arange(20)[None, :])


def _same_outputs(ours, theirs, **inputs):
    with torch.no_grad():
        expected, actual = theirs(**inputs), ours(**inputs)
    for name in ("last_hidden_state", "pooler_output", "logits"):
        assert (actual.get(name) is None) == (expected.get(name) is None), name
        if expected.get(name) is not None:
            torch.testing.assert_close(actual[name], expected[name], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("applied", [False, True], ids=["fastbert", "applied"])
def test_a_module_whose_forward_was_replaced_is_called(applied):
    """accelerate's hooks replace a module's forward on the instance: transformers' forward calls the module, so
    the replacement runs. The fused paths read a plain Linear's or LayerNorm's weights instead of calling it, and
    read these too: a scaled Linear and LayerNorm changed transformers' outputs and not fastbert's."""
    accelerate_hooks = pytest.importorskip("accelerate.hooks")

    class Halve(accelerate_hooks.ModelHook):
        def post_forward(self, module, output):
            return output * 0.5

    theirs = tiny_hf().eval()
    ours = fastbert.apply(copy.deepcopy(theirs)) if applied else fastbert.from_hf(theirs).eval()
    for model in (theirs, ours):
        layer = model.encoder.layer[0]
        accelerate_hooks.add_hook_to_module(layer.intermediate.dense, Halve())
        layer.output.LayerNorm.forward = lambda x, norm=layer.output.LayerNorm: torch.nn.LayerNorm.forward(norm, x) + 1
        assert "forward" in vars(layer.intermediate.dense)
    ids = torch.randint(1, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    _same_outputs(ours, theirs, input_ids=ids)


def test_apply_refuses_hooks_it_would_drop_and_accelerates_dispatch():
    """apply replaces transformers' containers (embeddings, encoder, its layers and their sublayers, pooler) with
    fastbert's: a forward hook on one of them, or accelerate's dispatch hooks (device_map, offloading), would stop
    running without a word. They are refused by name, the model left unchanged; hooks on the Linears, LayerNorms
    and embeddings inside, which stay, are kept (tests/test_clients_peft.py)."""
    accelerate_hooks = pytest.importorskip("accelerate.hooks")
    theirs = tiny_hf()
    handle = theirs.encoder.layer[1].attention.register_forward_hook(lambda module, args, output: None)
    with pytest.raises(ValueError, match=r"BertModel\.encoder\.layer\.1\.attention has hooks, which would no longer"):
        fastbert.apply(theirs)
    assert type(theirs.encoder).__module__.startswith("transformers")  # left as it was
    handle.remove()
    accelerate_hooks.add_hook_to_module(theirs.embeddings, accelerate_hooks.ModelHook())
    with pytest.raises(ValueError, match="dispatched by accelerate .* a hook on embeddings"):
        fastbert.apply(theirs)
    accelerate_hooks.remove_hook_from_module(theirs.embeddings)
    theirs.forward = lambda *args, forward=theirs.forward, **kwargs: forward(*args, **kwargs)  # apply would replace it
    with pytest.raises(ValueError, match=r"BertModel\.forward has a forward of its own"):
        fastbert.apply(theirs)
    del theirs.forward
    assert fastbert.apply(theirs) is theirs


def test_children_replaced_after_apply_are_the_ones_run():
    """transformers' forward reads bert.embeddings and bert.pooler at each call: a pooler of one's own, None, or
    new embeddings set after apply are run (they were ignored: fastbert's model kept the old ones). A transformers
    layer in the encoder's list is a TypeError naming it, where it failed deep inside with another message."""
    from transformers.models.bert.modeling_bert import BertEmbeddings, BertLayer

    theirs = tiny_hf("BertForSequenceClassification", num_labels=3).eval()
    ours = fastbert.apply(copy.deepcopy(theirs))
    ids = torch.randint(1, 100, (2, 7), generator=torch.Generator().manual_seed(0))  # no padding: every row real

    class MeanPooler(torch.nn.Module):
        def forward(self, hidden):
            return hidden.mean(1)

    torch.manual_seed(3)
    embeddings = BertEmbeddings(theirs.config).eval()
    for child, value in (("pooler", MeanPooler()), ("embeddings", embeddings), ("pooler", None)):
        for model in (theirs, ours):
            setattr(model.bert, child, copy.deepcopy(value))
        _same_outputs(ours.bert, theirs.bert, input_ids=ids)
        if value is not None:  # transformers' classifier reads outputs[1]: no pooler is its IndexError
            _same_outputs(ours, theirs, input_ids=ids)
    ours.bert.encoder.layer.append(BertLayer(theirs.config))
    with pytest.raises(TypeError, match="encoder layer 2 is a BertLayer, which fastbert's encoder cannot call"):
        ours(input_ids=ids)

    class Wrapper(torch.nn.Module):  # around fastbert's layer: a TypeError inside it keeps its own message
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, *args):
            raise TypeError("the wrapper's own")

    ours.bert.encoder.layer[2] = Wrapper(ours.bert.encoder.layer[0])
    with pytest.raises(TypeError, match="^the wrapper's own$"):
        ours(input_ids=ids)


def test_self_attention_has_transformers_attributes():
    """Head-pruning scripts and attention visualisers read them."""
    theirs = tiny_hf()
    for ours in (fastbert.from_hf(theirs), fastbert.apply(copy.deepcopy(theirs))):
        for name in ("num_attention_heads", "attention_head_size", "all_head_size", "scaling"):
            assert getattr(ours.encoder.layer[0].attention.self, name) == getattr(
                theirs.encoder.layer[0].attention.self, name), name


@pytest.mark.parametrize("arch", ["bert", "mpnet", "distilbert", "modernbert"])
def test_the_encoder_called_as_transformers_names_the_layout_it_takes(arch):
    """Code written for transformers calls the encoder as encoder(hidden_states, attention_mask): after apply it
    meets fastbert's encoder, which says what it takes rather than failing in a layer (AttributeError before)."""
    from family_models import hf_model

    if arch == "bert":
        model = tiny_hf()
    elif arch == "modernbert":
        model = transformers.ModernBertModel(tiny_modernbert_config()).eval()
    else:
        model = hf_model(arch)
    fastbert.apply(model)
    encoder = {"distilbert": "transformer", "modernbert": "layers"}.get(arch, "encoder")
    with pytest.raises(TypeError, match=r"takes fastbert's AttentionLayout as its second argument, got Tensor"):
        getattr(model, encoder)(torch.randn(2, 5, 32), torch.zeros(2, 1, 1, 5))
    assert model(input_ids=torch.randint(0, 60, (2, 5))).last_hidden_state.shape == (2, 5, 32)


def _meta_built(model_class, config, accelerate: bool) -> torch.nn.Module:
    """The model built on the meta device, applied or not, materialised and initialised by transformers'
    init_weights from one seed (how a large model is built before its weights are loaded or trained)."""
    with torch.device("meta"):
        model = model_class(config)
    if accelerate:
        fastbert.apply(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


@pytest.mark.parametrize("name", ["BertForMaskedLM", "DistilBertForSequenceClassification", "MPNetModel",
                                  "ElectraModel", "ModernBertForMaskedLM"])
def test_apply_on_a_meta_model_then_init_weights_gives_transformers_weights(name):
    """apply read the LayerNorm weights of a model built on the meta device (RuntimeError: Tensor.item() on meta
    tensors). After it, init_weights set what transformers' _init_weights sets by module class on transformers'
    modules only: BERT's position_ids and token_type_ids buffers stayed uninitialised memory, DistilBERT's
    sinusoidal positions were random, ModernBERT's projections had the generic std. Now every weight and buffer
    is bitwise transformers' own."""
    from family_models import hf_config

    if name.startswith("Bert"):
        config = transformers.BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64)
    elif name.startswith("ModernBert"):
        config = tiny_modernbert_config()
    elif name.startswith("DistilBert"):
        config = hf_config("distilbert", sinusoidal_pos_embds=True)
    else:
        config = hf_config(name.removesuffix("Model").lower())
    model_class = getattr(transformers, name)
    theirs, ours = (_meta_built(model_class, config, accelerate) for accelerate in (False, True))
    expected = {**dict(theirs.named_parameters()), **dict(theirs.named_buffers())}
    got = {**dict(ours.named_parameters()), **dict(ours.named_buffers())}
    assert got.keys() == expected.keys()
    assert [key for key in expected if not torch.equal(got[key], expected[key])] == []
    # a deep copy initialises its own modules (the init keeps its model as a partial's argument, which deepcopy maps)
    copy_of_ours = copy.deepcopy(ours)
    torch.manual_seed(0)
    copy_of_ours.init_weights()
    for (key, value), original in zip(copy_of_ours.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(value, original) and value.data_ptr() != original.data_ptr(), key


def test_apply_takes_a_config_transformers_runs_though_its_constructor_refuses_it():
    """transformers checks problem_type against num_labels when a config is built, not when a user sets them later
    (its test_problem_types does): apply rebuilt the config for fastbert's base model and refused it."""
    config = transformers.BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64)
    config.problem_type, config.num_labels = "single_label_classification", 1
    torch.manual_seed(0)
    theirs = transformers.BertForSequenceClassification(config).eval()
    ours = fastbert.apply(copy.deepcopy(theirs))
    ids = torch.randint(0, 120, (2, 7), generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 0])
    expected, got = (model(input_ids=ids, labels=labels) for model in (theirs, ours))
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.loss, expected.loss)
    assert ours.config.problem_type == "single_label_classification"


@pytest.mark.parametrize("arch", ["bert", "distilbert", "modernbert"])
def test_checkpointing_enabled_before_apply_is_kept(arch):
    """transformers sets checkpointing on its layers, which apply replaces: enabled before apply, it was lost (a
    training forward kept every activation; DistilBERT even said it was off). fastbert's encoder now takes it over,
    every n-th layer included: it saves for the backward what the model enabled after apply saves."""
    from family_models import hf_model

    from tests.test_ffn import saved_bytes

    def build():
        if arch == "bert":
            model = transformers.BertModel(transformers.BertConfig(
                vocab_size=120, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64))
        elif arch == "modernbert":
            model = transformers.ModernBertModel(tiny_modernbert_config(num_hidden_layers=4))
        else:
            model = hf_model(arch, num_hidden_layers=4)
        return model.train()

    ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(0))

    def kept(model):
        return sum(size for size, _ in saved_bytes(lambda: model(input_ids=ids).last_hidden_state)[0].values())

    before = build()
    before.activation_checkpointing_enable(every_n_layers=2)
    fastbert.apply(before)
    after = fastbert.apply(build())
    after.activation_checkpointing_enable(every_n_layers=2)
    assert before.is_gradient_checkpointing
    encoder = next(m for m in before.modules() if hasattr(m, "checkpointed_every"))
    assert encoder.gradient_checkpointing and encoder.checkpointed_every == 2
    assert kept(before) == kept(after) < kept(fastbert.apply(build()))


def test_mpnet_heads_index_the_tuple_of_an_applied_base_as_transformers_builds_it():
    """transformers' MPNet returns its base's tuple by position, the pooler's None kept, and its heads take
    outputs[2:]: after apply the base left the None out, so a head's hidden_states came back as its attentions."""
    from family_models import hf_model, randomize

    theirs = hf_model("mpnet", "ForSequenceClassification")
    ours = fastbert.apply(randomize(copy.deepcopy(theirs)))
    ids = torch.randint(3, 60, (3, 7), generator=torch.Generator().manual_seed(0))
    for flags in (dict(output_hidden_states=True), dict(output_hidden_states=True, output_attentions=True), {}):
        expected, got = (model(input_ids=ids, return_dict=False, **flags) for model in (theirs, ours))
        assert len(got) == len(expected), flags
        for a, b in zip(got, expected):
            torch.testing.assert_close(torch.stack(list(a)) if isinstance(a, tuple) else a,
                                       torch.stack(list(b)) if isinstance(b, tuple) else b, atol=1e-5, rtol=1e-5)


def test_modernbert_runs_past_max_position_embeddings_as_transformers():
    """ModernBERT's positions are rotary, with no table to run out of: transformers runs a sequence longer than
    max_position_embeddings, which fastbert refused as it refuses it for BERT's learned table."""
    config = tiny_modernbert_config(max_position_embeddings=16)
    torch.manual_seed(0)
    theirs = transformers.ModernBertModel(config).eval()
    ours = fastbert.apply(copy.deepcopy(theirs))
    ids = torch.randint(3, 120, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).last_hidden_state, theirs(input_ids=ids).last_hidden_state,
                                   atol=1e-5, rtol=1e-5)
