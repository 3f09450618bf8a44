"""Masked-LM masking as the paper, applied when a batch is built (a new mask every epoch).

Of each sequence's candidate tokens (every real token except [CLS], [SEP] and [PAD]), k =
max(1, round(mask_prob * candidates)) are chosen, as in Google's create_pretraining_data.py (an
exact count rather than a coin per token); each chosen token is replaced by [MASK] with
probability 0.8, by a token drawn uniformly from the vocabulary with probability 0.1, and left
unchanged with probability 0.1; its label is the original token, every other label -100.

Whole-word masking chooses whole words (a token and the "##" pieces that follow it) in random
order while the count stays within k; the first word is always taken, so a sequence whose first
drawn word is longer than k gets that one word.

Randomness is counter-based: the draw of position s of an example is the s-th output of a
splitmix64 stream seeded with the example's key, a hash of (seed, phase, epoch, example index) made
by the loader. The mask of an example therefore depends neither on the batch it lands in nor on the
rank that reads it (a run on N GPUs sees the masks of a run on 1 GPU, and a resumed run the masks
of the uninterrupted one, with no generator state to carry), and the whole batch is drawn at once
with numpy: no per-example loop, and no torch op whose threads could oversubscribe the CPU.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

IGNORE_INDEX = -100
MASK_FRACTION, RANDOM_FRACTION = 0.8, 0.1  # of the chosen tokens; the remaining 0.1 stay unchanged

GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's stream increment
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
# the low 16 bits of a position's draw pick its replacement: [MASK] below the first threshold,
# a random token below the second, unchanged above
_REPLACE_BITS = 16
_MASK_BELOW = round(MASK_FRACTION * 2 ** _REPLACE_BITS)
_RANDOM_BELOW = round((MASK_FRACTION + RANDOM_FRACTION) * 2 ** _REPLACE_BITS)
_RANDOM_TOKEN_STREAM = np.uint64(0x5851F42D4C957F2D)  # separates a random token's draw from its position's


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 whose every output bit depends on every input bit."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def hash_keys(*keys) -> np.ndarray:
    """uint64 [N]: the keys (integers or integer arrays, broadcast together) mixed into one 64-bit hash each.

    Keys are mixed in one after the other: hash_keys(a, b, c) == mix_in(hash_keys(a, b), c).
    """
    h = np.full(np.broadcast(*(np.asarray(k) for k in keys)).shape or (1,), GOLDEN_GAMMA, dtype=np.uint64)
    for key in keys:
        h = mix_in(h, key)
    return h.reshape(-1)


def mix_in(h, key) -> np.ndarray:
    """The hash h (uint64 [N] or an integer) extended by key (an integer array, or an integer with h an array)."""
    return mix64(np.asarray(h, dtype=np.uint64) ^ np.asarray(key).astype(np.uint64))


def stream_draws(keys: np.ndarray, count: int) -> np.ndarray:
    """uint64 [N, count]: outputs 1..count of the splitmix64 stream of each key (keys uint64 [N])."""
    steps = (np.arange(1, count + 1, dtype=np.uint64) * GOLDEN_GAMMA)[None, :]
    return mix64(keys[:, None] + steps)


class ExampleBatch(NamedTuple):
    """Examples laid out as a padded batch (numpy, host memory)."""
    tokens: np.ndarray  # int64 [B, S]: [CLS] A [SEP] B [SEP], then padding
    lengths: np.ndarray  # int64 [B]: real tokens of each row
    a_lengths: np.ndarray  # int64 [B]: tokens of [CLS] A [SEP] (token type 0 below, 1 from there on)
    next_sentence_labels: np.ndarray  # int64 [B]


class MaskingCollator:
    """Masks a batch of examples.

    vocabulary: tokens in id order (for the special ids and, with whole_word, the "##" pieces).
    __call__(batch, keys): batch an ExampleBatch, keys uint64 [B] (one per example, see hash_keys).
    Returns a dict of int64 numpy arrays: input_ids, attention_mask, labels [B, S] and, with next_sentence
    (the mlm+nsp objective), token_type_ids [B, S] and next_sentence_label [B] (the model's arguments;
    torch.from_numpy shares their memory). Without next_sentence (mlm) an example is one segment: the
    model's default token type 0, and models without token types (DistilBERT, MPNet) take the batch as is.
    """

    def __init__(self, vocabulary: list[str], mask_prob: float = 0.15, whole_word: bool = False,
                 next_sentence: bool = True):
        if not 0.0 < mask_prob < 1.0:
            raise ValueError(f"mask_prob must be in (0, 1), got {mask_prob!r}")
        ids = {token: i for i, token in enumerate(vocabulary)}
        missing = [t for t in ("[PAD]", "[CLS]", "[SEP]", "[MASK]") if t not in ids]
        if missing:
            raise ValueError(f"the vocabulary lacks the special tokens {missing}")
        self.vocab_size = len(vocabulary)
        self.pad_id, self.cls_id, self.sep_id, self.mask_id = (ids[t] for t in ("[PAD]", "[CLS]", "[SEP]", "[MASK]"))
        self.mask_prob = mask_prob
        self.whole_word = whole_word
        self.next_sentence = next_sentence
        self.continuation = np.array([t.startswith("##") for t in vocabulary])  # [V] bool

    def __call__(self, batch: ExampleBatch, keys: np.ndarray) -> dict[str, np.ndarray]:
        tokens = batch.tokens
        positions = np.arange(tokens.shape[1])
        real = positions < batch.lengths[:, None]  # [B, S]
        draws = stream_draws(keys, tokens.shape[1])  # [B, S]: one 64-bit draw per position
        # the high 48 bits rank the tokens (the position in the low bits makes every rank distinct);
        # the low 16 bits of a chosen token pick its replacement
        order = (draws & ~np.uint64(2 ** _REPLACE_BITS - 1)) | positions.astype(np.uint64)
        chosen = np.flatnonzero(self.choose(tokens, real, order))  # into [B * S]
        chosen_draws = draws.reshape(-1)[chosen]
        replacement = chosen_draws & np.uint64(2 ** _REPLACE_BITS - 1)
        to_random = (replacement >= _MASK_BELOW) & (replacement < _RANDOM_BELOW)
        # a token uniform in [0, V): the high 32 bits of a second draw times V, over 2^32
        second = mix64(chosen_draws[to_random] ^ _RANDOM_TOKEN_STREAM) >> np.uint64(32)
        input_ids = tokens.copy()
        input_ids.reshape(-1)[chosen[replacement < _MASK_BELOW]] = self.mask_id
        input_ids.reshape(-1)[chosen[to_random]] = (second * np.uint64(self.vocab_size)) >> np.uint64(32)
        labels = np.full_like(tokens, IGNORE_INDEX)
        labels.reshape(-1)[chosen] = tokens.reshape(-1)[chosen]
        arrays = {"input_ids": input_ids, "attention_mask": real.astype(np.int64), "labels": labels}
        if self.next_sentence:
            token_type_ids = real & (positions >= batch.a_lengths[:, None])
            arrays.update(token_type_ids=token_type_ids.astype(np.int64),
                          next_sentence_label=batch.next_sentence_labels.astype(np.int64))
        return arrays

    def choose(self, tokens: np.ndarray, real: np.ndarray, order: np.ndarray) -> np.ndarray:
        """Which tokens to predict: bool [B, S]. order uint64 [B, S]: distinct within a row, ranks the words.

        The words (with whole-word masking) or the candidate tokens (without) are ranked by order (a
        word by its first token's) and taken in that order while the count stays within the budget.
        """
        batch, seqlen = tokens.shape
        candidate = real & (tokens != self.cls_id) & (tokens != self.sep_id) & (tokens != self.pad_id)
        candidates = candidate.sum(axis=1)  # [B]
        last = np.iinfo(np.uint64).max  # the order of what is no word: ranks after every word
        if self.whole_word:  # a "##" piece continues the word unless the token before it is no candidate
            previous = np.zeros_like(candidate)
            previous[:, 1:] = candidate[:, :-1]
            word_start = candidate & ~(self.continuation[tokens] & previous)
            slots = seqlen + 1  # word numbers 0..S-1, and a spare slot S for the non-candidates
            word = np.where(candidate, np.cumsum(word_start, axis=1) - 1, seqlen)  # [B, S]
            flat_word = word + (np.arange(batch) * slots)[:, None]  # [B, S]: into [B * slots]
            length = np.bincount(flat_word[candidate], minlength=batch * slots).reshape(batch, slots)
            word_order = np.full((batch, slots), last, dtype=np.uint64)
            word_order.reshape(-1)[flat_word[word_start]] = order[word_start]
        else:  # every candidate token is a word of one token, at its own position
            length, word_order = candidate, np.where(candidate, order, last)
        budget = np.maximum(np.round(candidates * self.mask_prob), 1).astype(np.int64)[:, None]  # k per row
        # a row takes at most k words (each has a token or more): rank only the `most` first words
        most = int(budget.max())
        first = np.argpartition(word_order, most - 1, axis=1)[:, :most]  # [B, most], in no order
        ranked = np.take_along_axis(first, np.argsort(np.take_along_axis(word_order, first, axis=1), axis=1), axis=1)
        ranked_length = np.take_along_axis(length, ranked, axis=1).astype(np.int64)
        taken = np.cumsum(ranked_length, axis=1)  # tokens masked after each word
        selected_ranked = (taken <= budget) & (ranked_length > 0)
        selected_ranked[:, 0] |= ranked_length[:, 0] > 0
        selected = np.zeros(word_order.shape, dtype=bool)
        np.put_along_axis(selected, ranked, selected_ranked, axis=1)
        return selected.reshape(-1)[flat_word] & candidate if self.whole_word else selected
