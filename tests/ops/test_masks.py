import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.ops import masks as M


def test_causal_dense_golden():
  np.testing.assert_array_equal(M.CausalMask().dense(3, 4), np.array(
      [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]], bool))
  # A decode row at offset 2 sees keys 0..2.
  np.testing.assert_array_equal(M.CausalMask().dense(1, 4, q_offset=2), [[1, 1, 1, 0]])


def test_sliding_window_golden():
  # The seed's banded form: radius 1, two-sided.
  np.testing.assert_array_equal(M.sliding_window(1, causal=False).dense(4, 4), np.array(
      [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]], bool))
  np.testing.assert_array_equal(M.sliding_window(1, causal=True).dense(4, 4), np.array(
      [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], bool))


def test_longformer_global_tokens_golden():
  m = M.sliding_window(1, causal=False) | M.GlobalTokensMask((0,))
  np.testing.assert_array_equal(m.dense(5, 5), np.array(
      [[1, 1, 1, 1, 1],
       [1, 1, 1, 0, 0],
       [1, 1, 1, 1, 0],
       [1, 0, 1, 1, 1],
       [1, 0, 0, 1, 1]], bool))
  assert M.GlobalTokensMask.from_bool([True, False, False, True]) == M.GlobalTokensMask((0, 3))


@pytest.mark.parametrize("mask", [
    M.CausalMask(), M.sliding_window(3), M.sliding_window(2, causal=False),
    M.SlidingWindowMask(4, 1), M.sliding_window(2, causal=False) | M.GlobalTokensMask((0, 7)),
    M.CausalMask() & M.sliding_window(5, causal=False), M.FullMask()])
@pytest.mark.parametrize("tq,tk,bq,bk,off", [(13, 13, 4, 4, 0), (13, 17, 8, 3, 0), (5, 21, 2, 8, 9),
                                           (16, 16, 16, 16, 0), (7, 7, 3, 5, 0)])
def test_block_view_matches_dense(mask, tq, tk, bq, bk, off):
  dense = np.asarray(mask.dense(tq, tk, off))
  view = mask.block_view(tq, tk, bq, bk, off)
  assert view.shape == (-(-tq // bq), -(-tk // bk))
  for i in range(view.shape[0]):
    for j in range(view.shape[1]):
      blk = dense[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
      expect = M.FULL if blk.all() else M.PARTIAL if blk.any() else M.EMPTY
      assert view[i, j] == expect, (i, j)


def test_causal_block_view_skips_upper_triangle():
  view = M.CausalMask().block_view(8, 8, 2, 2)
  np.testing.assert_array_equal(view, [[1, 0, 0, 0], [2, 1, 0, 0], [2, 2, 1, 0], [2, 2, 2, 1]])


def test_segment_and_padding_masks():
  seg = jnp.array([[0, 0, 1, 1, 1], [2, 2, 2, 2, 2]])
  m = M.SegmentMask(seg, seg)
  dense = np.asarray(m.dense(5, 5))
  assert dense.shape == (2, 5, 5)
  np.testing.assert_array_equal(dense[0, :2, :2], np.ones((2, 2)))
  assert not dense[0, 0, 2] and dense[1].all()
  pad = M.PaddingMask(jnp.array([3, 5]))
  np.testing.assert_array_equal(np.asarray(pad.dense(2, 5))[0], [[1, 1, 1, 0, 0]] * 2)
  both = M.CausalMask() & m
  np.testing.assert_array_equal(np.asarray(both.dense(5, 5)), np.tril(np.ones((5, 5), bool)) & dense)
  bv = np.asarray(m.block_view(5, 5, 2, 2))
  assert bv.shape == (2, 3, 3)
  assert bv[0, 0, 1] == M.EMPTY and bv[0, 0, 0] == M.FULL and bv[1].min() == M.FULL


def test_masks_are_values():
  assert M.CausalMask() == M.CausalMask() and hash(M.sliding_window(3)) == hash(M.sliding_window(3))
  assert M.sliding_window(3) != M.sliding_window(4)
  with pytest.raises(TypeError, match="no truth value"):
    bool(M.CausalMask())
  # Composed data masks cross jit as pytrees; position masks ride along as static metadata.
  seg = jnp.array([[0, 0, 1]])
  f = jax.jit(lambda m: m.dense(3, 3))
  np.testing.assert_array_equal(np.asarray(f(M.CausalMask() & M.SegmentMask(seg, seg)))[0],
                                [[1, 0, 0], [1, 1, 0], [0, 0, 1]])


def test_mask_errors():
  with pytest.raises(ValueError, match="radius"):
    M.sliding_window(-1)
  with pytest.raises(ValueError, match="left"):
    M.SlidingWindowMask(-2, 0)
  with pytest.raises(ValueError, match="local_window_size"):
    M.make_mask(local_window_size=-3)
  with pytest.raises(ValueError, match="local_window_size"):
    M.make_mask(local_window_size=(1, 2, 3))
  ids = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(ValueError, match=r"`segment_ids` must be one \[B, T\] array or a \(q_ids, "
                     r"kv_ids\) pair, got a tuple of 3"):
    M.make_mask(segment_ids=(ids, ids, ids))
  with pytest.raises(ValueError, match="indices"):
    M.GlobalTokensMask((-1,))
  for bad in ((1.7,), (True,), 3):
    with pytest.raises(ValueError, match="`indices` must be a sequence of non-negative ints"):
      M.GlobalTokensMask(bad)
  assert M.GlobalTokensMask(np.array([3, 1])).indices == (1, 3)
  with pytest.raises(ValueError, match="`left`"):
    M.SlidingWindowMask(True)
  with pytest.raises(ValueError, match="`right`"):
    M.SlidingWindowMask(2, 1.0)


def test_band_block_view_is_cheap_at_long_lengths():
  """Causal / window block views come from block corners, not a dense T x S evaluation."""
  view = M.CausalMask().block_view(131072, 131072, 512, 256)
  assert view.shape == (256, 512)
  assert (view == M.EMPTY).sum() == sum(512 - 2 * (i + 1) for i in range(256))
  assert M._band(M.CausalMask() & M.sliding_window(4, causal=False)) == (4.0, 0.0)
  assert M._band(M.CausalMask() | M.GlobalTokensMask((0,))) is None


def test_bool_window_sizes_are_refused():
  with pytest.raises(ValueError, match="radius"):
    M.sliding_window(True)
  with pytest.raises(ValueError, match="local_window_size"):
    M.make_mask(local_window_size=True)
