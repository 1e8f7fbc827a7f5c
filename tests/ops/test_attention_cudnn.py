"""The cuDNN backend (``implementation="cudnn"``): its mapping onto ``jax.nn``, what it declines,
and where automatic dispatch puts it.

Without a GPU the mapping is checked by running the very call the backend makes with ``jax.nn``'s
``implementation="xla"`` instead of ``"cudnn"`` (one function, one contract, two backends) against
our formula, forward and gradients; ``experiments/device_check.sh`` runs the real cuDNN call on a
GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn.ops.attention as A
import jaxattn.ops.attention_cudnn as CU
from jaxattn.ops.attention import dot_product_attention as dpa


class _Device:
  def __init__(self, cc, kind="GPU"):
    self.compute_capability, self.device_kind = cc, kind


@pytest.mark.parametrize("cc, ok", [("9.0", True), ("8.0", True), ("8.9", True), ("10.0", True),
                                    ("7.5", False), ("6.1", False), (None, False),
                                    ("gfx90a", False)])
def test_nvidia_reason(cc, ok):
  why = CU.nvidia_reason(_Device(cc, "Tesla T4"))
  assert (why is None) == ok, why
  if not ok:
    assert "Tesla T4" in why and "sm_80" in why


@pytest.fixture
def as_if_on_gpu(monkeypatch):
  """The backend on an sm_90 device whose jax.nn cuDNN call is jax.nn's XLA one; records the
  keyword arguments of every call."""
  calls = []
  real = jax.nn.dot_product_attention

  def xla_instead(*args, implementation=None, **kwargs):
    assert implementation == "cudnn"
    calls.append(kwargs)
    return real(*args, implementation="xla", **kwargs)

  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(CU, "nvidia_reason", lambda device=None: None)   # an sm_90 device
  monkeypatch.setattr(jax.nn, "dot_product_attention", xla_instead)
  return calls


def _qkv(b=2, t=37, s=37, n=4, k=2, h=32, dtype=jnp.bfloat16, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(dtype)
  key = jax.random.normal(ks[1], (b, s, k, h), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (b, s, k, h), jnp.float32).astype(dtype)
  return q, key, v


CASES = [
    # name, qkv kwargs, dot_product_attention kwargs, the jax.nn arguments expected
    ("no mask gqa", {}, {}, {}),
    ("causal", {}, dict(is_causal=True), dict(is_causal=True)),
    ("causal window", {}, dict(is_causal=True, local_window_size=5),
     dict(is_causal=True, local_window_size=(5, 0))),
    ("left window pair", {}, dict(local_window_size=(7, 0)),
     dict(is_causal=True, local_window_size=(7, 0))),
    ("cross attention mqa", dict(t=9, s=41, k=1), {}, {}),
    ("fp16 scale mha", dict(k=4, dtype=jnp.float16), dict(scale=0.3, is_causal=True),
     dict(is_causal=True)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_mapping_matches_formula(as_if_on_gpu, case):
  """Forward and gradients of the mapped call equal our formula on the same mask."""
  name, shape, kw, expected = case
  q, k, v = _qkv(**shape)
  d_out = jax.random.normal(jax.random.key(3), q.shape, jnp.float32).astype(q.dtype)

  def loss(impl):
    def f(q, k, v):
      out = dpa(q, k, v, implementation=impl, **kw)
      return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)), out
    return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)

  (_, out), grads = loss("cudnn")
  called = dict(as_if_on_gpu[-1])
  assert called.pop("scale") == pytest.approx(kw.get("scale", 32 ** -0.5)) and called == expected
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  (_, want), want_grads = loss("xla")
  assert out.shape == q.shape and out.dtype == q.dtype
  np.testing.assert_allclose(f32(out), f32(want), atol=2e-2, rtol=0, err_msg=name)
  for g, w, label in zip(grads, want_grads, "qkv"):
    assert g.dtype == w.dtype
    np.testing.assert_allclose(f32(g), f32(w), atol=5e-2, rtol=0, err_msg=f"{name} d{label}")


DECLINED = [
    # name, qkv kwargs, dot_product_attention kwargs, message
    ("fp32", dict(dtype=jnp.float32), {}, "bf16 / fp16"),
    ("segments", {}, dict(segment_ids=jnp.zeros((2, 37), jnp.int32)), "AndMask|SegmentMask"),
    ("kv lengths", {}, dict(is_causal=True, kv_lengths=jnp.array([30, 37])), "AndMask"),
    ("two-sided window", {}, dict(local_window_size=4), "to the right"),
    ("alibi", {}, dict(alibi_slopes=jnp.ones((4,))), "alibi_slopes"),
    ("soft-cap", {}, dict(logits_soft_cap=30.0), "logits_soft_cap"),
    ("residuals", {}, dict(return_residuals=True), "return_residuals"),
    ("bias", {}, dict(bias=jnp.zeros((1, 4, 37, 37), jnp.bfloat16)), "dense `bias`"),
    ("mask array", {}, dict(mask=jnp.ones((1, 1, 37, 37), bool)), "boolean `mask` array"),
    ("q offset", dict(t=5), dict(is_causal=True, q_offset=32), "q_offset"),
    ("causal cross lengths", dict(t=9, s=41), dict(is_causal=True), "T == S"),
]


@pytest.mark.parametrize("case", DECLINED, ids=[c[0] for c in DECLINED])
def test_declines_what_cudnn_does_not_compute(as_if_on_gpu, monkeypatch, case):
  """An explicit request says why; automatic dispatch moves on (here to the XLA path, the Pallas
  kernel being mocked away) and gives the formula's result."""
  name, shape, kw, message = case
  q, k, v = _qkv(**shape)
  with pytest.raises(A.UnsupportedError, match=message):
    dpa(q, k, v, implementation="cudnn", **kw)
  monkeypatch.setattr(A, "_auto_order", lambda: ["cudnn", "xla_chunked"])
  got = dpa(q, k, v, **kw)
  want = dpa(q, k, v, implementation="xla", **kw)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=2e-2)
  assert not as_if_on_gpu


