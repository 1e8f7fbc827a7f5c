"""Training infrastructure: text data (byte tokenizer, sources, packed resumable batches) and
checkpoints (orbax, atomic, keep-last-K, corruption-aware restore, save on interrupt)."""

from jaxattn.train.checkpoint import (Checkpointer, CorruptCheckpointError, Interrupt,
                                      install_interrupt_handler)
from jaxattn.train.data import (BOS, EOS, PAD, ByteTokenizer, PackedDataset, eval_batches,
                                load_text, split_documents, tokenize_documents)
from jaxattn.train.step import (TrainState, cross_entropy, evaluate, init_train_state,
                                make_eval_step, make_optimizer, make_train_step,
                                model_flops_per_token, shard_batch)

__all__ = ["BOS", "EOS", "PAD", "ByteTokenizer", "Checkpointer", "CorruptCheckpointError",
           "Interrupt", "PackedDataset", "eval_batches", "install_interrupt_handler", "load_text",
           "split_documents", "tokenize_documents", "TrainState", "cross_entropy", "evaluate",
           "init_train_state", "make_eval_step", "make_optimizer", "make_train_step",
           "model_flops_per_token", "shard_batch"]
