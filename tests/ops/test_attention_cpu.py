"""The native CPU attention kernel (``implementation="cpu"``) against the formula.

Forward values and log-sum-exp against the materializing ``"xla"`` path (fp32 and bf16, MHA / GQA
/ MQA, lengths that are not multiples of the blocks, head sizes that are not multiples of the
vector width, causal / one- and two-sided windows / query offsets / rows with no visible key),
gradients, ``jit`` / ``vmap``, the dispatch (auto picks the kernel where it applies, falls back
where it does not), errors, and the 8-device mesh.
"""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxattn import native, sharding
from jaxattn.ops import attention as A
from jaxattn.ops import masks as M
from jaxattn.ops.attention import dot_product_attention
from jaxattn.ops.attention_cpu import cpu_attention, workspace_bytes

if shutil.which("c++") is None and shutil.which("g++") is None and shutil.which("clang++") is None:
  pytest.skip("no C++ compiler on this machine: the native kernel cannot be built",
              allow_module_level=True)


def inputs(b, t, s, n, kh, h, hv, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, t, n, h)).astype(np.float32)
  k = rng.standard_normal((b, s, kh, h)).astype(np.float32)
  v = rng.standard_normal((b, s, kh, hv)).astype(np.float32)
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def test_kernel_is_built():
  assert native.available(), native.reason()
  assert native.reason() == ""
  assert native.library_path().exists()
  # readable by every user sharing the cache directory (it was 0711: mkstemp's 0600 + x bits)
  assert native.library_path().stat().st_mode & 0o755 == 0o755


def test_a_cached_library_that_does_not_load_is_rebuilt(monkeypatch, tmp_path):
  """A damaged or unreadable cached file is compiled again (it disabled the kernels for good)."""
  assert native.available()
  good, calls = native.library_path(), []
  broken = tmp_path / "damaged.so"
  broken.write_bytes(b"not a shared object")

  def build(cxx, *, rebuild=False):
    calls.append(rebuild)
    return good if rebuild else broken        # (the real rebuild would compile for ~45 s)

  monkeypatch.setattr(native, "_build", build)
  monkeypatch.setattr(native, "_state", {})
  assert native.available(), native.reason()
  assert calls == [False, True] and native.library_path() == good


# (B, T, S, N, K, H, h, kwargs, block_q, block_k)
CASES = [
    (2, 100, 100, 4, 2, 64, 64, dict(is_causal=True), 16, 32),  # GQA, 7 x 4 blocks, ragged ends
    (1, 77, 130, 3, 1, 40, 24, dict(), 16, 64),  # MQA, full attention, H and h not multiples of 16
    (1, 200, 200, 2, 2, 32, 80, dict(is_causal=True, local_window_size=30), 24, 32),
    (2, 33, 90, 2, 1, 16, 16, dict(is_causal=True, q_offset=57), 8, 32),  # a chunk after a cache
    (1, 50, 70, 2, 2, 8, 8, dict(local_window_size=(5, 9)), 16, 32),  # two-sided band
    (1, 40, 40, 2, 2, 16, 16, dict(local_window_size=(3, 0), q_offset=-10), 8, 32),  # empty rows
    (1, 300, 300, 2, 1, 64, 64, dict(is_causal=True), None, None),  # default blocks
    (1, 1, 37, 4, 2, 64, 64, dict(is_causal=True, q_offset=36), None, None),  # one decode step
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[1]}S{c[2]}N{c[3]}K{c[4]}H{c[5]}h{c[6]}")
def test_forward_and_lse_match_formula(case):
  b, t, s, n, kh, h, hv, kw, bq, bk = case
  q, k, v = inputs(b, t, s, n, kh, h, hv)
  want, want_lse = dot_product_attention(q, k, v, return_residuals=True, implementation="xla",
                                         **kw)
  mask = A.make_mask(is_causal=kw.get("is_causal", False),
                     local_window_size=kw.get("local_window_size"))
  got, lse = cpu_attention(q, k, v, mask=mask, scale=1 / np.sqrt(h), q_offset=kw.get("q_offset", 0),
                           return_residuals=True, block_q=bq, block_k=bk)
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)
  finite = np.isfinite(np.asarray(want_lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
  np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite], atol=2e-6)
  if not finite.all():  # a row with no visible key gives zeros, not NaN
    rows = ~finite  # [B, N, T]
    assert np.all(np.asarray(got).transpose(0, 2, 1, 3)[rows] == 0)


