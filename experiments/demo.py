"""The foundation's mechanisms, end to end, with a short report.

    python -m experiments.demo [--steps 150] [--out runs/demo]

1. Checks each mechanism against its contract (the chunked attention path against the formula,
   GQA/MQA against repeated heads, RoPE's relative-position property, sinusoidal dot products,
   ALiBi's sign, T5 buckets, norm statistics, KV-cache decode against the full pass).
2. Trains a tiny 2-layer decoder (optax AdamW) on a copy task once per positional scheme
   (none, sinusoidal, learned, T5 bias, ALiBi, RoPE, partial RoPE) and reports the loss on the
   copied half: only a model that knows where it is can solve it.
3. Prints the KV-cache table (seed 3.1/3.9) for MHA, GQA, MQA and MLA at a Llama-like size.

Writes ``report.json`` (and ``loss.png`` when matplotlib is installed) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments.cli import choice_list
from jaxattn.kv_efficiency import kv_cache_per_token
from jaxattn.nn.block import TransformerBlock
from jaxattn.nn.positional import LearnedPositionalEmbedding
from jaxattn.ops.alibi import alibi_bias, alibi_slopes
from jaxattn.ops.attention import dot_product_attention
from jaxattn.ops.norms import layer_norm, rms_norm
from jaxattn.ops.rope import apply_rope
from jaxattn.ops.sinusoidal import sinusoidal_positions
from jaxattn.ops.t5_bias import t5_relative_position_bucket

try:
  from tqdm import trange
except ImportError:  # pragma: no cover
  def trange(n, **_):
    return range(n)


# ---------------------------------------------------------------------------------------------
# 1. Contracts
# ---------------------------------------------------------------------------------------------


def check_mechanisms() -> dict:
  r = {}
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (2, 100, 8, 32))
  k = jax.random.normal(ks[1], (2, 100, 2, 32))
  v = jax.random.normal(ks[2], (2, 100, 2, 32))
  ref = dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  r["chunked_vs_formula_max_abs"] = float(jnp.abs(
      dot_product_attention(q, k, v, is_causal=True, implementation="xla_chunked") - ref).max())
  r["gqa_vs_repeated_kv_max_abs"] = float(jnp.abs(dot_product_attention(
      q, jnp.repeat(k, 4, 2), jnp.repeat(v, 4, 2), is_causal=True, implementation="xla") - ref).max())
  r["vs_jax_nn_max_abs"] = float(jnp.abs(
      jax.nn.dot_product_attention(q, k, v, is_causal=True) - ref).max())

  # RoPE: the score of (q at m, k at n) depends only on n - m.
  qv, kv = jax.random.normal(ks[3], (2, 1, 1, 1, 64))
  score = lambda m, n: float(jnp.sum(apply_rope(qv, jnp.array([[m]])) * apply_rope(kv, jnp.array([[n]]))))
  r["rope_score(3,10)"], r["rope_score(103,110)"] = score(3, 10), score(103, 110)
  # Sinusoidal: <PE_m, PE_n> = sum_i cos(w_i (m - n)).
  pe = sinusoidal_positions(jnp.arange(64), 64)
  r["sinusoidal_<PE_5,PE_9>"], r["sinusoidal_<PE_40,PE_44>"] = float(pe[5] @ pe[9]), float(pe[40] @ pe[44])
  # ALiBi: never positive for past tokens.
  bias = alibi_bias(alibi_slopes(8), jnp.arange(16), jnp.arange(16))
  r["alibi_max_bias_on_past_tokens"] = float(jnp.where(jnp.tril(jnp.ones((16, 16), bool)), bias, -1).max())
  r["alibi_slopes_8_heads"] = [round(float(s), 5) for s in alibi_slopes(8)]
  r["t5_buckets(-1,-8,-64,-1000;causal)"] = [int(b) for b in t5_relative_position_bucket(
      jnp.array([-1, -8, -64, -1000]), bidirectional=False)]
  x = jax.random.normal(ks[0], (4, 64)) * 5 + 3
  r["layernorm_mean,var"] = [float(layer_norm(x).mean()), float(layer_norm(x).var())]
  r["rmsnorm_rms"] = float(jnp.sqrt(jnp.mean(rms_norm(x) ** 2)))

  # KV-cache decode equals the full pass.
  blk = TransformerBlock(64, num_heads=8, mlp_dim=128, num_kv_heads=2, rngs=nnx.Rngs(0))
  xs = jax.random.normal(ks[1], (2, 12, 64))
  full = blk(xs)
  cache = blk.init_cache(2, 16)
  y0, cache = blk(xs[:, :4], cache=cache)
  ys = [y0]
  for t in range(4, 12):
    yt, cache = blk(xs[:, t:t + 1], cache=cache)
    ys.append(yt)
  r["decode_vs_full_max_abs"] = float(jnp.abs(jnp.concatenate(ys, 1) - full).max())
  return r


# ---------------------------------------------------------------------------------------------
# 2. A tiny decoder trained with each positional scheme
# ---------------------------------------------------------------------------------------------

SCHEMES = {
    "none": dict(position="none"),
    "sinusoidal": dict(position="none"),
    "learned": dict(position="none"),
    "t5": dict(position="t5", t5_num_buckets=16, t5_max_distance=64),
    "alibi": dict(position="alibi"),
    "rope": dict(position="rope"),
    "partial_rope": dict(position="rope", rotary_dim=8),
}


class TinyLM(nnx.Module):
  def __init__(self, scheme: str, vocab: int, dim: int, layers: int, max_len: int, *, rngs):
    self.scheme = scheme
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.pos = LearnedPositionalEmbedding(max_len, dim, rngs=rngs) if scheme == "learned" else None
    self.blocks = nnx.List([TransformerBlock(dim, num_heads=4, mlp_dim=2 * dim, num_kv_heads=2,
                                             rngs=rngs, **SCHEMES[scheme]) for _ in range(layers)])
    self.head = nnx.Linear(dim, vocab, rngs=rngs)

  def __call__(self, tokens):
    t = tokens.shape[1]
    x = self.embed(tokens)
    if self.scheme == "sinusoidal":
      x = x + sinusoidal_positions(jnp.arange(t), x.shape[-1])
    elif self.pos is not None:
      x = x + self.pos(jnp.arange(t))
    for blk in self.blocks:
      x = blk(x)
    return self.head(rms_norm(x))


def copy_batch(key, batch, half, vocab):
  """[random half | the same half again]: the second half is predictable from position alone."""
  a = jax.random.randint(key, (batch, half), 1, vocab)
  return jnp.concatenate([a, a], axis=1)


def train(scheme, steps, *, seed=0, vocab=32, dim=64, half=16, batch=32):
  model = TinyLM(scheme, vocab, dim, 2, 2 * half, rngs=nnx.Rngs(seed))
  opt = nnx.Optimizer(model, optax.adamw(optax.warmup_cosine_decay_schedule(0, 3e-3, min(20, steps // 5), max(steps, 2)), weight_decay=0.01),
                      wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, tokens):
    def loss_fn(m):
      logits = m(tokens[:, :-1])
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
      return ce[:, half - 1:].mean()  # only the copied half carries signal
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  key = jax.random.key(seed + 1)
  losses = []
  for _ in trange(steps, desc=f"{scheme:>12}", leave=False, disable=None):
    key, sub = jax.random.split(key)
    losses.append(float(step(model, opt, copy_batch(sub, batch, half, vocab))))
  return losses


def kv_table(num_layers=32, num_heads=32, head_dim=128, context=131072):
  """The seed's KV efficiency hierarchy at a Llama-like size (MLA at DeepSeek's d_c=512, d_r=64)."""
  variants = [("mha", {}), ("gqa", dict(num_kv_heads=8)), ("mqa", {}),
              ("mla", dict(kv_lora_rank=512, qk_rope_head_dim=64))]
  rows = []
  for kind, extra in variants:
    cost = kv_cache_per_token(kind, num_heads=num_heads, head_dim=head_dim, **extra)
    rows.append(dict(variant=cost.name, numbers_per_token_per_layer=cost.numbers_per_token,
                     ratio_to_mha=cost.ratio_to_mha,
                     gib_at_context_bf16=num_layers * context * cost.bytes_per_token / 2**30))
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--steps", type=int, default=150)
  ap.add_argument("--schemes", type=choice_list(SCHEMES), default=",".join(SCHEMES),
                  help=f"comma list of {', '.join(SCHEMES)}")
  ap.add_argument("--out", default="runs/demo")
  args = ap.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {jax.device_count()} device(s)\n")

  print("== 1. mechanism contracts")
  checks = check_mechanisms()
  for k, v in checks.items():
    print(f"  {k:40s} {v}")

  print(f"\n== 2. copy task, {args.steps} AdamW steps per positional scheme (loss on the copied half; "
        f"chance = ln(31) = {np.log(31):.2f})")
  curves, t0 = {}, time.time()
  for scheme in args.schemes:
    curves[scheme] = train(scheme, args.steps)
    tail = np.mean(curves[scheme][-10:])
    print(f"  {scheme:>12}: first {curves[scheme][0]:.3f}  final {tail:.3f}")
  print(f"  ({time.time() - t0:.0f} s)")

  print("\n== 3. KV cache per layer and token (Llama-like: 32 layers, 32 heads x 128, 128k context, bf16)")
  table = kv_table()
  print(f"  {'variant':10s} {'numbers/token/layer':>20s} {'vs MHA':>7s} {'GiB @128k':>10s}")
  for r in table:
    print(f"  {r['variant']:10s} {r['numbers_per_token_per_layer']:20d} "
          f"{r['ratio_to_mha']:7.3f} {r['gib_at_context_bf16']:10.1f}")

  report = dict(checks=checks, final_loss={k: float(np.mean(v[-10:])) for k, v in curves.items()},
                curves=curves, kv_cache=table)
  (out / "report.json").write_text(json.dumps(report, indent=1))
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, v in curves.items():
      ax.plot(v, label=k)
    ax.axhline(np.log(31), color="gray", ls=":", label="chance")
    ax.set(xlabel="step", ylabel="loss on copied half", title="copy task by positional scheme")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    print(f"\nwrote {out / 'report.json'} and {out / 'loss.png'}")
  except ImportError:
    print(f"\nwrote {out / 'report.json'} (install matplotlib for the plot)")


if __name__ == "__main__":
  main()
