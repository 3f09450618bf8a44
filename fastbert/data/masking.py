"""Masked-LM masking as the paper, applied when a batch is built (a new mask every epoch).

Of each sequence's candidate tokens (every real token except [CLS], [SEP] and [PAD]), k =
max(1, round(mask_prob * candidates)) are chosen, as in Google's create_pretraining_data.py (an
exact count rather than a coin per token); each chosen token is replaced by [MASK] with
probability 0.8, by a token drawn uniformly from the vocabulary with probability 0.1, and left
unchanged with probability 0.1; its label is the original token, every other label -100.

Whole-word masking chooses whole words (a token and the "##" pieces that follow it) in random
order while the count stays within k; the first word is always taken, so a sequence whose first
drawn word is longer than k gets that one word.

Randomness: every example has its own torch.Generator stream, seeded from (seed, epoch, example
index) by the loader. The mask of an example therefore depends neither on the batch it lands in nor
on the rank that reads it: a run on N GPUs sees the masks of a run on 1 GPU, and a resumed run the
masks of the uninterrupted one, with no generator state to carry.
"""
from __future__ import annotations

import numpy as np
import torch

IGNORE_INDEX = -100
MASK_FRACTION, RANDOM_FRACTION = 0.8, 0.1  # of the chosen tokens; the remaining 0.1 stay unchanged


def example_seed(*keys: int) -> int:
    """A 63-bit seed mixing integer keys (splitmix64's finaliser over a running combination)."""
    h = 0x9E3779B97F4A7C15
    for key in keys:
        h = (h ^ (int(key) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h >> 1


class MaskingCollator:
    """Pads examples into a batch and masks it.

    vocabulary: tokens in id order (for the special ids and, with whole_word, the "##" pieces).
    __call__(examples, seeds): examples are (tokens int64 [L], a_length, next_sentence_label),
    seeds one int per example. Returns a dict of CPU tensors: input_ids, token_type_ids,
    attention_mask, labels (int64 [B, S]) and next_sentence_label (int64 [B]), with S the longest
    example rounded up to a multiple of pad_to_multiple_of.
    """

    def __init__(self, vocabulary: list[str], mask_prob: float = 0.15, whole_word: bool = False,
                 pad_to_multiple_of: int = 8):
        if not 0.0 < mask_prob < 1.0:
            raise ValueError(f"mask_prob must be in (0, 1), got {mask_prob!r}")
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of!r}")
        ids = {token: i for i, token in enumerate(vocabulary)}
        missing = [t for t in ("[PAD]", "[CLS]", "[SEP]", "[MASK]") if t not in ids]
        if missing:
            raise ValueError(f"the vocabulary lacks the special tokens {missing}")
        self.vocab_size = len(vocabulary)
        self.pad_id, self.cls_id, self.sep_id, self.mask_id = (ids[t] for t in ("[PAD]", "[CLS]", "[SEP]", "[MASK]"))
        self.mask_prob = mask_prob
        self.whole_word = whole_word
        self.pad_to_multiple_of = pad_to_multiple_of
        self.continuation = torch.tensor([t.startswith("##") for t in vocabulary])  # [V] bool
        self._generator = torch.Generator()

    def __call__(self, examples: list[tuple[np.ndarray, int, int]], seeds: list[int]) -> dict[str, torch.Tensor]:
        lengths = [len(tokens) for tokens, _, _ in examples]
        multiple = self.pad_to_multiple_of
        batch, seqlen = len(examples), -(-max(lengths) // multiple) * multiple
        input_ids = torch.full((batch, seqlen), self.pad_id, dtype=torch.int64)
        token_type_ids = torch.zeros(batch, seqlen, dtype=torch.int64)
        uniforms = torch.ones(batch, 2, seqlen)  # [B, {choice order, replacement}, S]
        random_tokens = torch.zeros(batch, seqlen, dtype=torch.int64)
        for row, ((tokens, a_length, _), seed) in enumerate(zip(examples, seeds)):
            length = len(tokens)
            input_ids[row, :length] = torch.from_numpy(tokens)
            token_type_ids[row, a_length:length] = 1
            self._generator.manual_seed(seed)
            uniforms[row, :, :length] = torch.rand(2, length, generator=self._generator)
            random_tokens[row, :length] = torch.randint(self.vocab_size, (length,), generator=self._generator)
        attention_mask = (torch.arange(seqlen)[None, :] < torch.tensor(lengths)[:, None]).to(torch.int64)
        chosen = self.choose(input_ids, attention_mask.bool(), uniforms[:, 0])
        labels = torch.where(chosen, input_ids, IGNORE_INDEX)
        replacement = uniforms[:, 1]
        masked_ids = torch.where(chosen & (replacement < MASK_FRACTION), self.mask_id, input_ids)
        masked_ids = torch.where(chosen & (replacement >= MASK_FRACTION)
                                 & (replacement < MASK_FRACTION + RANDOM_FRACTION), random_tokens, masked_ids)
        return {"input_ids": masked_ids, "token_type_ids": token_type_ids, "attention_mask": attention_mask,
                "labels": labels,
                "next_sentence_label": torch.tensor([label for _, _, label in examples], dtype=torch.int64)}

    def choose(self, input_ids: torch.Tensor, real: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """Which tokens to predict: bool [B, S]. order [B, S]: uniforms ranking the words."""
        candidate = real & (input_ids != self.cls_id) & (input_ids != self.sep_id) & (input_ids != self.pad_id)
        word_start = candidate
        if self.whole_word:  # a "##" piece continues the word unless the token before it is no candidate
            previous = torch.nn.functional.pad(candidate[:, :-1], (1, 0), value=False)
            word_start = candidate & ~(self.continuation[input_ids] & previous)
        word = torch.cumsum(word_start, dim=1) - 1  # [B, S]: word number of each token
        word = torch.where(candidate, word, input_ids.shape[1])  # non-candidates go to a spare slot
        slots = input_ids.shape[1] + 1
        word_length = torch.zeros(input_ids.shape[0], slots, dtype=torch.int64).scatter_add_(
            1, word, candidate.to(torch.int64))  # [B, words]
        # only word starts write an order: unused slots and the spare one keep 2.0 and rank last
        word_order = torch.full((input_ids.shape[0], slots), 2.0).scatter_(
            1, torch.where(word_start, word, slots - 1), torch.where(word_start, order, 2.0))
        ranked = torch.argsort(word_order, dim=1, stable=True)  # words in random order, then unused slots
        ranked_length = torch.gather(word_length, 1, ranked)  # [B, words]
        taken = torch.cumsum(ranked_length, dim=1)  # tokens masked after each word
        budget = torch.clamp(torch.round(candidate.sum(1) * self.mask_prob), min=1)[:, None]  # k per row
        selected_ranked = (taken <= budget) & (ranked_length > 0)
        selected_ranked[:, 0] |= ranked_length[:, 0] > 0
        selected = torch.zeros_like(selected_ranked).scatter_(1, ranked, selected_ranked)  # [B, words]
        return torch.gather(selected, 1, word) & candidate
