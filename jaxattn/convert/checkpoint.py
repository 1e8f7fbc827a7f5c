"""The orbax checkpoint of a ``DecoderLM``: ``config.json`` (``ModelConfig.to_json()``) and the
model state under ``state/``.

``load_checkpoint(path, mesh=mesh)`` restores each array directly onto its shards: the restore
target is an abstract model (``nnx.eval_shape``) whose leaves carry the ``NamedSharding`` that
``jaxattn.sharding.param_shardings`` gives them, so no host ever holds the whole model.
"""

from __future__ import annotations

import json
import os

import jax
import orbax.checkpoint as ocp
from flax import nnx

from jaxattn.nn.model import DecoderLM, ModelConfig
from jaxattn.sharding import param_shardings

CONFIG_FILE = "config.json"
STATE_DIR = "state"


def _pure_keys(tree):
  """The nested dict with string keys (orbax writes dict keys as path names; ``nnx.List``
  entries have int keys)."""
  if isinstance(tree, dict):
    return {str(k): _pure_keys(v) for k, v in tree.items()}
  return tree


def save_checkpoint(model: DecoderLM, path: str) -> None:
  """Writes ``path/config.json`` and ``path/state`` (every variable of the model: parameters and
  router biases).  ``path`` must not hold a previous checkpoint's state."""
  path = os.path.abspath(path)
  if os.path.exists(os.path.join(path, STATE_DIR)):
    # checked before config.json is written: a refused save must not relabel the old state
    raise ValueError(f"`path` {path!r} already holds a checkpoint ({STATE_DIR}/); use a new "
                     "directory or remove it.")
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, CONFIG_FILE), "w") as f:
    f.write(model.config.to_json())
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.join(path, STATE_DIR), _pure_keys(nnx.to_pure_dict(nnx.state(model))))


def read_config(path: str) -> ModelConfig:
  file = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(file):
    raise ValueError(f"`path`={path!r} is not a jaxattn checkpoint (no {CONFIG_FILE}).")
  with open(file) as f:
    return ModelConfig.from_dict(json.load(f))


def load_checkpoint(path: str, *, mesh=None) -> DecoderLM:
  """The ``DecoderLM`` saved at ``path``; with ``mesh`` its parameters land on their shards."""
  path = os.path.abspath(path)
  config = read_config(path)
  model = nnx.eval_shape(lambda: DecoderLM(config, rngs=nnx.Rngs(0)))
  graphdef, abstract = nnx.split(model)
  shapes = nnx.to_pure_dict(abstract)                     # leaves: ShapeDtypeStruct
  if mesh is not None:
    shardings = nnx.to_pure_dict(param_shardings(abstract, mesh))
  else:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: one, shapes)
  target = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), shapes,
                        shardings)
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(os.path.join(path, STATE_DIR), _pure_keys(target))
  nnx.replace_by_pure_dict(abstract, _keys_like(shapes, restored))
  return nnx.merge(graphdef, abstract)


def _keys_like(template, restored):
  """``restored`` with ``template``'s (int or str) keys: orbax gives back string keys."""
  if isinstance(template, dict):
    return {k: _keys_like(v, restored[str(k)]) for k, v in template.items()}
  return restored
