"""SQuAD windows, training positions and span extraction on hand-made examples and hand-made logits,
including answers that cross a window boundary."""
import numpy as np
import pytest

from fastbert.finetune.encoding import Packer, tokenizer_for
from fastbert.finetune.readers import QAExample
from fastbert.finetune.squad import QuestionAnsweringTask, max_context, token_span, windows

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


@pytest.fixture(scope="module")
def packer(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab")
    (path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "where", "?", "!", ","]
                                              + WORDS) + "\n")
    # question "where" (1 token) + 3 specials + 4 context tokens
    return Packer(tokenizer_for(str(path)), max_seq_length=8)


def test_windows_and_max_context():
    assert windows(10, 4, 2) == [(0, 4), (2, 4), (4, 4), (6, 4)]
    assert windows(3, 4, 2) == [(0, 3)]
    assert windows(9, 4, 3) == [(0, 4), (3, 4), (6, 3)]
    flags = max_context([(0, 4), (2, 4), (4, 4), (6, 4)])
    # token 3: window 0 has min(3, 0) = 0 tokens of context, window 1 min(1, 2) = 1 -> window 1
    assert flags[0] == [True, True, True, False] and flags[1][1] is True
    # token 6: window 2 min(2, 1) = 1, window 3 min(0, 3) = 0 -> window 2; token 9 only in window 3
    assert flags[2][2] is True and flags[3] == [False, True, True, True]


def test_token_span():
    offsets = [(0, 5), (6, 10), (11, 16)]
    assert token_span(offsets, 6, 10) == (1, 1)
    assert token_span(offsets, 7, 14) == (1, 2)  # characters inside tokens widen to whole tokens
    assert token_span(offsets, 5, 6) is None  # only the space between tokens


def example(answer_words, impossible=False):
    context = " ".join(WORDS)
    answers = []
    if answer_words:
        text = " ".join(answer_words)
        answers = [(text, context.index(text))]
    return QAExample("q", "where", context, answers, impossible)


def test_training_positions_across_window_boundary(packer):
    task = QuestionAnsweringTask(packer, doc_stride=2, max_query_length=4)
    inputs, meta = task.features([example(["zeta", "eta"])])  # context tokens 5 and 6
    assert [(m.context_start, len(m.offsets)) for m in meta] == [(3, 4)] * 4  # windows at 0, 2, 4, 6
    positions = [(f["start_positions"], f["end_positions"]) for f in inputs]
    # window 1 (tokens 2-5) holds zeta but not eta: the answer crosses its end, so it points at [CLS];
    # window 2 (tokens 4-7) holds both at window positions 1, 2 -> input positions 4, 5
    assert positions == [(0, 0), (0, 0), (4, 5), (0, 0)]
    assert inputs[2]["input_ids"][4:6] == [packer.tokenizer.token_to_id("zeta"), packer.tokenizer.token_to_id("eta")]
    assert inputs[2]["token_type_ids"] == [0, 0, 0, 1, 1, 1, 1, 1]
    impossible, _ = task.features([example(None, impossible=True)])
    assert all((f["start_positions"], f["end_positions"]) == (0, 0) for f in impossible)


def logits_for(meta, spans, null=-10.0):
    """[S, 2] logits per window: start/end logit `score` at the given window token positions."""
    rows = []
    for window_index, window in enumerate(meta):
        row = np.full((window.context_start + len(window.offsets) + 1, 2), -5.0, dtype=np.float32)
        row[0] = null
        for w, start, end, score in spans:
            if w == window_index:
                row[window.context_start + start, 0] = score
                row[window.context_start + end, 1] = score
        rows.append(row)
    return rows


def test_span_extraction_uses_max_context_window(packer):
    task = QuestionAnsweringTask(packer, doc_stride=2, max_query_length=4, version_2=False)
    examples = [example(["zeta", "eta"])]
    _, meta = task.features(examples)
    # window 2 proposes "zeta eta" (tokens 5-6, positions 1-2) with score 2 * 5;
    # window 3 proposes "eta theta" (tokens 6-7, positions 0-1) with score 2 * 9, but token 6 has more
    # context in window 2, so window 3 may not start a span there
    logits = logits_for(meta, [(2, 1, 2, 5.0), (3, 0, 1, 9.0)])
    assert task.predict(examples, meta, logits) == ["zeta eta"]
    # the same span starting where it has the most context (window 2, position 2) wins
    logits = logits_for(meta, [(2, 1, 2, 5.0), (2, 2, 3, 9.0)])
    assert task.predict(examples, meta, logits) == ["eta theta"]


def test_span_rules_and_null_answer(packer):
    examples = [example(["zeta"])]
    task = QuestionAnsweringTask(packer, doc_stride=2, max_query_length=4, max_answer_length=1, version_2=True)
    _, meta = task.features(examples)
    # a two-token span is longer than max_answer_length: the best one-token span is taken instead
    logits = logits_for(meta, [(2, 1, 2, 9.0), (2, 1, 1, 4.0)])
    assert task.predict(examples, meta, logits) == ["zeta"]
    # v2.0: a null score above the best span's predicts ""; v1.1 never does
    logits = logits_for(meta, [(2, 1, 1, 4.0)], null=5.0)
    assert task.predict(examples, meta, logits) == [""]
    task.version_2 = False
    assert task.predict(examples, meta, logits) == ["zeta"]
    task.version_2, task.null_score_diff_threshold = True, 3.0  # 10 - 8 <= 3: the span stands
    assert task.predict(examples, meta, logits) == ["zeta"]


def test_answer_text_comes_from_the_original_context(packer):
    context = "Alpha, BETA! gamma"
    examples = [QAExample("q", "where", context, [("BETA!", 7)])]
    task = QuestionAnsweringTask(packer, doc_stride=2, max_query_length=4, version_2=False)
    inputs, meta = task.features(examples)
    assert [(f["start_positions"], f["end_positions"]) for f in inputs][0] == (5, 6)  # beta ! in window 0
    logits = logits_for(meta[:1], [(0, 2, 3, 5.0)])
    assert task.predict(examples, meta[:1], logits) == ["BETA!"]
    assert task.score(examples, ["beta"]) == {"exact_match": 100.0, "f1": 100.0}


def test_query_room_is_checked(packer):
    with pytest.raises(ValueError, match="leaves no room for the context"):
        QuestionAnsweringTask(packer, max_query_length=5)


@pytest.mark.parametrize("threshold", [float("nan"), float("inf"), float("-inf")])
def test_a_null_score_threshold_must_be_finite(packer, threshold):
    """--null-score-diff-threshold nan was taken: null - best > nan is never true, so a v2.0 model never answered
    "no answer" (inf means the same, -inf always no answer)."""
    with pytest.raises(ValueError, match=f"--null-score-diff-threshold must be a finite number, got {threshold}"):
        QuestionAnsweringTask(packer, null_score_diff_threshold=threshold)