def test_value_head_size_and_jax_refusals(as_if_on_gpu, monkeypatch):
  q, k, _ = _qkv()
  v = jnp.zeros(k.shape[:3] + (16,), k.dtype)
  with pytest.raises(A.UnsupportedError, match="value head size"):
    dpa(q, k, v, implementation="cudnn")

  def refuse(*args, **kwargs):
    raise NotImplementedError("Unsupported head_dim: 33")

  monkeypatch.setattr(jax.nn, "dot_product_attention", refuse)
  with pytest.raises(A.UnsupportedError, match="head_dim: 33"):
    dpa(*_qkv(), implementation="cudnn")


def test_traced_scale_and_offset_decline(as_if_on_gpu):
  q, k, v = _qkv()
  with pytest.raises(A.UnsupportedError, match="static"):
    jax.jit(lambda s: dpa(q, k, v, scale=s, implementation="cudnn"))(0.2)
  with pytest.raises(A.UnsupportedError, match="q_offset"):
    jax.jit(lambda o: dpa(q, k, v, q_offset=o, is_causal=True, implementation="cudnn"))(0)


def test_on_this_machine():
  """On an sm_80+ GPU the real cuDNN call (forward and gradients) equals the formula; anywhere else
  an explicit request says it needs one.  (128 tokens: jax 0.11's cuDNN path refuses a causal
  window over 37 tokens, which the backend turns into UnsupportedError.)"""
  q, k, v = _qkv(t=128, s=128)
  if jax.default_backend() not in ("gpu", "cuda") or CU.nvidia_reason() is not None:
    with pytest.raises(ValueError, match="needs an NVIDIA GPU|compute capability"):
      dpa(q, k, v, implementation="cudnn")
    return

  def loss(impl):
    return jax.value_and_grad(
        lambda q, k, v: jnp.sum(dpa(q, k, v, is_causal=True, local_window_size=9,
                                    implementation=impl).astype(jnp.float32) ** 2),
        argnums=(0, 1, 2))(q, k, v)

  (got, grads), (want, want_grads) = jax.jit(loss, static_argnums=0)("cudnn"), loss("xla")
  np.testing.assert_allclose(float(got), float(want), rtol=2e-2)
  for g, w in zip(grads, want_grads):
    # bf16 gradients of size ~10: one bf16 step there is 0.0625 (seen on an H200)
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=5e-2,
                               rtol=2e-2)