@pytest.mark.parametrize("kw", [
    dict(is_causal=True, segments=True),  # packed documents: cross-document blocks are skipped
    dict(is_causal=True, lengths=True),  # padded keys
    dict(is_causal=True, local_window_size=17, segments=True, lengths=True),
    dict(segments=True, lengths=True),  # bidirectional, as an encoder over packed sequences
])
def test_segment_ids_and_lengths(kw):
  kw = dict(kw)
  q, k, v = inputs(2, 100, 100, 4, 2, 32, 32, seed=6)
  ids = np.stack([np.repeat([1, 2, 3, 0], [30, 40, 20, 10]), np.repeat([1, 2], [5, 95])])
  if kw.pop("segments", False):
    kw["segment_ids"] = jnp.asarray(ids, jnp.int32)
  if kw.pop("lengths", False):
    kw["kv_lengths"] = jnp.asarray([100, 60], jnp.int32)

  def run(impl):
    def f(q, k, v):
      out, lse = dot_product_attention(q, k, v, return_residuals=True, implementation=impl, **kw)
      return jnp.sum(out * jnp.cos(out)), (out, lse)
    return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)

  (_, (got, lse)), grads = run("cpu")
  (_, (want, want_lse)), want_grads = run("xla")
  np.testing.assert_allclose(got, want, atol=2e-6)
  finite = np.isfinite(np.asarray(want_lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
  np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite], atol=2e-6)
  for g, w in zip(grads, want_grads):
    np.testing.assert_allclose(g, w, atol=2e-5)


def test_bf16_inputs():
  q, k, v = inputs(2, 70, 70, 4, 2, 64, 64, dtype=jnp.bfloat16, seed=1)
  got = dot_product_attention(q, k, v, is_causal=True, implementation="cpu")
  assert got.dtype == jnp.bfloat16
  want = dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), is_causal=True,
                               implementation="xla")
  # Computed in fp32 from the bf16 inputs and rounded once: within one bf16 rounding of the
  # fp32 formula on the same inputs.
  np.testing.assert_allclose(got.astype(jnp.float32), want, atol=1e-2, rtol=1e-2)
  ref_bf16 = dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  err_kernel = np.abs(np.asarray(got, np.float32) - np.asarray(want)).max()
  err_ref = np.abs(np.asarray(ref_bf16, np.float32) - np.asarray(want)).max()
  assert err_kernel <= err_ref + 1e-3


@pytest.mark.parametrize("kw", [
    dict(alibi=True),
    dict(logits_soft_cap=3.0),
    dict(alibi=True, logits_soft_cap=5.0, local_window_size=20, segments=True),
])
def test_alibi_and_soft_cap(kw):
  kw = dict(kw)
  q, k, v = inputs(2, 90, 90, 4, 2, 32, 24, seed=9)
  q = q * 2  # larger logits, so that the soft-cap bends them
  if kw.pop("alibi", False):
    kw["alibi_slopes"] = jnp.asarray(0.5 ** np.arange(1, 5), jnp.float32)
  if kw.pop("segments", False):
    kw["segment_ids"] = jnp.asarray(np.repeat([[1, 2, 3]], 30, axis=1).repeat(2, 0), jnp.int32)

  def run(impl):
    def f(q, k, v):
      out, lse = dot_product_attention(q, k, v, is_causal=True, return_residuals=True,
                                       implementation=impl, **kw)
      return jnp.sum(out * jnp.cos(out)), (out, lse)
    return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)

  (_, (got, lse)), grads = run("cpu")
  (_, (want, want_lse)), want_grads = run("xla")
  np.testing.assert_allclose(got, want, atol=5e-6)
  np.testing.assert_allclose(lse, want_lse, atol=5e-6)
  for g, w in zip(grads, want_grads):
    np.testing.assert_allclose(g, w, atol=5e-5)


