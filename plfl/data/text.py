"""Text to token ids with Hugging Face ``tokenizers``: a word vocabulary, padded id sequences.

The tokenizer is a word-level one (``WordLevel``): text is lowercased and split
into runs of word characters and single runs of punctuation (the ``Whitespace``
pre-tokenizer, ``\\w+|[^\\w\\s]+``), which is close to torchtext's
``basic_english`` that FedALA and PFLlib tokenise AG News with. A word model
rather than WordPiece keeps that reference's inputs: one id per word, rare
words mapped to the unknown id.

Ids: 0 = ``[PAD]`` (padding), 1 = ``[UNK]`` (a word outside the vocabulary),
then the words by decreasing count in the training texts, ties in string
order, so the same texts always give the same vocabulary.
"""

from __future__ import annotations

from typing import Iterable

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

PAD_ID, UNK_ID = 0, 1
_SPECIAL_TOKENS = ["[PAD]", "[UNK]"]  # in id order


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A word-level tokenizer whose vocabulary holds at most ``vocab_size`` ids (the two special ids included),
    the most frequent words of ``texts``. Pass training texts only: a word seen only in test texts must stay
    unknown.

    Raises:
        ValueError: ``vocab_size`` < 3 (no room for a word beside padding and unknown).
    """
    if vocab_size < len(_SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size={vocab_size} leaves no id for a word; use at least 3.")
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=_SPECIAL_TOKENS, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def encode(tokenizer: Tokenizer, texts: Iterable[str], max_length: int) -> torch.Tensor:
    """Token ids of ``texts``: int64 ``(n, max_length)``, each text's first ``max_length`` words, then
    :data:`PAD_ID` to the end (a text without words is all padding). Sets ``tokenizer``'s truncation and
    padding to that length."""
    tokenizer.enable_truncation(max_length)
    tokenizer.enable_padding(pad_id=PAD_ID, pad_token="[PAD]", length=max_length)
    ids = [e.ids for e in tokenizer.encode_batch(list(texts))]
    return torch.tensor(ids, dtype=torch.int64).reshape(len(ids), max_length)
