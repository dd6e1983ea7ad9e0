"""The model and the data every learner trains on, and the inner step.

Models: the built-in byte-level GPT (`gpt`), transformers causal LMs and custom factories (`external`),
all built by `build_model`. Data: bytes of text (`data`) or prepared token shards (`shards`, written by
`prepare`), sampled per peer by `make_sampler`. The inner step: `trainer.InnerTrainer`.
"""

from p2p_diloco.model.data import (
    BatchSampler,
    Corpus,
    eval_split,
    evaluate,
    load_corpus,
    make_sampler,
    split_train_eval,
)
from p2p_diloco.model.gpt import GPT, build_model, embedding_parameter_names, make_inner_optimizer
from p2p_diloco.model.shards import TokenData
from p2p_diloco.model.trainer import InnerTrainer, lr_at, make_trainer

__all__ = [
    "GPT",
    "BatchSampler",
    "Corpus",
    "InnerTrainer",
    "TokenData",
    "build_model",
    "embedding_parameter_names",
    "eval_split",
    "evaluate",
    "load_corpus",
    "lr_at",
    "make_inner_optimizer",
    "make_sampler",
    "make_trainer",
    "split_train_eval",
]