def test_old_gpus_decline(monkeypatch):
  """On a GPU older than sm_80 (a Colab T4) cuDNN's flash attention and the Triton kernels
  decline with UnsupportedError, so an explicit request says why and automatic dispatch computes
  with the XLA path instead."""
  from pallas_kernels.flash_attention import flash_attention_gpu  # noqa: PLC0415
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jax, "devices", lambda *a: [_Device("7.5", "Tesla T4")])
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="compute capability 7.5"):
    dpa(q, k, v, implementation="cudnn")
  q, k, v = _qkv(dtype=jnp.float32)
  with pytest.raises(A.UnsupportedError, match="compute capability 7.5"):
    flash_attention_gpu(q, k, v)
  with pytest.raises(ValueError, match="'Tesla T4' has compute capability 7.5"):
    dpa(q, k, v, is_causal=True, implementation="pallas_gpu")
  assert A._auto_order() == ["cudnn", "pallas_gpu", "xla_chunked"]
  with jax.default_matmul_precision("highest"):  # on a real GPU, not TF32 in either path
    out = dpa(q, k, v, is_causal=True)   # cuDNN and Triton decline: XLA
    want = dpa(q, k, v, is_causal=True, implementation="xla")
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_auto_order_per_platform(monkeypatch):
  for platform, order in (("gpu", ["cudnn", "pallas_gpu", "xla_chunked"]),
                          ("tpu", ["pallas_tpu", "xla_chunked"]),
                          ("cpu", ["cpu", "xla_chunked"])):
    monkeypatch.setattr(jax, "default_backend", lambda p=platform: p)
    assert A._auto_order() == order
  assert "cudnn" in A.IMPLEMENTATIONS


def test_under_a_mesh_runs_sharded(as_if_on_gpu):
  """Under ``jax.set_mesh`` (the simulated 8 devices) the call runs in ``shard_map`` with batch
  over ``data`` and heads over ``tensor``; forward and gradients equal the unsharded formula."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

  from jaxattn import sharding  # noqa: PLC0415
  mesh = sharding.make_mesh({"data": 2, "tensor": 4}, devices=jax.devices("cpu"))  # also on a GPU
  q, k, v = _qkv(b=2, t=24, s=24, n=8, k=4)

  def loss(impl):
    def f(q, k, v):
      out = dpa(q, k, v, is_causal=True, implementation=impl)
      return jnp.sum(out.astype(jnp.float32) ** 2), out
    return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)

  with jax.set_mesh(mesh):
    assert "shard_map" in str(jax.make_jaxpr(loss("cudnn"))(q, k, v))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", None, "tensor", None)))  # noqa
    (_, out), grads = jax.jit(loss("cudnn"))(put(q), put(k), put(v))
  assert out.sharding.spec == P("data", None, "tensor", None)
  (_, want), want_grads = loss("xla")(q, k, v)
  f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
  np.testing.assert_allclose(f32(out), f32(want), atol=2e-2)
  for g, w in zip(grads, want_grads):   # bf16 gradients: a few ulps of their magnitude
    np.testing.assert_allclose(f32(g), f32(w), atol=2e-2 * max(1.0, np.abs(f32(w)).max()))


def test_explain_dispatch_on_a_gpu(as_if_on_gpu):
  """Which backend automatic dispatch takes on an sm_90 GPU, and why the ones before declined."""
  q, k, v = _qkv()
  assert A.explain_dispatch(q, k, v, is_causal=True) == ("cudnn", {})
  ids = jnp.zeros((2, 37), jnp.int32)
  chosen, why = A.explain_dispatch(q, k, v, is_causal=True, segment_ids=ids)
  assert chosen == "pallas_gpu" and list(why) == ["cudnn"] and "AndMask" in why["cudnn"]
  chosen, why = A.explain_dispatch(q, k, v, bias=jnp.zeros((1, 4, 37, 37), q.dtype))
  assert chosen == "pallas_gpu" and list(why) == ["cudnn"] and "bias" in why["cudnn"]
  # an OrMask with a data-dependent side: no kernel evaluates it
  from jaxattn.ops.masks import CausalMask, SegmentMask  # noqa: PLC0415
  chosen, why = A.explain_dispatch(q, k, v, mask=CausalMask() | SegmentMask(ids, ids))
  assert chosen == "xla_chunked" and list(why) == ["cudnn", "pallas_gpu"]
  assert "OrMask" in why["pallas_gpu"]
  with pytest.raises(ValueError, match="explain_dispatch finds"):
    A.explain_dispatch(q, k, v, implementation="xla")


def test_explain_dispatch_on_this_cpu():
  """On CPU: the native kernel where it computes the call (else why not), then xla_chunked."""
  import jaxattn  # noqa: PLC0415
  from jaxattn import native  # noqa: PLC0415
  q, k, v = _qkv(dtype=jnp.float32)
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU order; the GPU order is checked above")
  chosen, why = jaxattn.explain_dispatch(q, k, v, is_causal=True)
  if native.available():
    assert (chosen, why) == ("cpu", {})
  else:
    assert chosen == "xla_chunked" and list(why) == ["cpu"]
  chosen, why = jaxattn.explain_dispatch(q, k, v, bias=jnp.zeros((1, 4, 37, 37)))
  assert chosen == "xla_chunked" and list(why) == ["cpu"]
