"""Multi-token prediction (DeepSeek-V3, section 2.2): ``D`` sequential modules that predict the
tokens after the next one, trained beside the model and reused as its speculative draft.

Module ``k`` (``k = 1 .. D``) at position ``i`` combines the previous depth's representation
``h^{k-1}_i`` (the model's final hidden state for ``k = 1``) with the embedding of the token
``k`` places ahead, runs one transformer block over the sequence, and predicts the token ``k + 1``
places ahead through the model's own output head:

    h'^k_i = W_k [norm(Emb(t_{i+k})); norm(h^{k-1}_i)]           (embedding first, as the
    h^k    = Block_k(h'^k)    (causal over i)                     published checkpoints)
    P^k_i  = softmax(Head(norm_k(h^k_i)))  predicts  t_{i+k+1}

The embedding table and the head are the model's (shared); each module owns its two input norms,
the projection ``W_k [2D, D]``, one block (the kind of the model's last layer, its MoE included;
a Gated DeltaNet last layer gives an attention block) and its output norm.  Training adds
``mtp_loss_weight / D * sum_k CE_k`` to the next-token loss (``jaxattn.train.step.loss_fn``);
inference may drop the modules or use depth 1 as the draft of self-speculative decoding
(``speculative_generate(model, prompt, n, draft="mtp")``).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxattn.nn.linear import Einsum
from jaxattn.nn.norms import make_norm


def shift_left(x, k: int):
  """``x [B, T, ...]`` moved ``k`` places left along ``T``, zeros shifted in at the end: entry
  ``i`` is ``x[:, i + k]`` (depth ``k``'s input token at position ``i``, and the like)."""
  t = x.shape[1]
  pad = ((0, 0), (0, min(k, t))) + ((0, 0),) * (x.ndim - 2)
  return jnp.pad(x[:, k:], pad)[:, :t]


def mtp_layer_kind(cfg) -> tuple[str, bool]:
  """``(mixer letter, is_moe)`` of the MTP modules' block: the model's last layer's, with an
  attention block in place of a Gated DeltaNet one (a draft's cache must be rewindable)."""
  kind, moe = cfg.layer_kind(cfg.num_layers - 1)
  return ("A" if kind == "D" else kind), moe


class MTPModule(nnx.Module):
  """One prediction depth (module docstring): ``(h_prev [B, T, D], e [B, T, D]) -> (h, cache,
  aux)``, ``e`` the embeddings of the tokens ``k`` places ahead; logits are
  ``model.head(module.norm(h))``."""

  def __init__(self, cfg, depth: int, *, rngs: nnx.Rngs):
    from jaxattn.nn.model import DecoderLayer   # (model.py imports this module)
    d, pdt = cfg.embed_dim, cfg.parameter_dtype
    self.depth = depth

    def norm():
      return make_norm(cfg.norm, d, eps=cfg.norm_eps, rngs=rngs, param_dtype=pdt)

    self.embed_norm = norm()
    self.hidden_norm = norm()
    self.proj = Einsum("BTE,ED->BTD", (2 * d, d), (None, "embed"), rngs=rngs,
                       dtype=cfg.compute_dtype, param_dtype=pdt)
    kind, moe = mtp_layer_kind(cfg)
    self.layer = DecoderLayer(cfg, kind, moe, layer_index=cfg.num_layers + depth - 1, rngs=rngs)
    self.norm = norm()

  def init_cache(self, batch: int, max_len: int, dtype=None):
    """The block's decode cache (a ``KVCache`` / ``LatentCache`` / ``DSACache``)."""
    return self.layer.init_cache(batch, max_len, dtype)

  def __call__(self, h_prev, e, *, positions, segment_ids=None, cache=None, want_aux=False,
               num_tokens=None):
    dtype = e.dtype
    x = jnp.concatenate([self.embed_norm(e).astype(dtype),
                         self.hidden_norm(h_prev).astype(dtype)], axis=-1)
    return self.layer(self.proj(x), positions=positions, segment_ids=segment_ids, cache=cache,
                      want_aux=want_aux, num_tokens=num_tokens)
