"""Fine-tuning metrics against values computed by hand (the arithmetic is in the comments)."""
import pytest

from fastbert.finetune import metrics


def test_accuracy_f1_matthews_binary():
    predictions, labels = [1, 0, 1, 1], [1, 1, 1, 0]
    assert metrics.accuracy(predictions, labels) == 0.5
    # TP 2, FP 1, FN 1: 2*2 / (2*2 + 1 + 1)
    assert metrics.f1(predictions, labels, 2) == pytest.approx(2 / 3)
    # TP 2, TN 0, FP 1, FN 1: (2*0 - 1*1) / sqrt(3 * 3 * 1 * 1)
    assert metrics.matthews_corrcoef(predictions, labels, 2) == pytest.approx(-1 / 3)
    # positive class 0: TP 0 -> F1 0
    assert metrics.f1(predictions, labels, 2, positive=0) == 0.0


def test_macro_f1_and_multiclass_matthews():
    predictions, labels = [0, 1, 2, 2, 1, 0], [0, 1, 1, 2, 2, 0]
    # class 0: F1 1; class 1: TP 1 FP 1 FN 1 -> 1/2; class 2: the same -> 1/2
    assert metrics.f1(predictions, labels, 3) == pytest.approx(2 / 3)
    # confusion [[2,0,0],[0,1,1],[0,1,1]]: t = p = (2,2,2), c = 4, s = 6 -> (24 - 12) / sqrt(24 * 24)
    assert metrics.matthews_corrcoef(predictions, labels, 3) == pytest.approx(0.5)
    assert metrics.matthews_corrcoef([1, 1, 1], [0, 1, 1], 2) == 0.0  # one predicted class: undefined -> 0


def test_pearson_spearman():
    # dx = (-1.5, -.5, .5, 1.5), dy = (-3, -1, 0, 4): 11 / sqrt(5 * 26)
    assert metrics.pearson([1, 2, 3, 4], [2, 4, 5, 9]) == pytest.approx(11 / 130 ** 0.5)
    # ranks (1, 2.5, 2.5, 4) and (1, 2, 3, 4): 4.5 / sqrt(4.5 * 5)
    assert metrics.spearman([1, 2, 2, 3], [10, 20, 30, 40]) == pytest.approx(4.5 / 22.5 ** 0.5)
    assert metrics.spearman([1, 5, 2], [3, 100, 4]) == pytest.approx(1.0)  # monotone, not linear
    assert metrics.pearson([1, 1, 1], [1, 2, 3]) == 0.0


def test_squad_exact_and_f1():
    assert metrics.normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert metrics.squad_exact("the Eiffel Tower", "Eiffel Tower.") == 1.0
    # tokens (in, paris, france) vs (paris): P 1/3, R 1 -> 2 * 1/3 / (4/3)
    assert metrics.squad_f1("in Paris France", "Paris") == pytest.approx(0.5)
    assert metrics.squad_f1("", "") == 1.0 and metrics.squad_f1("", "Paris") == 0.0
    # each question takes its best gold answer; the second has none ([""]) and is answered
    scores = metrics.squad_scores(["Paris France", "London"], [["Rome", "Paris"], [""]])
    assert scores["exact_match"] == pytest.approx(0.0)
    assert scores["f1"] == pytest.approx(100 * (2 / 3 + 0) / 2)  # P 1/2, R 1 -> 2/3


@pytest.mark.parametrize("tags, chunks", [
    (["B-PER", "I-PER", "O", "B-LOC"], {(0, 1, "PER"), (3, 3, "LOC")}),
    (["B-PER", "B-PER", "I-PER"], {(0, 0, "PER"), (1, 2, "PER")}),
    (["I-PER", "I-PER", "I-LOC", "O", "I-LOC"], {(0, 1, "PER"), (2, 2, "LOC"), (4, 4, "LOC")}),  # IOB1
    (["S-PER", "B-LOC", "E-LOC", "S-LOC"], {(0, 0, "PER"), (1, 2, "LOC"), (3, 3, "LOC")}),  # BIOES
    (["O", "O"], set()),
])
def test_entity_chunks(tags, chunks):
    assert metrics.entities(tags) == chunks


def test_entity_scores():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG"]]
    predicted = [["B-PER", "O", "O", "B-LOC"], ["B-ORG"]]
    # gold {PER 0-1, LOC 3, ORG}, predicted {PER 0, LOC 3, ORG}: 2 right of 3 each way
    scores = metrics.entity_scores(predicted, gold)
    assert scores["precision"] == pytest.approx(200 / 3) and scores["recall"] == pytest.approx(200 / 3)
    assert scores["f1"] == pytest.approx(200 / 3)
    assert scores["accuracy"] == pytest.approx(100 * 4 / 5)
    assert metrics.entity_scores([["O"]], [["B-PER"]])["f1"] == 0.0


def test_squad_drops_gold_answers_that_normalise_to_nothing_as_the_official_script():
    """evaluate-v2.0.py keeps the gold answers that normalise to something, and scores a question left with none
    against no answer: golds ["the", "cat"] are ["cat"] (an empty prediction scored 100 against "the"), and ["The"]
    is no answer (which "a" matches)."""
    assert metrics.squad_scores([""], [["the", "cat"]]) == {"exact_match": 0.0, "f1": 0.0}
    assert metrics.squad_scores(["a"], [["The"]]) == {"exact_match": 100.0, "f1": 100.0}
    assert metrics.squad_scores(["the cat"], [["the", "cat"]]) == {"exact_match": 100.0, "f1": 100.0}