def test_bf16_gradients():
  q, k, v = inputs(1, 70, 70, 4, 2, 32, 32, dtype=jnp.bfloat16, seed=8)

  def grads(impl, dtype):
    def f(q, k, v):
      out = dot_product_attention(q, k, v, is_causal=True, implementation=impl)
      return jnp.sum(out.astype(jnp.float32) * jnp.cos(out.astype(jnp.float32)))
    return jax.grad(f, argnums=(0, 1, 2))(*(x.astype(dtype) for x in (q, k, v)))

  got = grads("cpu", jnp.bfloat16)
  want = grads("xla", jnp.float32)  # the formula in fp32 on the same (bf16-exact) inputs
  for g, w in zip(got, want):
    assert g.dtype == jnp.bfloat16
    np.testing.assert_allclose(g.astype(jnp.float32), w, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(local_window_size=(7, 3))])
def test_gradients_match_formula(kw):
  q, k, v = inputs(2, 45, 45, 4, 2, 32, 24, seed=2)

  def loss(impl):
    def f(q, k, v):
      out, lse = dot_product_attention(q, k, v, return_residuals=True, implementation=impl, **kw)
      return jnp.sum(out * jnp.cos(out)) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
    return jax.grad(f, argnums=(0, 1, 2))

  got = loss("cpu")(q, k, v)
  want = loss("xla")(q, k, v)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=0)


def test_jit_vmap_and_one_trace():
  q, k, v = inputs(3, 20, 20, 2, 1, 16, 16, seed=3)
  traces = []

  @jax.jit
  def f(q, k, v):
    traces.append(1)
    return dot_product_attention(q, k, v, is_causal=True, implementation="cpu")

  f(q, k, v)
  f(q + 1, k, v)
  assert len(traces) == 1
  batched = jax.vmap(f)(q[:, None], k[:, None], v[:, None])[:, 0]
  want = dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  np.testing.assert_allclose(batched, want, atol=2e-6)


def test_vmap_with_alibi_segments_and_gradients():
  q, k, v = inputs(3, 20, 20, 2, 1, 16, 16, seed=10)
  slopes = jnp.asarray([0.5, 0.25])
  ids = jnp.asarray(np.repeat([[1, 2]], 10, axis=1), jnp.int32)

  def f(impl):
    def one(q, k, v):
      out = dot_product_attention(q[None], k[None], v[None], is_causal=True, alibi_slopes=slopes,
                                  segment_ids=ids, implementation=impl)
      return jnp.sum(out * jnp.cos(out))
    return jax.vmap(jax.value_and_grad(one, argnums=(0, 1, 2)))

  (got, got_g), (want, want_g) = f("cpu")(q, k, v), f("xla")(q, k, v)
  np.testing.assert_allclose(got, want, rtol=1e-5)  # sums of ~300 terms
  for g, w in zip(got_g, want_g):
    np.testing.assert_allclose(g, w, atol=2e-5)


def test_auto_dispatch_uses_the_kernel_where_it_applies(monkeypatch):
  q, k, v = inputs(1, 24, 24, 2, 2, 16, 16, seed=4)
  A._load_builtin("cpu")
  calls = []
  real = A._REGISTRY["cpu"]

  def spy(*args, **kwargs):
    calls.append(1)
    return real(*args, **kwargs)

  monkeypatch.setitem(A._REGISTRY, "cpu", spy)
  out = dot_product_attention(q, k, v, is_causal=True)
  assert len(calls) == 1
  np.testing.assert_allclose(out, dot_product_attention(q, k, v, is_causal=True,
                                                        implementation="xla"), atol=2e-6)
  # What the kernel does not compute falls back to "xla_chunked", with the same result.
  longformer = M.sliding_window(3, causal=False) | M.GlobalTokensMask((0,))
  for kw in (dict(bias=jnp.ones((1, 2, 24, 24))), dict(mask=longformer),
             dict(mask=jnp.asarray(np.tri(24, dtype=bool))[None, None])):
    got = dot_product_attention(q, k, v, is_causal="mask" not in kw, **kw)
    want = dot_product_attention(q, k, v, is_causal="mask" not in kw, implementation="xla", **kw)
    np.testing.assert_allclose(got, want, atol=2e-6)
  assert len(calls) == 4  # tried every time, accepted once


