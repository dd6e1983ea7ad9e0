"""Tiny custom model factories, importable as ``factory = "tests.support.factories:NAME"``: one that keeps
the contract (model/external.py) and one for each way of breaking it (tests/unit/test_model_contract.py)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class Bigram(nn.Module):
    """Keeps the contract: logits (batch, block, out), mean cross-entropy, None without targets."""

    def __init__(self, vocab: int, out: int | None = None):
        super().__init__()
        self.emb = nn.Embedding(vocab, out or vocab)

    def logits(self, idx: Tensor) -> Tensor:
        return self.emb(idx)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        logits = self.logits(idx)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class LogitsOnly(Bigram):
    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:  # type: ignore[override]
        return self.logits(idx)


class FlatLogits(Bigram):
    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        logits, loss = super().forward(idx, targets)
        return logits.reshape(-1, logits.shape[-1]), loss


class AlwaysLoss(Bigram):
    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        logits, loss = super().forward(idx, targets)
        return logits, loss if loss is not None else torch.zeros(())


class NanLoss(Bigram):
    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        logits, loss = super().forward(idx, targets)
        return logits, None if loss is None else loss * float("nan")


def good(vocab: int = 256, out: int | None = None) -> nn.Module:
    """`out`: the logits' width when it differs from the embedding's vocabulary."""
    return Bigram(vocab, out)


def needs_vocab(vocab: int) -> nn.Module:
    return Bigram(vocab)


def logits_only(vocab: int = 256) -> nn.Module:
    return LogitsOnly(vocab)


def flat_logits(vocab: int = 256) -> nn.Module:
    return FlatLogits(vocab)


def always_loss(vocab: int = 256) -> nn.Module:
    return AlwaysLoss(vocab)


def nan_loss(vocab: int = 256) -> nn.Module:
    return NanLoss(vocab)
