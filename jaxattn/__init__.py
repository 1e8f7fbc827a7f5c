"""jaxattn: the mechanisms of modern transformer attention in JAX / Flax NNX.

Layers: formulas (``jaxattn.ops``, pure functions, fp32 math) -> modules (``jaxattn.nn``, Flax NNX,
parameters with logical sharding axes, explicit caches) -> kernels (``pallas_kernels``).

Shape letters, used in signatures, einsum strings and comments throughout:

  B  batch                      T  query length          S  key/value length
  N  query heads                K  key/value heads (N % K == 0; G = N // K query heads per KV head)
  H  query/key head size        h  value head size when it differs from H
  D  model (embedding) size     F  MLP hidden size       L  cache capacity
  R  rotary dimensions (partial RoPE rotates the first R of H; MLA's decoupled RoPE width)
  C  MLA latent (compressed KV) size   Cq  MLA query latent size   P  MLA content head size (H = P + R)

Activations are ``[B, T, N, H]`` as in ``jax.nn.dot_product_attention``.
"""

from jaxattn import cache, ops, sharding  # noqa: F401
from jaxattn.cache import KVCache, kv_cache_bytes_per_token
from jaxattn.kv_efficiency import format_kv_cache_table, kv_cache_per_token, kv_cache_table
from jaxattn.mla_cache import LatentCache
from jaxattn.ops.attention import dot_product_attention, explain_dispatch
from jaxattn.paged_cache import PagedKVCache, PagedLatentCache, PageTable

__version__ = "0.1.0"

__all__ = ["KVCache", "LatentCache", "PagedKVCache", "PagedLatentCache", "PageTable", "dot_product_attention", "explain_dispatch", "format_kv_cache_table",
           "kv_cache_bytes_per_token", "kv_cache_per_token", "kv_cache_table", "cache", "ops",
           "sharding"]
