"""A small nanoGPT-like byte-level GPT (vocab 256), its deterministic construction and its inner optimizer.

Owns: the `GPT` module, `build_model` (identical initial weights on every peer, from `ModelConfig.seed`
through a local generator, never the global RNG), `embedding_parameter_names` (tensors that the
synchronizer merges by plain weighted mean instead of RDA) and `make_inner_optimizer` (AdamW),
`gpt_config_for` (a byte GPT of about a given size, for benchmarks) and `p2p-diloco model-digest`
(`cli_model_digest`: the `weights_digest` of a manifest's initial model, of any kind).

Embeddings are untied: the token embedding and the output head are separate tensors, so each can live
in a different fragment and be merged by its own rule. Parameter names are stable and carry the layer
index as ``blocks.{i}.``:

    tok_emb.weight, pos_emb.weight,
    blocks.{i}.ln1.{weight,bias}, blocks.{i}.attn.qkv.{weight,bias}, blocks.{i}.attn.proj.{weight,bias},
    blocks.{i}.ln2.{weight,bias}, blocks.{i}.mlp.fc.{weight,bias}, blocks.{i}.mlp.proj.{weight,bias},
    ln_f.{weight,bias}, head.weight
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from p2p_diloco.config import ModelConfig, ModelKind, RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.model.contract import check_model_contract, data_vocab_size
from p2p_diloco.model.external import (
    build_external_model,
    check_weights_digest,
    embedding_names,
    weights_digest,
)

VOCAB_SIZE = 256
INIT_STD = 0.02
EMBEDDING_PARAMETER_NAMES = frozenset({"tok_emb.weight", "pos_emb.weight"})  # what the GPT's are


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        shape = (batch, seq, self.n_head, width // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(batch, seq, width)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte-level GPT. `forward(idx, targets)` returns (logits, mean cross-entropy loss or None)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(VOCAB_SIZE, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, VOCAB_SIZE, bias=False)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (batch, time), got {tuple(idx.shape)}")
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ValueError(f"sequence length {seq} exceeds model.block_size {self.config.block_size}")
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, VOCAB_SIZE), targets.reshape(-1))
        return logits, loss

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


@torch.no_grad()
def _init_weights(model: GPT, generator: torch.Generator) -> None:
    """Fill every parameter in `named_parameters()` order from `generator` (GPT-2 style init)."""
    residual_std = INIT_STD / math.sqrt(2 * model.config.n_layer)
    norm_params = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    for name, param in model.named_parameters():
        if id(param) in norm_params:
            param.fill_(1.0 if name.endswith("weight") else 0.0)
        elif name.endswith("bias"):
            param.zero_()
        elif name.endswith(("attn.proj.weight", "mlp.proj.weight")):
            param.normal_(0.0, residual_std, generator=generator)
        else:
            param.normal_(0.0, INIT_STD, generator=generator)


def build_model(cfg: ModelConfig) -> nn.Module:
    """A CPU float32 model whose initial weights depend only on `cfg` (bit-identical on every peer).

    `kind = "hf"` and `"custom"` are built by `model.external.build_external_model`; the rest of this
    docstring is about the built-in `GPT`.

    Modules are created on the meta device so their default initializers never touch the global RNG;
    all values then come from a `torch.Generator` seeded with `cfg.seed`. Move the model to an
    accelerator after building it, not before, so the initial weights stay identical everywhere.
    """
    if cfg.kind != ModelKind.GPT:
        return build_external_model(cfg)
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")
    generator = torch.Generator(device="cpu")
    generator.manual_seed(cfg.seed)
    _init_weights(model, generator)
    if cfg.weights_digest:
        check_weights_digest(model, cfg.weights_digest)
    return model


def embedding_parameter_names(model: nn.Module) -> set[str]:
    """Names of the token and position embeddings (merged by plain weighted mean, not RDA): the
    parameters of every `nn.Embedding` module, so any model kind is covered."""
    return embedding_names(model)


def make_inner_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrix weights only (no decay on biases, norms or embeddings).

    Group 0 holds the decayed tensors, group 1 the rest; both in `named_parameters()` order so the
    optimizer state of two identically built models lines up.
    """
    embeddings = embedding_parameter_names(model)
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 and name not in embeddings else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)


def parse_parameter_count(text: str) -> int:
    """'125M', '30M', '1.3B', '500K' or a plain integer -> the number of parameters."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMB]?)", text.strip().upper())
    if not m:
        raise ValueError(f"a parameter count looks like 125M, 30M, 1.3B or 500000, got {text!r}")
    return int(float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "B": 1e9}[m.group(2)])


def gpt_config_for(params: int, block_size: int = 32) -> ModelConfig:
    """The smallest byte GPT of at least `params` parameters: width by size (128, 384 from 5M, 768 from
    50M), then as many layers as needed."""
    width, heads = (768, 12) if params >= 50e6 else (384, 6) if params >= 5e6 else (128, 4)
    for layers in range(1, 200):
        config = ModelConfig(n_layer=layers, n_head=heads, n_embd=width, block_size=block_size)
        with torch.device("meta"):
            if GPT(config).num_parameters() >= params:
                return config
    raise ValueError(f"{params} parameters need more than 199 layers of width {width}")


def cli_model_digest(args: argparse.Namespace) -> int:
    """`p2p-diloco model-digest MANIFEST`: the `weights_digest` of the manifest's initial model. It is
    computed without the manifest's own `weights_digest`, so a stale one is reported, not refused: exit
    status 1 when they differ (the new value is printed for the organizer to put in the manifest). A custom
    model's forward is probed first (`model.contract`), against the data's vocabulary where it is readable."""
    manifest = RunManifest.load(args.manifest)
    stated = manifest.model.weights_digest
    model = build_model(dataclasses.replace(manifest.model, weights_digest=""))
    if manifest.model.kind == ModelKind.CUSTOM:
        try:
            vocab: int | None = data_vocab_size(manifest.data)
        except ConfigError as exc:
            vocab = None
            print(f"the model's vocabulary is not compared with the data's ({exc})", file=sys.stderr)
        check_model_contract(manifest, model, vocab)
    count = sum(p.numel() for p in model.parameters())
    found = weights_digest(model)
    print(f"{manifest.model.kind} model, {count} parameters")
    print(f"weights_digest: {found}")
    if stated and stated != found:
        print(
            f"the manifest says weights_digest = {stated!r}: it differs from the weights built here. If the "
            f'model changed, write weights_digest = "{found}" under [model] (and sign the manifest again); '
            "if not, build with the run's torch/transformers versions and model.init file",
            file=sys.stderr,
        )
        return 1
    return 0
