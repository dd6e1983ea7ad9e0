"""Fixtures every sim module shares: the demo manifest at sim scale, its corpus, one torch thread."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2p_diloco.config import ModelConfig, RunManifest
from p2p_diloco.model.data import load_corpus


@pytest.fixture(scope="module")
def manifest() -> RunManifest:
    """peers/demo.toml with a smaller model, H = 8 and batch 8 for 1 s fake steps (the demo manifest is
    tuned for real processes). Modules override this fixture to change more."""
    base = RunManifest.load("peers/demo.toml")
    return dataclasses.replace(
        base,
        model=ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32),
        diloco=dataclasses.replace(base.diloco, inner_steps=8, batch_size=8),
    )


@pytest.fixture(scope="module")
def corpus(manifest):
    return load_corpus(manifest.data)


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)
