"""The evaluator's model borrows the replica's tensors for one evaluation and keeps none (issue #14)."""

from __future__ import annotations

import torch

from p2p_diloco.config import ModelConfig
from p2p_diloco.model.data import evaluate
from p2p_diloco.model.gpt import GPT
from p2p_diloco.node.evaluation import BorrowedWeights

CONFIG = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8)


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x) * self.scale)


def _replica(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=gen) * 0.1 for n, p in model.named_parameters()}


def test_bound_model_uses_the_replica_tensors_without_copying_and_keeps_none_after():
    borrowed = BorrowedWeights(GPT(CONFIG))
    assert all(p.is_meta for p in borrowed.model.parameters())  # nothing held before the first evaluation
    params = _replica(GPT(CONFIG), seed=1)
    with borrowed.bound(params) as model:
        for name, p in model.named_parameters():
            assert p.data_ptr() == params[name].data_ptr()
    assert all(p.is_meta for p in borrowed.model.parameters())


def test_bound_model_evaluates_like_a_model_loaded_by_copy():
    params = _replica(GPT(CONFIG), seed=2)
    copied = GPT(CONFIG)
    copied.load_state_dict(params)
    data = torch.randint(0, 256, (400,), dtype=torch.uint8)
    expected = evaluate(copied, data, block_size=CONFIG.block_size, batch_size=4, max_batches=2)
    borrowed = BorrowedWeights(GPT(CONFIG))
    for _ in range(2):  # bound, released and bound again: same loss
        with borrowed.bound(params) as model:
            loss = evaluate(model, data, block_size=CONFIG.block_size, batch_size=4, max_batches=2)
        assert loss == expected


def test_tied_parameters_are_bound_to_one_tensor_and_buffers_stay():
    borrowed = BorrowedWeights(_Tied())
    params = _replica(_Tied(), seed=3)
    assert list(params) == ["embed.weight"]  # one name for the tied pair
    with borrowed.bound(params) as model:
        assert model.head.weight.data_ptr() == params["embed.weight"].data_ptr()
        assert model.embed.weight.data_ptr() == params["embed.weight"].data_ptr()
        out = model(torch.tensor([1, 2]))
    expected = (params["embed.weight"][[1, 2]] * 2.0) @ params["embed.weight"].T
    assert torch.allclose(out, expected)
    assert not borrowed.model.scale.is_meta
