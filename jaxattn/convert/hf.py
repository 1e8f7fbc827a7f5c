"""Hugging Face transformers checkpoints <-> ``DecoderLM``: configs, state dicts, directories.

    config_from_hf(hf_config)              -> ModelConfig
    state_from_hf(state_dict, config)      -> nnx.State (on the default device, or on a mesh)
    load_hf(path, *, mesh=None)            -> DecoderLM   (a save_pretrained directory)
    to_hf(model)                           -> (hf_config_dict, state_dict)   (the round trip)
    save_hf(model, path)                   -> a directory transformers' from_pretrained reads

Families: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``DeepseekV3ForCausalLM``,
``DeepseekV32ForCausalLM``, ``Qwen3NextForCausalLM``, ``GptOssForCausalLM``.  Each family module
states its name and layout rules (``jaxattn.convert.rules``); this module applies them, checking
every tensor's name and shape against an abstract model so that a mismatch names the tensor and
the parameter.

Multi-token prediction (``jaxattn.nn.mtp``): DeepSeek-V3's extra layers and Qwen3-Next's ``mtp.*``
load as the model's ``mtp_depth`` modules.  A config states how many a checkpoint has
(``num_nextn_predict_layers``; Qwen3-Next's published configs state none, read as 0), but only
the weights tell whether they are there (transformers' ``save_pretrained`` writes none, whatever
its config says): ``load_hf`` keeps every module the weights hold, up to the stated number when
there is one.  The override ``mtp_depth=k`` keeps the first ``k`` (``mtp_depth=0`` drops them:
the same model without its draft modules; CLI ``--mtp-depth 0``); a ``ModelConfig`` with
``mtp_depth=0`` skips a checkpoint's MTP tensors in ``state_from_hf``.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from jaxattn.checks import is_int
from jaxattn.convert import common, deepseek, gpt_oss, llama, qwen3_next
from jaxattn.convert.rules import Rule
from jaxattn.nn.model import DTYPES, DecoderLM, ModelConfig
from jaxattn.nn.moe import RouterBias
from jaxattn.sharding import param_shardings

_FAMILIES = {name: fam for fam in (llama, deepseek, qwen3_next, gpt_oss)
             for name in fam.ARCHITECTURES}
ARCHITECTURES: tuple[str, ...] = tuple(_FAMILIES)
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM",
                "qwen3_next": "Qwen3NextForCausalLM", "gpt_oss": "GptOssForCausalLM"}
# The config field that counts a checkpoint's multi-token-prediction modules, in the families
# that have them (those with ``mtp_depth_stored``).
_MTP_FIELD = "num_nextn_predict_layers"


def architecture_of(hf_config) -> str:
  """The supported architecture name a config describes (``architectures[0]`` or ``model_type``)."""
  d = common.as_dict(hf_config)
  archs = d.get("architectures") or []
  if archs:
    if len(archs) != 1 or archs[0] not in _FAMILIES:
      raise ValueError(f"`architectures`={archs!r} is not supported; supported: "
                       f"{list(ARCHITECTURES)}.")
    return archs[0]
  model_type = d.get("model_type")
  if model_type not in _MODEL_TYPES:
    raise ValueError(f"`model_type`={model_type!r} is not supported; supported: "
                     f"{sorted(_MODEL_TYPES)} (architectures {list(ARCHITECTURES)}).")
  return _MODEL_TYPES[model_type]


def config_from_hf(hf_config, *, dtype: str = "float32", param_dtype: str | None = None,
                   **overrides) -> ModelConfig:
  """The ``ModelConfig`` of a transformers config (object or ``config.json`` dict).

  ``dtype`` is the compute dtype, ``param_dtype`` the storage dtype (default: ``dtype``);
  ``overrides`` set other ``ModelConfig`` fields that do not change the weights or the function
  (``RUNTIME_FIELDS``: e.g. ``attention_implementation``, ``max_seq_len``, ``mla_mode``); any
  other override that differs from the checkpoint's value raises, but for ``mtp_depth``, which
  may keep fewer of the checkpoint's multi-token-prediction modules (the first ``mtp_depth``; 0
  drops them).  Raises ``ValueError`` for an unsupported architecture and for any config field the
  converter does not understand or does not support with the value given.
  """
  d = common.as_dict(hf_config)
  arch = architecture_of(d)
  overrides = dict(overrides)
  if "mtp_depth" in overrides:
    d = _keep_mtp(d, arch, overrides.pop("mtp_depth"))
  else:
    _stated_mtp(d, arch)
  try:
    kwargs = _FAMILIES[arch].config_from_hf(d, arch)
  except KeyError as e:   # a required field (vocab_size, num_hidden_layers, ...) is absent
    raise ValueError(f"{arch}: the config has no field {e.args[0]!r}.") from None
  kwargs.update(dtype=dtype, param_dtype=param_dtype or dtype)
  changed = sorted(k for k, v in overrides.items()
                   if k not in RUNTIME_FIELDS and (k not in kwargs or kwargs[k] != v))
  if changed:
    # e.g. tie_embeddings=True on an untied checkpoint would drop its lm_head silently
    raise ValueError(f"overrides {changed} would change the checkpoint's model; only "
                     f"{sorted(RUNTIME_FIELDS)} (how it runs, not what it computes) can be set.")
  kwargs.update(overrides)
  return ModelConfig(**kwargs)


def _has_mtp(arch: str) -> bool:
  return hasattr(_FAMILIES[arch], "mtp_depth_stored")


def _stated_mtp(d: Mapping[str, Any], arch: str) -> int | None:
  """The number of MTP modules the config states (None: it states none)."""
  n = d.get(_MTP_FIELD) if _has_mtp(arch) else None
  if n is not None and (not is_int(n) or n < 0):
    raise ValueError(f"{arch}: `{_MTP_FIELD}` must be an int >= 0, got {n!r}.")
  return n


def _keep_mtp(d: dict, arch: str, depth) -> dict:
  """``d`` stating ``depth`` MTP modules, which must be at most as many as it states."""
  stated = _stated_mtp(d, arch)
  n = stated or 0
  if not is_int(depth) or not 0 <= depth <= n:
    unstated = (f" (its config states no `{_MTP_FIELD}`; load_hf counts them in the weights)"
                if stated is None and _has_mtp(arch) else "")
    raise ValueError(f"{arch}: `mtp_depth`={depth!r} is not available: the checkpoint has {n} "
                     f"multi-token-prediction module(s){unstated}; `mtp_depth` keeps the first "
                     f"ones, an int in [0, {n}] (0 drops them).")
  return dict(d, **{_MTP_FIELD: depth}) if _has_mtp(arch) else d


# ModelConfig fields a converted checkpoint may be given: how the model runs (cache length,
# kernels, compilation, training-time options), not its weights or its function.
RUNTIME_FIELDS = frozenset({
    "max_seq_len", "attention_implementation", "mla_mode", "deltanet_chunk_size", "scan_layers",
    "remat", "indexer_loss_weight", "moe_seq_balance_alpha", "moe_bias_update_rate",
    "moe_capacity_factor", "mtp_loss_weight",
    # MXFP4 experts kept as the checkpoint holds them (gpt-oss): the same values, ~3.5x fewer bytes
    "moe_expert_format", "moe_implementation"})


def architecture_for(config: ModelConfig) -> str:
  """The transformers architecture a ``ModelConfig`` exports to."""
  kinds = config.kinds()
  if config.attention_sinks or (config.num_experts and config.moe_activation != "swiglu"):
    return "GptOssForCausalLM"
  if "D" in kinds or config.attention_output_gate:
    return "Qwen3NextForCausalLM"
  if "I" in kinds:
    return "DeepseekV32ForCausalLM"
  if "M" in kinds:
    return "DeepseekV3ForCausalLM"
  if "S" in kinds:
    return "MistralForCausalLM"
  return "LlamaForCausalLM"


def rules_for(config: ModelConfig, architecture: str | None = None) -> list[Rule]:
  if config.scan_layers:
    raise ValueError("`scan_layers=True` stacks layer parameters; convert with scan_layers=False "
                     "(the default of config_from_hf).")
  arch = architecture or architecture_for(config)
  return _FAMILIES[arch].rules(config)


def abstract_state(config: ModelConfig):
  """``(graphdef, abstract state)`` of a ``DecoderLM(config)``, nothing allocated."""
  model = nnx.eval_shape(lambda: DecoderLM(config, rngs=nnx.Rngs(0)))
  return nnx.split(model)


def _to_numpy(x) -> np.ndarray:
  if isinstance(x, np.ndarray):
    return x
  if hasattr(x, "detach"):  # a torch tensor: NumPy has no bfloat16, so go through float32
    t = x.detach().cpu()
    if str(t.dtype) == "torch.bfloat16":
      t = t.float()
    return t.numpy()
  return np.asarray(x)


def _ignored(key: str, config: ModelConfig) -> bool:
  """Tensors a checkpoint may hold that are not part of the model: cached RoPE frequencies, a
  copy of the embedding as ``lm_head.weight`` when the two are tied (transformers ties them too),
  and Qwen3-Next's shared-expert gate when there is no shared expert (transformers keeps a
  ``[1, D]`` gate over a zero-width expert: it multiplies zeros)."""
  return (key.endswith("rotary_emb.inv_freq") or (key == "lm_head.weight" and config.tie_embeddings)
          or (key.endswith("mlp.shared_expert_gate.weight") and config.num_experts > 0
              and config.num_shared_experts == 0))


def _shared_tensors(family, config) -> dict[str, str]:
  """Copies of shared tensors a family's checkpoints store (name -> the original's name)."""
  return family.shared_tensors(config) if hasattr(family, "shared_tensors") else {}


def _equal(a, b) -> bool:
  """Whether two tensors hold the same values (compared a block of rows at a time)."""
  a, b = _to_numpy(a), _to_numpy(b)
  if a.shape != b.shape:
    return False
  step = max(1, (1 << 24) // max(1, math.prod(a.shape[1:])))
  return all(np.array_equal(a[i:i + step], b[i:i + step]) for i in range(0, len(a), step))


def state_from_hf(state_dict: Mapping[str, Any], config: ModelConfig, *, mesh=None,
                  architecture: str | None = None):
  """An ``nnx.State`` for ``DecoderLM(config)`` from a transformers state dict.

  ``state_dict`` maps transformers names to arrays (NumPy, torch, JAX); per-expert and fused
  expert layouts are both accepted.  The checkpoint's multi-token-prediction modules past
  ``config.mtp_depth`` (all of them for 0) are skipped.  With ``mesh`` each parameter is put
  directly on its shards (``jaxattn.sharding.param_shardings``); without, on the default device.
  Raises ``ValueError`` naming the tensor for a missing, unexpected or wrongly shaped tensor, and
  for a stored copy of a shared tensor (DeepSeek's MTP layers' embedding and head) that differs
  from the original.
  """
  arch = architecture or architecture_for(config)
  sd = dict(state_dict)
  family = _FAMILIES[arch]
  if hasattr(family, "normalize"):
    family.normalize(sd, config)
  for name, original in _shared_tensors(family, config).items():
    if name in sd:
      if original in sd and not _equal(sd[name], sd[original]):
        raise ValueError(f"{arch}: checkpoint tensor `{name}` differs from `{original}`; the "
                         "multi-token-prediction module shares that tensor with the model, so "
                         "it must be a copy.")
      del sd[name]
  graphdef, abstract = abstract_state(config)
  flat = {path: var for path, var in nnx.to_flat_state(abstract)}
  shardings = None
  if mesh is not None:
    shardings = {p: s for p, s in nnx.to_flat_state(param_shardings(abstract, mesh))}
  dtype = config.parameter_dtype

  def place(p, v):
    if shardings is None:
      return jax.device_put(v)
    # Each device (each host, on a pod) copies only its own slice of the host array.
    return jax.make_array_from_callback(v.shape, shardings[p], lambda idx: v[idx])

  values: dict[tuple, Any] = {}
  used: set[str] = set()
  for rule in rules_for(config, arch):
    missing = [k for k in rule.hf if k not in sd]
    if missing:
      raise ValueError(f"{arch}: checkpoint tensor `{missing[0]}` is missing (needed for parameter "
                       f"{'/'.join(map(str, rule.ours[0]))}).")
    for p in rule.ours:
      if p not in flat:
        raise ValueError(f"internal: rule targets {p}, which DecoderLM({arch}) does not have.")
    shapes = tuple(_shape(flat[p]) for p in rule.ours)
    expected = jax.eval_shape(rule.to_hf, *[jax.ShapeDtypeStruct(s, np.float32) for s in shapes])
    arrays = []
    for k, e in zip(rule.hf, expected):
      a = _to_numpy(sd[k])
      if tuple(a.shape) != tuple(e.shape):
        raise ValueError(f"{arch}: checkpoint tensor `{k}` has shape {tuple(a.shape)}, but the "
                         f"config implies {tuple(e.shape)} (for parameter "
                         f"{'/'.join(map(str, rule.ours[0]))}).")
      arrays.append(a.astype(np.float32))
      used.add(k)
    for p, v in zip(rule.ours, rule.to_ours(*arrays, shapes=shapes)):
      values[p] = place(p, np.asarray(v).astype(_np_dtype(flat[p], dtype)))
  # A tensor with no elements carries nothing: transformers saves zero-width shared experts
  # (n_shared_experts=0, shared_expert_intermediate_size=0) that the model built here omits.
  extra = sorted(k for k in sd if k not in used and not _ignored(k, config)
                 and math.prod(sd[k].shape))
  if extra:
    raise ValueError(f"{arch}: checkpoint tensor(s) {extra[:8]}{' ...' if len(extra) > 8 else ''} "
                     "have no place in the model built from its config.")
  for p, var in flat.items():
    if p not in values:
      if isinstance(var, RouterBias):  # a family without a selection bias (Qwen3-Next): zeros
        values[p] = place(p, np.zeros(_shape(var), np.float32))
        continue
      raise ValueError(f"internal: no rule fills parameter {'/'.join(map(str, p))} ({arch}).")
  for p, var in flat.items():
    var.set_value(values[p])
  return nnx.from_flat_state(list(flat.items()))


def _shape(var) -> tuple[int, ...]:
  return tuple(var.get_value().shape)


def _np_dtype(var, default):
  dtype = var.get_value().dtype
  return default if dtype is None else dtype


def model_from_state(config: ModelConfig, state) -> DecoderLM:
  """A ``DecoderLM`` with ``state`` (as from ``state_from_hf``)."""
  graphdef, _ = abstract_state(config)
  return nnx.merge(graphdef, state)


# -- directories -------------------------------------------------------------------------------

def read_hf_config(path: str) -> dict:
  """The ``config.json`` of a ``save_pretrained`` directory, as a dict."""
  cfg_path = os.path.join(path, "config.json")
  if not os.path.isfile(cfg_path):
    raise ValueError(f"`path`={path!r} has no config.json (expected a save_pretrained directory).")
  with open(cfg_path) as f:
    return json.load(f)


_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
                       "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
                       "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64, "I32": np.int32,
                       "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def read_safetensors(file: str) -> dict[str, np.ndarray]:
  """The tensors of one ``.safetensors`` file as read-only memory-mapped NumPy arrays (bf16 and
  fp8 through ``ml_dtypes``, which the safetensors NumPy reader does not handle).

  The format: an 8-byte little-endian header size, a JSON header ``{name: {dtype, shape,
  data_offsets}}``, then the raw little-endian data."""
  with open(file, "rb") as f:
    n = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(n))
  data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + n)
  out = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    if info["dtype"] not in _SAFETENSORS_DTYPES:
      raise ValueError(f"{file}: tensor `{name}` has dtype {info['dtype']}; supported: "
                       f"{sorted(_SAFETENSORS_DTYPES)}.")
    start, end = info["data_offsets"]
    out[name] = data[start:end].view(_SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])
  return out


def _index_files(path: str, index: str) -> list[str] | None:
  """The shard files a ``*.index.json`` names in its ``weight_map`` (None: no such index)."""
  index_path = os.path.join(path, index)
  if not os.path.isfile(index_path):
    return None
  with open(index_path) as f:
    weight_map = json.load(f).get("weight_map")
  if not isinstance(weight_map, dict) or not weight_map:
    raise ValueError(f"{index_path}: no `weight_map` (a sharded checkpoint's index names the file "
                     "of each tensor).")
  files = sorted(set(weight_map.values()))
  absent = [f for f in files if not os.path.isfile(os.path.join(path, f))]
  if absent:
    raise ValueError(f"{index_path} names shard(s) {absent[:4]} that are not in {path!r}.")
  return files


def _torch_load(file: str) -> dict[str, np.ndarray]:
  import torch
  return {k: _to_numpy(v) for k, v in
          torch.load(file, map_location="cpu", weights_only=True).items()}


def read_hf_weights(path: str) -> dict[str, np.ndarray]:
  """The tensors of a ``save_pretrained`` directory, as transformers finds them: the shards that
  ``model.safetensors.index.json`` names, else ``model.safetensors``, else the same for
  ``pytorch_model.bin``; only when none of these is there, every ``*.safetensors``.  (Hub
  repositories may hold other weight files beside these, such as Mistral's
  ``consolidated.safetensors`` in its own naming: the standard names keep them out.)"""
  names = _index_files(path, "model.safetensors.index.json")
  if names is None and os.path.isfile(os.path.join(path, "model.safetensors")):
    names = ["model.safetensors"]
  if names is None:
    bins = _index_files(path, "pytorch_model.bin.index.json")
    if bins is None and os.path.isfile(os.path.join(path, "pytorch_model.bin")):
      bins = ["pytorch_model.bin"]
    if bins:
      sd: dict[str, np.ndarray] = {}
      for name in bins:
        sd.update(_torch_load(os.path.join(path, name)))
      return sd
    names = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  if not names:
    raise ValueError(f"`path`={path!r} has no *.safetensors or pytorch_model.bin weights.")
  sd = {}
  for name in names:
    sd.update(read_safetensors(os.path.join(path, name)))
  return sd


def read_hf_dir(path: str) -> tuple[dict, dict[str, np.ndarray]]:
  """``(config dict, state dict)`` of a ``save_pretrained`` directory."""
  return read_hf_config(path), read_hf_weights(path)


def load_hf(path: str, *, mesh=None, dtype: str = "float32", param_dtype: str | None = None,
            **overrides) -> DecoderLM:
  """A ``DecoderLM`` from a transformers ``save_pretrained`` directory (parameters placed on
  ``mesh`` when given).  The config is checked before any weight is read; the weights then say
  how many multi-token-prediction modules there are (up to the number the config states, when
  it states one): all of them load, or the first ``mtp_depth`` with that override (0: none)."""
  d = read_hf_config(path)
  arch = architecture_of(d)
  mtp = _has_mtp(arch)
  stated = _stated_mtp(d, arch)
  rest = {k: v for k, v in overrides.items() if k != "mtp_depth"}
  # everything but the MTP modules, which the weights count
  config_from_hf(dict(d, **{_MTP_FIELD: 0}) if mtp else d, dtype=dtype, param_dtype=param_dtype,
                 **rest)
  sd = read_hf_weights(path)
  if mtp:
    stored = _FAMILIES[arch].mtp_depth_stored(sd, d)
    d = dict(d, **{_MTP_FIELD: stored if stated is None else min(stated, stored)})
  config = config_from_hf(d, dtype=dtype, param_dtype=param_dtype, **overrides)
  return model_from_state(config, state_from_hf(sd, config, mesh=mesh, architecture=arch))


# -- export ------------------------------------------------------------------------------------

def to_hf(model: DecoderLM, *, architecture: str | None = None
          ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """``(config dict, state dict of fp32 NumPy arrays)`` that transformers loads as the same model
  (per-expert tensor names, as checkpoints on disk; quantized storage, MXFP4 experts, keeps its
  integer dtype)."""
  config = model.config
  arch = architecture or architecture_for(config)
  hf_config = _FAMILIES[arch].config_to_hf(config, arch)
  flat = {p: v for p, v in nnx.to_flat_state(nnx.state(model))}
  sd: dict[str, np.ndarray] = {}
  for rule in rules_for(config, arch):
    values = [np.asarray(jax.device_get(flat[p].get_value())) for p in rule.ours]
    integer = all(np.issubdtype(v.dtype, np.integer) for v in values)
    out_dtype = values[0].dtype if integer else np.float32
    arrays = [v if integer else v.astype(np.float32) for v in values]
    for k, v in zip(rule.hf, rule.to_hf(*arrays)):
      sd[k] = np.ascontiguousarray(np.asarray(v, out_dtype))
  for name, original in _shared_tensors(_FAMILIES[arch], config).items():
    sd[name] = sd[original]
  covered = {p for rule in rules_for(config, arch) for p in rule.ours}
  for p, var in flat.items():
    value = np.asarray(jax.device_get(var.get_value()))
    # A router bias the family has no tensor for (Qwen3-Next) is fine only while it is zero.
    if p not in covered and np.any(value != 0):
      raise ValueError(f"{arch} has no tensor for parameter {'/'.join(map(str, p))}, and it is "
                       "not zero: the exported model would differ.")
  return hf_config, sd


def save_hf(model: DecoderLM, path: str, *, architecture: str | None = None) -> None:
  """Writes ``config.json`` and ``model.safetensors`` that ``from_pretrained(path)`` reads."""
  from safetensors.numpy import save_file
  hf_config, sd = to_hf(model, architecture=architecture)
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
  save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def dtype_names() -> list[str]:
  return sorted(DTYPES)
