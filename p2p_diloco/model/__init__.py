"""The model and the data every learner trains on: a byte-level GPT and a byte corpus with sharded sampling."""

from p2p_diloco.model.data import BatchSampler, Corpus, evaluate, load_corpus, split_train_eval
from p2p_diloco.model.gpt import GPT, build_model, embedding_parameter_names, make_inner_optimizer

__all__ = [
    "GPT",
    "BatchSampler",
    "Corpus",
    "build_model",
    "embedding_parameter_names",
    "evaluate",
    "load_corpus",
    "make_inner_optimizer",
    "split_train_eval",
]
