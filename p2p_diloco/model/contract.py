"""The custom factory's forward contract, probed once before a peer joins (and by ``model-digest``).

Owns `check_model_contract`: two forward passes (without and with targets) of a ``kind = "custom"``
model on a tiny batch, on the model's device under `torch.no_grad()` in eval mode (no backward, the
global RNGs left alone), in `node.assembly.prepare_training` before the peer announces itself to the
swarm. A model that breaks the contract (model/external.py's docstring) is refused with a `ConfigError`
that says what is wrong and how to fix it, instead of a traceback mid-join:

* ``forward(idx, targets)`` raises, or raises only on the data's highest token id (a vocabulary smaller
  than the tokenizer's);
* it returns something other than the pair ``(logits, loss)`` (e.g. the logits alone);
* logits are not floating point of shape (batch, block_size, vocab), or `vocab` is smaller than the data's
  vocabulary (`model.shards.check_vocab`);
* the loss is not one finite number, or is not None when `targets` is None.

Also owns `data_vocab_size`, the data's vocabulary read without loading it (for ``model-digest``). The
built-in GPT and transformers models keep their own checks (`check_vocab`): they are not probed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from p2p_diloco.config import DataConfig, DataSource, ModelKind, RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.model.shards import check_vocab, open_run_shards

CONTRACT = "contract: forward(idx, targets) -> (logits, loss), in p2p_diloco/model/external.py"


def data_vocab_size(cfg: DataConfig) -> int:
    """The number of token ids of the run's data: 256 for text read as bytes, the tokenizer's for shards
    (from their index, checked against the manifest's digest; the shard files are not hashed)."""
    if cfg.source == DataSource.SHARDS:
        return open_run_shards(cfg, check_files=False).vocab_size
    return 256


def _forward(model: nn.Module, factory: str, idx: Tensor, targets: Tensor | None, vocab: int | None) -> Any:
    """`model(idx, targets)`; an exception becomes a `ConfigError` (a vocabulary one if only the data's
    highest token id makes it fail)."""
    try:
        return model(idx, targets)
    except Exception as exc:  # whatever the factory's module raises
        failure, exception = f"{type(exc).__name__}: {exc}", exc
    if vocab is not None and vocab > 1:
        try:
            model(torch.zeros_like(idx), None if targets is None else torch.zeros_like(targets))
        except Exception:  # it fails on any ids: reported below
            pass
        else:
            raise ConfigError(
                f"model.factory {factory!r}: forward fails on token id {vocab - 1} ({failure}), so the model "
                f"embeds fewer tokens than the data's tokenizer has ({vocab}): make the factory build a "
                "vocabulary of at least that size ([model.config]) "
                "or prepare the data with a smaller tokenizer"
            ) from exception
    raise ConfigError(
        f"model.factory {factory!r}: forward(idx, targets) on int64 ids of shape {tuple(idx.shape)} raised "
        f"{failure}; fix the model to follow the {CONTRACT}"
    ) from exception


def _pair(out: Any, factory: str, targets: str) -> tuple[Any, Any]:
    if not isinstance(out, tuple | list) or len(out) != 2:
        what = f"a {type(out).__name__}" if not isinstance(out, tuple | list) else f"{len(out)} values"
        raise ConfigError(
            f"model.factory {factory!r}: forward(idx, {targets}) returned {what}, "
            "not the pair (logits, loss): return `logits, loss` (loss None when targets is None)"
        )
    return out[0], out[1]


def _check_logits(logits: Any, factory: str, block_size: int) -> int:
    """The width of `logits` (the model's vocabulary), or `ConfigError` if they are not (1, block_size, V)."""
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        kind = f"a {logits.dtype} tensor" if isinstance(logits, Tensor) else f"a {type(logits).__name__}"
        raise ConfigError(
            f"model.factory {factory!r}: forward's logits are {kind}, not a floating point tensor; {CONTRACT}"
        )
    if logits.ndim != 3 or tuple(logits.shape[:2]) != (1, block_size):
        raise ConfigError(
            f"model.factory {factory!r}: forward's logits have shape {tuple(logits.shape)} for ids of shape "
            f"(1, {block_size}); return them as (batch, block_size, vocab) (reshape before returning: the "
            "loss may flatten them, the logits may not)"
        )
    return int(logits.shape[-1])


def _check_loss(loss: Any, factory: str) -> None:
    if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else repr(loss)
        raise ConfigError(
            f"model.factory {factory!r}: forward(idx, targets) returned the loss {what}, not one number: "
            "return the mean cross-entropy of the logits against targets"
        )
    if not torch.isfinite(loss).all():
        raise ConfigError(
            f"model.factory {factory!r}: forward(idx, targets) returned the loss {float(loss)} on freshly "
            "built weights: check the model's initialization and its loss"
        )


def check_model_contract(manifest: RunManifest, model: nn.Module, data_vocab: int | None) -> None:
    """Probe a custom model (others return at once): one forward without targets and one with, on a batch
    of one window of `model.block_size` ids ending with `data_vocab - 1` (zeros when `data_vocab` is
    None: then the vocabulary is not compared)."""
    cfg = manifest.model
    if cfg.kind != ModelKind.CUSTOM:
        return
    factory, block = cfg.factory, cfg.block_size
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    idx = torch.zeros((1, block), dtype=torch.int64, device=device)
    if data_vocab is not None:
        idx[0, -1] = data_vocab - 1
    targets = idx.roll(-1, dims=1)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            logits, no_loss = _pair(_forward(model, factory, idx, None, data_vocab), factory, "None")
            width = _check_logits(logits, factory, block)
            if data_vocab is not None:  # before the loss: targets past the logits' width fail inside it
                check_vocab(manifest, data_vocab, model_vocab=width)
            _, loss = _pair(_forward(model, factory, idx, targets, data_vocab), factory, "targets")
            _check_loss(loss, factory)
    finally:
        model.train(was_training)
    if no_loss is not None:
        raise ConfigError(
            f"model.factory {factory!r}: forward(idx, None) returned a loss ({type(no_loss).__name__}), not "
            "None: return `logits, None` when targets is None (evaluation and generation pass no targets)"
        )
