"""The KV-efficiency table: cache numbers and bytes per token per layer for MHA, GQA, MQA and MLA.

The seed's hierarchy, per token and per layer (multiply by ``seq_len * num_layers * batch``)::

    MHA        2 * N * H          every query head has its own key and value
    GQA(K)     2 * K * H          K key/value heads ("G groups" in the seed), N % K == 0
    MQA        2 * H              one key and value shared by all heads
    MLA        C + R              the latent c_KV plus one rotated key shared by all heads

(with a value head size ``h != H`` the factor ``2 H`` reads ``H + h``).  For DeepSeek-V2/V3
(``N = 128``, ``H = h = 128``, ``C = 512``, ``R = 64``) MHA keeps 32,768 numbers and MLA 576, about
57x fewer; fewer cached numbers say nothing by themselves about speed (``experiments/bench_mla.py``
measures that).

Example::

    >>> from jaxattn.kv_efficiency import kv_cache_table, format_kv_cache_table
    >>> rows = kv_cache_table(num_heads=128, head_dim=128, gqa_kv_heads=(8,), kv_lora_rank=512,
    ...                       qk_rope_head_dim=64)
    >>> [r.numbers_per_token for r in rows]
    [32768, 2048, 256, 576]
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

import jax.numpy as jnp
import numpy as np

from jaxattn.cache import kv_cache_bytes_per_token
from jaxattn.checks import is_int
from jaxattn.ops.quantization import kv_quantized

CacheKind = Literal["mha", "gqa", "mqa", "mla"]
CACHE_KINDS: tuple[str, ...] = ("mha", "gqa", "mqa", "mla")


@dataclasses.dataclass(frozen=True)
class KVCacheCost:
  """One row of the table.

  Attributes:
    name: ``"MHA"``, ``"GQA(K=8)"``, ``"MQA"`` or ``"MLA"``.
    numbers_per_token: cached numbers per token per layer.
    bytes_per_token: the same in bytes at the table's dtype; a quantized one (int8 /
      float8_e4m3fn) adds what its caches keep beside the one-byte codes: an fp32 scale per key
      and per value of each KV head (``8 K`` bytes), or for MLA one fp32 scale per token and the
      rotated key ``k^R`` unquantized (``C + 4 + R x rope bytes``).
    ratio_to_mha: ``numbers_per_token / MHA's`` (1 for MHA; 576 / 32768 = 0.0176 for DeepSeek MLA).
  """

  name: str
  numbers_per_token: int
  bytes_per_token: int
  ratio_to_mha: float

  @property
  def reduction_vs_mha(self) -> float:
    """How many times fewer numbers than MHA (``1 / ratio_to_mha``; 56.9 for DeepSeek MLA)."""
    return 1.0 / self.ratio_to_mha

  def total_bytes(self, seq_len: int, *, num_layers: int = 1, batch: int = 1) -> int:
    """Cache bytes for ``batch`` sequences of ``seq_len`` tokens through ``num_layers`` layers."""
    return int(self.bytes_per_token) * int(seq_len) * int(num_layers) * int(batch)


def _positive(name, v):
  if not is_int(v) or v < 1:
    raise ValueError(f"`{name}` must be a positive int, got {v!r}.")


def kv_cache_per_token(
    kind: CacheKind,
    *,
    num_heads: int,
    head_dim: int,
    num_kv_heads: int | None = None,
    v_head_dim: int | None = None,
    kv_lora_rank: int | None = None,
    qk_rope_head_dim: int = 0,
    dtype=jnp.bfloat16,
    rope_dtype=jnp.bfloat16,
) -> KVCacheCost:
  """Per-token, per-layer cache cost of one attention variant, with its ratio to MHA.

  Args:
    kind: ``"mha"``, ``"gqa"`` (needs ``num_kv_heads``), ``"mqa"`` or ``"mla"`` (needs
      ``kv_lora_rank``; ``qk_rope_head_dim`` adds the shared rotated key).
    num_heads: ``N``, query heads (sets the MHA reference the ratio is taken against).
    head_dim: ``H``, the per-head key size of the MHA/GQA/MQA layout (the ``d_k`` of the seed).
    num_kv_heads: ``K`` for GQA, ``1 <= K <= N`` and ``N % K == 0``.
    v_head_dim: ``h``, value head size when it differs from ``H``.
    kv_lora_rank: ``C``, MLA's latent size ``d_c``.
    qk_rope_head_dim: ``R``, MLA's rotated key size ``d_r`` (0 for the seed's bare ``d_c``).
    dtype: element type of the cache (bytes only).
    rope_dtype: with a quantized ``dtype``, the element type MLA keeps ``k^R`` in (the layer's
      compute dtype).
  """
  if kind not in CACHE_KINDS:
    raise ValueError(f"`kind` must be one of {CACHE_KINDS}, got {kind!r}.")
  _positive("num_heads", num_heads)
  _positive("head_dim", head_dim)
  v_head_dim = head_dim if v_head_dim is None else v_head_dim
  _positive("v_head_dim", v_head_dim)
  per_head = head_dim + v_head_dim
  mha = num_heads * per_head
  if kind == "mha":
    name, numbers, kv_heads = "MHA", mha, num_heads
  elif kind == "mqa":
    name, numbers, kv_heads = "MQA", per_head, 1
  elif kind == "gqa":
    if num_kv_heads is None:
      raise ValueError("kind='gqa' needs `num_kv_heads` (the seed's number of groups G).")
    _positive("num_kv_heads", num_kv_heads)
    if num_kv_heads > num_heads or num_heads % num_kv_heads:
      raise ValueError(f"`num_kv_heads`={num_kv_heads} must divide `num_heads`={num_heads} "
                       "(GQA: N % K == 0, 1 <= K <= N).")
    name, numbers, kv_heads = f"GQA(K={num_kv_heads})", num_kv_heads * per_head, num_kv_heads
  else:
    if kv_lora_rank is None:
      raise ValueError("kind='mla' needs `kv_lora_rank` (the latent size d_c).")
    _positive("kv_lora_rank", kv_lora_rank)
    if not is_int(qk_rope_head_dim) or qk_rope_head_dim < 0:   # bools refused
      raise ValueError(f"`qk_rope_head_dim` must be a non-negative int, got {qk_rope_head_dim!r}.")
    name, numbers = "MLA", kv_lora_rank + qk_rope_head_dim
  if kind != "mla":                  # (with a quantized dtype: the codes and their scales)
    size = kv_cache_bytes_per_token(kv_heads, head_dim, dtype, v_head_dim)
  elif kv_quantized(dtype):          # codes, a scale per token, k^R unquantized
    size = kv_lora_rank + 4 + qk_rope_head_dim * np.dtype(rope_dtype).itemsize
  else:
    size = numbers * np.dtype(dtype).itemsize
  return KVCacheCost(name=name, numbers_per_token=int(numbers), bytes_per_token=int(size),
                     ratio_to_mha=numbers / mha)


def _default_gqa_kv_heads(num_heads: int) -> tuple[int, ...]:
  """The default GQA rows of ``kv_cache_table`` (see there)."""
  if num_heads % 8 == 0:
    return (8,)
  divisors = [k for k in range(2, min(num_heads, 8)) if num_heads % k == 0]
  return (divisors[-1],) if divisors else ()


def kv_cache_table(
    *,
    num_heads: int,
    head_dim: int,
    gqa_kv_heads: Sequence[int] | None = None,
    v_head_dim: int | None = None,
    kv_lora_rank: int | None = None,
    qk_rope_head_dim: int = 0,
    dtype=jnp.bfloat16,
) -> list[KVCacheCost]:
  """The seed's table for one model size: MHA, one GQA row per entry of ``gqa_kv_heads``, MQA, and
  MLA when ``kv_lora_rank`` is given.  Arguments as in ``kv_cache_per_token``.

  ``gqa_kv_heads`` (each entry a ``K`` that divides ``num_heads``) defaults to one row, adapted to
  ``num_heads``: ``K = 8`` where 8 divides ``N`` (the usual choice, e.g. ``N = 128``), else the
  largest divisor ``1 < K < min(N, 8)`` of ``N`` (``K = 2`` for ``N = 4``), else no GQA row.
  """
  _positive("num_heads", num_heads)
  if gqa_kv_heads is None:
    gqa_kv_heads = _default_gqa_kv_heads(num_heads)
  else:
    for k in gqa_kv_heads:
      if not is_int(k) or not 1 <= k <= num_heads or num_heads % k:
        raise ValueError(f"`gqa_kv_heads` entries must be ints that divide `num_heads`={num_heads}"
                         f" (GQA: N % K == 0), got {k!r} in {tuple(gqa_kv_heads)!r}.")
  common = dict(num_heads=num_heads, head_dim=head_dim, v_head_dim=v_head_dim, dtype=dtype)
  rows = [kv_cache_per_token("mha", **common)]
  rows += [kv_cache_per_token("gqa", num_kv_heads=k, **common) for k in gqa_kv_heads]
  rows.append(kv_cache_per_token("mqa", **common))
  if kv_lora_rank is not None:
    rows.append(kv_cache_per_token("mla", kv_lora_rank=kv_lora_rank,
                                   qk_rope_head_dim=qk_rope_head_dim, **common))
  return rows


def format_kv_cache_table(rows: Sequence[KVCacheCost], *, seq_len: int | None = None,
                          num_layers: int = 1) -> str:
  """A plain-text table of ``rows``; with ``seq_len``, also the total for ``num_layers`` layers."""
  head = f"{'variant':<10} {'numbers/token':>14} {'bytes/token':>12} {'vs MHA':>9} {'x fewer':>8}"
  if seq_len is not None:
    head += f" {f'GiB @ {seq_len} tok x {num_layers} layers':>28}"
  lines = [head, "-" * len(head)]
  for r in rows:
    line = (f"{r.name:<10} {r.numbers_per_token:>14,} {r.bytes_per_token:>12,} "
            f"{r.ratio_to_mha:>9.4f} {r.reduction_vs_mha:>8.1f}")
    if seq_len is not None:
      line += f" {r.total_bytes(seq_len, num_layers=num_layers) / 2**30:>28.3f}"
    lines.append(line)
  return "\n".join(lines)
