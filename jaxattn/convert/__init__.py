"""Checkpoint conversion: Hugging Face transformers <-> ``DecoderLM``, and orbax checkpoints.

``load_hf(path)`` builds a model from a ``save_pretrained`` directory; ``to_hf`` / ``save_hf``
export one back; ``save_checkpoint`` / ``load_checkpoint`` write and read the orbax form the
training and generation scripts use (``python -m jaxattn.convert --from-hf PATH --out DIR``).
"""

from jaxattn.convert.checkpoint import load_checkpoint, save_checkpoint
from jaxattn.convert.hf import (ARCHITECTURES, architecture_for, architecture_of, config_from_hf,
                                load_hf, model_from_state, read_hf_dir, save_hf, state_from_hf,
                                to_hf)

__all__ = ["ARCHITECTURES", "architecture_for", "architecture_of", "config_from_hf", "load_hf",
           "load_checkpoint", "model_from_state", "read_hf_dir", "save_checkpoint", "save_hf",
           "state_from_hf", "to_hf"]
