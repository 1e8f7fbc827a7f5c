"""The KV-efficiency calculator: the seed's table, DeepSeek's 32,768 vs 576, bytes, errors."""

import jax.numpy as jnp
import pytest

from jaxattn.cache import kv_cache_bytes_per_token
from jaxattn.kv_efficiency import format_kv_cache_table, kv_cache_per_token, kv_cache_table


def test_deepseek_v2_v3_numbers():
  rows = kv_cache_table(num_heads=128, head_dim=128, gqa_kv_heads=(8,), kv_lora_rank=512,
                        qk_rope_head_dim=64)
  by_name = {r.name: r for r in rows}
  assert [r.name for r in rows] == ["MHA", "GQA(K=8)", "MQA", "MLA"]
  assert by_name["MHA"].numbers_per_token == 32_768      # 2 x 128 heads x 128
  assert by_name["MLA"].numbers_per_token == 576         # 512 latent + 64 rotated key
  assert by_name["GQA(K=8)"].numbers_per_token == 2 * 8 * 128
  assert by_name["MQA"].numbers_per_token == 2 * 128
  assert by_name["MLA"].ratio_to_mha == pytest.approx(576 / 32768)
  assert by_name["MLA"].reduction_vs_mha == pytest.approx(56.89, abs=0.01)  # "about 57 times"
  assert by_name["MHA"].ratio_to_mha == 1.0
  assert by_name["MLA"].bytes_per_token == 576 * 2       # bf16 default
  # The seed's bare d_c (no decoupled key) and the agreement with the foundation's KV formula.
  bare = kv_cache_per_token("mla", num_heads=128, head_dim=128, kv_lora_rank=512)
  assert bare.numbers_per_token == 512
  for k in (1, 8, 128):
    kind = {1: "mqa", 128: "mha"}.get(k, "gqa")
    row = kv_cache_per_token(kind, num_heads=128, head_dim=128, num_kv_heads=k, dtype=jnp.float32)
    assert row.bytes_per_token == kv_cache_bytes_per_token(k, 128, jnp.float32)


def test_value_head_size_totals_and_table_text():
  row = kv_cache_per_token("gqa", num_heads=16, head_dim=192, v_head_dim=128, num_kv_heads=4,
                           dtype=jnp.float32)
  assert row.numbers_per_token == 4 * (192 + 128) and row.bytes_per_token == 4 * 320 * 4
  assert row.total_bytes(1000, num_layers=3, batch=2) == 1000 * 3 * 2 * 4 * 320 * 4
  text = format_kv_cache_table(kv_cache_table(num_heads=128, head_dim=128, kv_lora_rank=512,
                                              qk_rope_head_dim=64), seq_len=4096, num_layers=61)
  assert "32,768" in text and "576" in text and "56.9" in text
  assert len(text.splitlines()) == 2 + 4


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="gqa", num_heads=8, head_dim=64), "num_kv_heads"),
    (dict(kind="gqa", num_heads=8, head_dim=64, num_kv_heads=3), "divide"),
    (dict(kind="gqa", num_heads=8, head_dim=64, num_kv_heads=16), "divide"),
    (dict(kind="mla", num_heads=8, head_dim=64), "kv_lora_rank"),
    (dict(kind="mla", num_heads=8, head_dim=64, kv_lora_rank=0), "kv_lora_rank"),
    (dict(kind="mla", num_heads=8, head_dim=64, kv_lora_rank=16, qk_rope_head_dim=-2),
     "qk_rope_head_dim"),
    (dict(kind="mla", num_heads=8, head_dim=64, kv_lora_rank=16, qk_rope_head_dim=True),
     "qk_rope_head_dim"),
    (dict(kind="mha", num_heads=0, head_dim=64), "num_heads"),
    (dict(kind="mha", num_heads=8, head_dim=64.0), "head_dim"),
    (dict(kind="mqa", num_heads=8, head_dim=64, v_head_dim=0), "v_head_dim"),
    (dict(kind="mlx", num_heads=8, head_dim=64), "kind"),
])
def test_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    kv_cache_per_token(**kwargs)


def test_table_default_gqa_rows_adapt_to_num_heads():
  # Before: num_heads=4 failed on the default gqa_kv_heads=(8,), which the caller never passed.
  names = {n: [r.name for r in kv_cache_table(num_heads=n, head_dim=8)] for n in (4, 8, 12, 3, 128)}
  assert names[4] == ["MHA", "GQA(K=2)", "MQA"]
  assert names[8] == ["MHA", "GQA(K=8)", "MQA"]
  assert names[12] == ["MHA", "GQA(K=6)", "MQA"]
  assert names[3] == ["MHA", "MQA"]
  assert names[128] == ["MHA", "GQA(K=8)", "MQA"]
  with pytest.raises(ValueError, match=r"`gqa_kv_heads` entries must be ints that divide "
                                       r"`num_heads`=4 .*got 8 in \(8,\)"):
    kv_cache_table(num_heads=4, head_dim=8, gqa_kv_heads=(8,))


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_quantized_bytes_are_what_the_caches_hold(dtype):
  """A quantized table row counts the codes and what the caches keep beside them (a fp32 scale
  per key and value of each KV head; for MLA a fp32 scale per token and ``k^R`` in the compute
  dtype): each token's share of a real cache's bytes (the difference between two lengths)."""
  import jax
  from flax import nnx
  from jaxattn.nn.attention import Attention
  from jaxattn.nn.mla import MLA

  def per_token(layer):
    def size(n):
      return sum(x.nbytes for x in jax.tree.leaves(layer.init_cache(2, n, dtype)))
    return (size(64) - size(32)) // (2 * 32)

  for k in (1, 2, 8):
    attn = Attention(64, num_heads=8, num_kv_heads=k, rngs=nnx.Rngs(0))
    kind = {1: "mqa", 8: "mha"}.get(k, "gqa")
    row = kv_cache_per_token(kind, num_heads=8, head_dim=8, num_kv_heads=k, dtype=dtype)
    assert row.numbers_per_token == 2 * k * 8
    assert row.bytes_per_token == per_token(attn) == kv_cache_bytes_per_token(k, 8, dtype)
    assert row.bytes_per_token == 2 * k * 8 + 8 * k
  for compute in (jnp.float32, jnp.bfloat16):
    mla = MLA(64, 4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, rngs=nnx.Rngs(0),
              dtype=compute)
    row = kv_cache_per_token("mla", num_heads=4, head_dim=16, kv_lora_rank=32,
                             qk_rope_head_dim=8, dtype=dtype, rope_dtype=compute)
    assert row.bytes_per_token == per_token(mla) == mla.cache_bytes(1, dtype=dtype)
    assert row.bytes_per_token == 32 + 4 + 8 * jnp.dtype(compute).itemsize