def test_errors():
  q, k, v = inputs(1, 16, 16, 2, 2, 16, 16)
  with pytest.raises(ValueError, match="does not support bias"):
    dot_product_attention(q, k, v, bias=jnp.zeros((1, 2, 16, 16)), implementation="cpu")
  with pytest.raises(ValueError, match="band masks"):
    dot_product_attention(q, k, v, mask=M.CausalMask() | M.GlobalTokensMask((0,)),
                          implementation="cpu")
  with pytest.raises(ValueError, match="static q_offset"):
    jax.jit(lambda o: dot_product_attention(q, k, v, is_causal=True, q_offset=o,
                                            implementation="cpu"))(jnp.int32(0))
  with pytest.raises(ValueError, match="`block_q` must be a positive multiple of 8, got 12"):
    cpu_attention(q, k, v, scale=0.25, block_q=12)
  with pytest.raises(ValueError, match="`block_k` must be a positive multiple of 32, got 48"):
    cpu_attention(q, k, v, scale=0.25, block_k=48)


def test_disabled_kernel_reports_why(monkeypatch):
  monkeypatch.setattr(native, "_state", {})
  monkeypatch.setenv("JAXATTN_NATIVE", "0")
  assert not native.available()
  assert "JAXATTN_NATIVE=0" in native.reason()
  q, k, v = inputs(1, 16, 16, 2, 2, 16, 16)
  with pytest.raises(ValueError, match="unavailable: disabled by JAXATTN_NATIVE=0"):
    dot_product_attention(q, k, v, implementation="cpu")
  out = dot_product_attention(q, k, v, is_causal=True)  # auto: falls back to xla_chunked
  np.testing.assert_allclose(out, dot_product_attention(q, k, v, is_causal=True,
                                                        implementation="xla"), atol=2e-6)


def test_workspace_is_linear_in_length():
  small = workspace_bytes((1, 1024, 8, 64), (1, 1024, 8, 64), (1, 1024, 8, 64))
  assert small == 4 * 8 * 1024 * 128
  assert workspace_bytes((1, 2048, 8, 64), (1, 2048, 8, 64), (1, 2048, 8, 64)) == 2 * small
  bwd = workspace_bytes((1, 1024, 8, 64), (1, 1024, 8, 64), (1, 1024, 8, 64), backward=True,
                        threads=2)
  assert bwd == 4 * 8 * 1024 * (64 + 64 + 64) + 4 * 2 * 8 * 1024 * 64


def test_sharded_matches_unsharded():
  mesh = sharding.make_mesh({"data": 2, "tensor": 4})
  q, k, v = inputs(2, 40, 40, 8, 4, 16, 16, seed=5)

  ids = jnp.asarray(np.stack([np.repeat([1, 2], [15, 25]), np.repeat([1, 2, 3], [5, 30, 5])]),
                    jnp.int32)

  def loss(q, k, v):
    out = dot_product_attention(q, k, v, is_causal=True, segment_ids=ids, implementation="cpu")
    return jnp.sum(out * jnp.cos(out)), out

  grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  with jax.set_mesh(mesh):
    assert "shard_map" in str(jax.make_jaxpr(grad_fn)(q, k, v))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", None, "tensor", None)))  # noqa
    (_, out), grads = grad_fn(put(q), put(k), put(v))
  assert out.sharding.spec == P("data", None, "tensor", None)

  def ref(q, k, v):
    out = dot_product_attention(q, k, v, is_causal=True, segment_ids=ids, implementation="xla")
    return jnp.sum(out * jnp.cos(out)), out

  (_, want), want_grads = jax.value_and_grad(ref, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  np.testing.assert_allclose(out, want, atol=2e-6)
  for g, w in zip(grads, want_grads):
    np.testing.assert_allclose(g, w, atol=2e-5)
