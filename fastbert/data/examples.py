"""Pretraining examples from tokenised documents, for either objective (OBJECTIVES).

mlm+nsp (BERT's), as BERT's create_pretraining_data.py builds them (document_examples):

Each document (a list of sentences, each a list of token ids) is cut into chunks of whole sentences
of about target_length tokens: max_seq_length - 3, or with probability short_seq_prob a length
drawn in [2, max_seq_length - 3], so that the model also sees short inputs. A chunk is split at a
random sentence boundary into segment A and the rest; with probability 1/2 segment B is that rest
(the actual next text, next_sentence_label 0), otherwise B is a run of sentences from a random
other document (label 1) and the unused rest of the chunk goes back to be used by the next chunk.
The pair is truncated to max_seq_length - 3 by dropping tokens of the longer segment, from the
front or the back at random, and laid out as [CLS] A [SEP] B [SEP] with token types 0 for
[CLS] A [SEP] and 1 for B [SEP].

One change to Google's code: a chunk of a single sentence that must continue with the actual next
text is split inside the sentence (Google draws a random B for every single-sentence chunk), so
that B is the actual next text 50% of the time, as the paper states, rather than less often.

mlm (RoBERTa's FULL-SENTENCES, pack_full_sentences): the documents' sentences read in order and packed
into [CLS] s1 s2 ... [SEP] with no segment B and no NSP label, across document boundaries: a [SEP]
separates the last sentence of a document from the first of the next inside an example.

Masking is not done here: the loader masks anew every epoch (fastbert.data.masking).
"""
from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

IS_NEXT, RANDOM_NEXT = 0, 1  # next_sentence_label, HF's convention
# what the examples are made for: "mlm+nsp" (BERT's, the default) pairs segments for next sentence
# prediction; "mlm" (RoBERTa's finding that NSP is not needed) packs full sentences for the masked LM alone
MLM_NSP, MLM = "mlm+nsp", "mlm"
OBJECTIVES = (MLM_NSP, MLM)


@dataclass
class Example:
    tokens: list[int]  # [CLS] A [SEP] B [SEP] (mlm: [CLS] s1 s2 ... [SEP], a [SEP] between documents)
    a_length: int  # tokens of [CLS] A [SEP]: token type 0 below it, 1 from it on (mlm: every token)
    next_sentence_label: int  # IS_NEXT or RANDOM_NEXT (mlm: IS_NEXT, and never read)


def truncate_pair(a: list[int], b: list[int], max_tokens: int, rng: random.Random) -> None:
    """Drop tokens of the longer segment (B on a tie), from its front or back at random, in place."""
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        del longer[0 if rng.random() < 0.5 else -1]


def _random_segment(documents, document_index: int, target: int, rng: random.Random) -> list[int]:
    """A run of sentences of about `target` tokens from a document other than document_index."""
    other = rng.randrange(len(documents) - 1)
    other += other >= document_index
    document = documents[other]
    tokens: list[int] = []
    for i in range(rng.randrange(len(document)), len(document)):
        tokens += document[i]
        if len(tokens) >= target:
            break
    return tokens


def document_examples(documents: Sequence[Sequence[list[int]]], document_index: int, max_seq_length: int,
                      short_seq_prob: float, cls_id: int, sep_id: int, rng: random.Random) -> list[Example]:
    """Examples from documents[document_index]; the others supply random B segments.

    documents: each a non-empty list of non-empty sentences of token ids; at least 2 documents.
    """
    max_tokens = max_seq_length - 3
    target = rng.randint(2, max_tokens) if rng.random() < short_seq_prob else max_tokens
    document = documents[document_index]
    examples = []
    chunk: list[list[int]] = []
    length = 0
    i = 0
    while i < len(document):
        chunk.append(document[i])
        length += len(document[i])
        if i == len(document) - 1 or length >= target:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            a = [t for sentence in chunk[:a_end] for t in sentence]
            single_sentence = len(chunk) == 1
            if rng.random() < 0.5 or (single_sentence and len(a) < 2):
                label = RANDOM_NEXT
                b = _random_segment(documents, document_index, target - len(a), rng)
                i -= len(chunk) - a_end  # the chunk's unused sentences start the next chunk
            elif single_sentence:
                label = IS_NEXT
                cut = rng.randint(1, len(a) - 1)
                a, b = a[:cut], a[cut:]
            else:
                label = IS_NEXT
                b = [t for sentence in chunk[a_end:] for t in sentence]
            truncate_pair(a, b, max_tokens, rng)
            examples.append(Example([cls_id, *a, sep_id, *b, sep_id], len(a) + 2, label))
            chunk, length = [], 0
        i += 1
    return examples


def iter_examples(documents: Sequence[Sequence[list[int]]], max_seq_length: int, short_seq_prob: float,
                  dupe_factor: int, cls_id: int, sep_id: int, rng: random.Random) -> Iterator[Example]:
    """Examples of every document, dupe_factor times over (each pass cuts the documents differently),
    one at a time. documents[d][s] is the list of token ids of sentence s of document d."""
    if len(documents) < 2:
        raise ValueError(f"next sentence prediction needs at least 2 documents, got {len(documents)}")
    if max_seq_length < 5:
        raise ValueError(f"max_seq_length must be at least 5 ([CLS] A [SEP] B [SEP]), got {max_seq_length}")
    for _ in range(dupe_factor):
        for index in range(len(documents)):
            yield from document_examples(documents, index, max_seq_length, short_seq_prob, cls_id, sep_id, rng)


def create_examples(documents: Sequence[Sequence[list[int]]], max_seq_length: int, short_seq_prob: float,
                    dupe_factor: int, cls_id: int, sep_id: int, rng: random.Random) -> list[Example]:
    """iter_examples' examples as a list."""
    return list(iter_examples(documents, max_seq_length, short_seq_prob, dupe_factor, cls_id, sep_id, rng))


def pack_full_sentences(documents: Iterable[Sequence[list[int]]], max_seq_length: int, cls_id: int,
                        sep_id: int) -> Iterator[Example]:
    """MLM-only examples (RoBERTa's FULL-SENTENCES): the sentences of the documents, in order, packed into
    [CLS] ... [SEP] of at most max_seq_length tokens, with a [SEP] between the last sentence of a document
    and the first of the next when both are in one example.

    An example is closed when the next sentence (with its separator, at a document's start) does not fit,
    so every example but the last holds no room for the sentence that follows it. A sentence longer than
    an example's room (max_seq_length - 2) is cut into pieces of that room, so that no token is dropped.
    Every token has token type 0 (a_length is the example's length); there is no NSP label.
    """
    if max_seq_length < 3:
        raise ValueError(f"max_seq_length must be at least 3 ([CLS] x [SEP]), got {max_seq_length}")
    room = max_seq_length - 2
    body: list[int] = []  # the example being filled, without its [CLS] and final [SEP]

    def close() -> Example:
        tokens = [cls_id, *body, sep_id]
        body.clear()
        return Example(tokens, len(tokens), IS_NEXT)

    for document in documents:
        for number, sentence in enumerate(document):
            # a document's first sentence follows the previous document's text behind a [SEP]
            separated = number == 0 and bool(body)
            if body and len(body) + separated + len(sentence) > room:
                yield close()
                separated = False
            if separated:
                body.append(sep_id)
            # one piece when the example already holds text (the sentence fits, checked above); pieces of the
            # whole room when a sentence longer than that starts an example
            pieces = [sentence[start:start + room] for start in range(0, len(sentence), room)]
            for piece in pieces[:-1]:
                body += piece
                yield close()
            body += pieces[-1]
    if body:
        yield close()
