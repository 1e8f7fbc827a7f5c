// Fused flash-attention forward for the CPU, as an XLA FFI custom call.
//
// What XLA:CPU cannot do with the chunked path (jaxattn/ops/attention_chunked.py): keep a block of
// logits in cache between the two matmuls and the softmax, and run independent query blocks on the
// cores without synchronizing after every op.  Here one task is (batch row, query head, query
// block): it loads its queries once, then for every key block that the band mask does not empty
//
//   s      = (scale * log2 e) q k^T          register-blocked 8 x 32 tiles, row max on the fly
//   m_new  = max(m, rowmax(s))
//   p      = 2^(s - m_new),  l = 2^(m - m_new) l + rowsum(p)
//   o      = 2^(m - m_new) o + p v            register-blocked 6 x 64 tiles
//
// and finally writes o / l and the natural-log log-sum-exp.  Keys are first packed per KV head
// into 32-column strips of k^T (the layout the q k^T tile reads with unit stride) and values into
// rows padded to a multiple of 16 floats; GQA/MQA query heads read their KV head's packs.  Tasks
// go to XLA's intra-op thread pool, longest query rows first.
//
// Masks: a band `p - left <= j <= p + right` (p = query row + q_offset; causal is left = inf,
// right = 0; a value < 0 means unbounded), which covers causal, sliding-window and full
// attention; optionally segment ids (packed sequences: query and key attend only within equal
// ids) and key lengths per batch row (padding).  Blocks outside the band, past the length or
// sharing no segment id with the query block are skipped; blocks entirely inside all of them are
// computed without a mask.
//
// The vector code uses GCC/Clang vector extensions (16 floats), so it compiles for any target; the
// loader builds it with -march=native.

#include <utility>

#include "common.h"

namespace {

using namespace jaxattn_native;  // NOLINT

// EMPTY / PARTIAL / FULL of the block pair (query rows [t0, t0 + rows), key columns
// [c0, c0 + cols)) under the band, the key length and the segment-id ranges.
enum BlockKind { kEmpty = 0, kPartial = 1, kFull = 2 };

struct Masking {
  Band band;  // s_len: the batch row's key length
  const int32_t* q_seg;  // [T] ids of the batch row, or null
  const int32_t* k_seg;  // [S] ids, or null

  BlockKind Kind(int64_t t0, int64_t rows, int64_t c0, int64_t cols) const {
    const int64_t r0 = t0 + band.q_offset, r1 = t0 + rows - 1 + band.q_offset;
    const int64_t c1 = std::min<int64_t>(c0 + cols, band.s_len) - 1;
    if (c1 < c0 || r1 + band.right < c0 || r0 - band.left > c1) return kEmpty;
    bool full = r1 - band.left <= c0 && r0 + band.right >= c0 + cols - 1 && c0 + cols <= band.s_len;
    if (q_seg) {
      const auto [qlo, qhi] = std::minmax_element(q_seg + t0, q_seg + t0 + rows);
      const auto [klo, khi] = std::minmax_element(k_seg + c0, k_seg + c1 + 1);
      if (*khi < *qlo || *klo > *qhi) return kEmpty;
      full = full && *klo == *khi && *qlo == *qhi && *klo == *qlo;
    }
    return full ? kFull : kPartial;
  }
};

// Sizes and mask inputs of one call, shared by the forward and backward kernels and checked once.
struct Problem {
  int64_t b, t, n, h, s, kh, hv, g, s_pad;
  Band band;                      // s_len = S; per batch row see ForRow
  const int32_t* q_seg = nullptr;  // [B, T] segment ids, or null
  std::vector<int32_t> k_seg;     // [B, s_pad] key segment ids padded with -1, or empty
  const int32_t* lengths = nullptr;  // [B], or null
  const float* slopes = nullptr;     // [V, N] ALiBi slopes (V divides B), or null
  int64_t slope_sets = 1;
  float cap2 = 0.f;  // soft-cap in base-2 units, 0: none

  // ALiBi slope and soft-cap of query head ni in batch row bi, in base-2 units.
  LogitMods Mods(int64_t bi, int64_t ni) const {
    return {slopes ? slopes[(bi / (b / slope_sets)) * n + ni] * kLog2e : 0.f, cap2};
  }

  // The masking of batch row bi: its key length and segment ids.
  Masking ForRow(int64_t bi) const {
    Masking mk{band, q_seg ? q_seg + bi * t : nullptr,
               q_seg ? k_seg.data() + bi * s_pad : nullptr};
    if (lengths) mk.band.s_len = std::max<int64_t>(0, std::min<int64_t>(s, lengths[bi]));
    return mk;
  }
};

// Reads q [.., T, N, H], k [.., S, K, H], v [.., S, K, h] (the leading dims are the batch) and the
// optional mask inputs (size 0 when absent) into `p`; an InvalidArgument error names what is wrong.
ffi::Error ParseProblem(const char* name, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k,
                        ffi::Buffer<ffi::F32>& v, ffi::Buffer<ffi::S32>& q_seg_ids,
                        ffi::Buffer<ffi::S32>& kv_seg_ids, ffi::Buffer<ffi::S32>& kv_lengths,
                        ffi::Buffer<ffi::F32>& alibi_slopes, float soft_cap, int64_t left,
                        int64_t right, int64_t q_offset, int64_t block_q, int64_t block_k,
                        Problem& p) {
  const std::string where(name);
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const size_t rank = qd.size();
  if (rank < 4 || kd.size() != rank || vd.size() != rank)
    return ffi::Error::InvalidArgument(where + ": q, k, v must have one rank >= 4");
  p.b = Prod(qd, 0, rank - 3);
  p.t = qd[rank - 3], p.n = qd[rank - 2], p.h = qd[rank - 1];
  p.s = kd[rank - 3], p.kh = kd[rank - 2], p.hv = vd[rank - 1];
  if (Prod(kd, 0, rank - 3) != p.b || Prod(vd, 0, rank - 3) != p.b || kd[rank - 1] != p.h ||
      vd[rank - 3] != p.s || vd[rank - 2] != p.kh || p.kh <= 0 || p.n % p.kh != 0)
    return ffi::Error::InvalidArgument(where + ": inconsistent q, k, v shapes");
  if (block_q <= 0 || block_q % kQkRows != 0 || block_k <= 0 || block_k % kStrip != 0)
    return ffi::Error::InvalidArgument(
        where + ": block_q must be a positive multiple of 8, block_k of 32");
  p.g = p.n / p.kh;
  p.s_pad = (p.s + kStrip - 1) / kStrip * kStrip;
  const bool segmented = q_seg_ids.element_count() != 0;
  if ((segmented &&
       (q_seg_ids.element_count() != p.b * p.t || kv_seg_ids.element_count() != p.b * p.s)) ||
      (kv_lengths.element_count() != 0 && kv_lengths.element_count() != p.b))
    return ffi::Error::InvalidArgument(where + ": segment ids [B, T] / [B, S], lengths [B]");
  if (segmented) {
    p.q_seg = q_seg_ids.typed_data();
    p.k_seg.assign(p.b * p.s_pad, -1);
    for (int64_t bi = 0; bi < p.b; ++bi)
      std::copy(kv_seg_ids.typed_data() + bi * p.s, kv_seg_ids.typed_data() + (bi + 1) * p.s,
                p.k_seg.begin() + bi * p.s_pad);
  }
  p.lengths = kv_lengths.element_count() ? kv_lengths.typed_data() : nullptr;
  // Slopes [N], or [V, N] when a vmap broadcast them with the V leading dims of the batch.
  if (alibi_slopes.element_count() != 0) {
    p.slope_sets = alibi_slopes.element_count() / std::max<int64_t>(p.n, 1);
    if (alibi_slopes.element_count() % p.n != 0 || p.b % p.slope_sets != 0)
      return ffi::Error::InvalidArgument(where + ": alibi_slopes must be [N] or empty");
    p.slopes = alibi_slopes.typed_data();
  }
  p.cap2 = soft_cap > 0.f ? soft_cap * kLog2e : 0.f;
  const int64_t kUnbounded = int64_t{1} << 40;
  p.band = Band{left < 0 ? kUnbounded : left, right < 0 ? kUnbounded : right, q_offset, p.s};
  return ffi::Error::Success();
}

ffi::Error FlashForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> q_seg_ids,
                        ffi::Buffer<ffi::S32> kv_seg_ids, ffi::Buffer<ffi::S32> kv_lengths,
                        ffi::Buffer<ffi::F32> alibi_slopes, float scale, float soft_cap,
                        int64_t left, int64_t right,
                        int64_t q_offset, int64_t block_q, int64_t block_k,
                        ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  Problem pb;
  if (ffi::Error e = ParseProblem("flash_attention", q, k, v, q_seg_ids, kv_seg_ids, kv_lengths,
                                  alibi_slopes, soft_cap, left, right, q_offset, block_q, block_k,
                                  pb);
      e.failure())
    return e;
  const int64_t b = pb.b, t = pb.t, n = pb.n, h = pb.h, s = pb.s, kh = pb.kh, hv = pb.hv, g = pb.g;
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  float* op = out->typed_data();
  float* lp = lse->typed_data();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (b * t * n == 0) return ffi::Error::Success();
  if (s == 0) {  // no keys: every row is empty
    std::fill(op, op + b * t * n * hv, 0.f);
    std::fill(lp, lp + b * n * t, neg_inf);
    return ffi::Error::Success();
  }

  const int64_t s_pad = pb.s_pad;
  const int64_t strips = s_pad / kStrip;
  const int64_t hv_pad = (hv + kLanes - 1) / kLanes * kLanes;
  const int64_t bq = std::min<int64_t>(block_q, (t + kQkRows - 1) / kQkRows * kQkRows);
  const int64_t bk = std::min<int64_t>(block_k, s_pad);
  const int64_t nq = (t + bq - 1) / bq, nk = (s_pad + bk - 1) / bk;

  // Pack k^T into strips [B, K, strips, H, 32] and v into [B, K, S_pad, hv_pad], zero padded.
  Buf kt = Alloc(b * kh * strips * h * kStrip);
  Buf vpk = Alloc(b * kh * s_pad * hv_pad);
  ParallelFor(pool, b * kh, [&](int64_t idx) {
    const int64_t bi = idx / kh, ki = idx % kh;
    PackStripsT(kp + (bi * s * kh + ki) * h, s, h, kh * h, kt.get() + idx * strips * h * kStrip);
    PackRows(vp + (bi * s * kh + ki) * hv, s, hv, kh * hv, s_pad, hv_pad,
             vpk.get() + idx * s_pad * hv_pad);
  });

  const float q_scale = scale * kLog2e;  // logits in base 2
  const float ln2 = 0.6931471805599453f;

  // Task (query block i, batch row, query head), the longest query rows first under a causal band.
  ParallelFor(pool, nq * b * n, [&](int64_t task) {
    const int64_t i = nq - 1 - task / (b * n);
    const int64_t bi = (task % (b * n)) / n, ni = task % n;
    const int64_t ki = ni / g;
    const int64_t t0 = i * bq, rows = std::min<int64_t>(bq, t - t0);
    const Masking mk = pb.ForRow(bi);
    const LogitMods mods = pb.Mods(bi, ni);
    std::vector<int32_t> qseg(mk.q_seg ? bq : 0, -2);  // the block's ids, padding rows -2
    if (mk.q_seg) std::copy(mk.q_seg + t0, mk.q_seg + t0 + rows, qseg.begin());
    Buf qb = Alloc(bq * h), sb = Alloc(bq * bk), ob = Alloc(bq * hv_pad);
    std::vector<float> m(bq, neg_inf), l(bq, 0.f), alpha(bq, 1.f), mx(bq);
    for (int64_t r = 0; r < bq; ++r) {
      float* dst = qb.get() + r * h;
      if (r < rows) {
        const float* src = qp + ((bi * t + t0 + r) * n + ni) * h;
        for (int64_t d = 0; d < h; ++d) dst[d] = src[d] * q_scale;
      } else {
        std::fill(dst, dst + h, 0.f);
      }
    }
    std::fill(ob.get(), ob.get() + bq * hv_pad, 0.f);
    const float* ktd = kt.get() + (bi * kh + ki) * strips * h * kStrip;
    const float* vd_ = vpk.get() + (bi * kh + ki) * s_pad * hv_pad;
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t c0 = j * bk, cols = std::min<int64_t>(bk, s_pad - c0);
      const BlockKind kind = mk.Kind(t0, rows, c0, cols);
      if (kind == kEmpty) continue;
      vf rowmax[kQkRows];
      for (int64_t rt = 0; rt < bq; rt += kQkRows) {
        for (int r = 0; r < kQkRows; ++r) rowmax[r] = splat(neg_inf);
        for (int64_t st = 0; st < cols / kStrip; ++st) {
          const float* ks = ktd + (c0 / kStrip + st) * h * kStrip;
          float* sd = sb.get() + rt * bk + st * kStrip;
          if (kind == kFull)
            QkTile<false>(qb.get() + rt * h, h, ks, h, sd, bk, rowmax, t0 + rt + q_offset,
                          c0 + st * kStrip, mk.band, nullptr, nullptr, mods);
          else
            QkTile<true>(qb.get() + rt * h, h, ks, h, sd, bk, rowmax, t0 + rt + q_offset,
                         c0 + st * kStrip, mk.band, mk.q_seg ? qseg.data() + rt : nullptr,
                         mk.q_seg ? mk.k_seg + c0 + st * kStrip : nullptr, mods);
        }
        for (int r = 0; r < kQkRows; ++r) mx[rt + r] = hmax(rowmax[r]);
      }
      for (int64_t r = 0; r < bq; ++r) {
        float* row = sb.get() + r * bk;
        float m_new = std::max(m[r], mx[r]);
        // A NaN logit (a NaN query or key) must reach the output, as in the formula, but the
        // vector max drops NaNs: a row that looks empty is checked for one before it is skipped.
        bool row_nan = false;
        if (r < rows && m_new == neg_inf)
          for (int64_t c = 0; c < cols; ++c) row_nan |= std::isnan(row[c]);
        if (row_nan) m_new = std::numeric_limits<float>::quiet_NaN();
        if (r >= rows || (m_new == neg_inf && !row_nan)) {  // padding row, or nothing visible yet
          alpha[r] = 1.f;
          std::fill(row, row + cols, 0.f);
          continue;
        }
        alpha[r] = std::exp2(m[r] - m_new);
        const vf mv = splat(m_new);
        vf sum = vf{};
        for (int64_t c = 0; c < cols; c += kLanes) {
          const vf e = exp2v(load(row + c) - mv);
          store(row + c, e);
          sum += e;
        }
        l[r] = alpha[r] * l[r] + hsum(sum);
        m[r] = m_new;
      }
      PvBlock(sb.get(), bk, cols, vd_ + c0 * hv_pad, hv_pad, ob.get(), hv_pad, alpha.data(),
              hv_pad, bq);
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = op + ((bi * t + t0 + r) * n + ni) * hv;
      const float* src = ob.get() + r * hv_pad;
      const float inv = l[r] != 0.f ? 1.f / l[r] : 0.f;
      for (int64_t c = 0; c < hv; ++c) dst[c] = src[c] * inv;
      lp[(bi * n + ni) * t + t0 + r] = l[r] != 0.f ? (m[r] + std::log2(l[r])) * ln2 : neg_inf;
    }
  });
  return ffi::Error::Success();
}

// Gradients of the forward above (flash-attention-2, probabilities recomputed from the
// log-sum-exp): one task per (batch row, KV head, key block) accumulates
//   dv_j += p^T do_i,   dk_j += scale ds^T q_i,   ds = p (do_i v_j^T - delta_i)
// over the query blocks and the G query heads of the KV head, and adds dq_i += ds k_j into an
// accumulator owned by the thread that runs it (no atomics; the threads' accumulators are summed
// at the end, B N T h fp32 each).  Five block matmuls per block pair, each a register-blocked
// tile; p^T and ds^T are read transposed in place.  delta = rowsum(do * o) minus the log-sum-exp
// cotangent, from the caller.
ffi::Error FlashBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                         ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> d_out,
                         ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta,
                         ffi::Buffer<ffi::S32> q_seg_ids, ffi::Buffer<ffi::S32> kv_seg_ids,
                         ffi::Buffer<ffi::S32> kv_lengths, ffi::Buffer<ffi::F32> alibi_slopes,
                         float scale, float soft_cap, int64_t left, int64_t right,
                         int64_t q_offset, int64_t block_q, int64_t block_k,
                         ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                         ffi::ResultBuffer<ffi::F32> dv) {
  Problem pb;
  if (ffi::Error e = ParseProblem("flash_attention_bwd", q, k, v, q_seg_ids, kv_seg_ids,
                                  kv_lengths, alibi_slopes, soft_cap, left, right, q_offset,
                                  block_q, block_k, pb);
      e.failure())
    return e;
  const int64_t b = pb.b, t = pb.t, n = pb.n, h = pb.h, s = pb.s, kh = pb.kh, hv = pb.hv, g = pb.g;
  if (d_out.element_count() != b * t * n * hv || lse.element_count() != b * n * t ||
      delta.element_count() != b * n * t)
    return ffi::Error::InvalidArgument("flash_attention_bwd: d_out, lse, delta shapes");
  float* dqp = dq->typed_data();
  float* dkp = dk->typed_data();
  float* dvp = dv->typed_data();
  std::fill(dqp, dqp + b * t * n * h, 0.f);
  std::fill(dkp, dkp + b * s * kh * h, 0.f);
  std::fill(dvp, dvp + b * s * kh * hv, 0.f);
  if (b * t * n == 0 || s == 0) return ffi::Error::Success();
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const float* dop = d_out.typed_data();
  const float* lp = lse.typed_data();
  const float* dlp = delta.typed_data();

  const int64_t s_pad = pb.s_pad;
  const int64_t strips = s_pad / kStrip;
  const int64_t h_pad = (h + kLanes - 1) / kLanes * kLanes;
  const int64_t hv_pad = (hv + kLanes - 1) / kLanes * kLanes;
  const int64_t bq = std::min<int64_t>(block_q, (t + kQkRows - 1) / kQkRows * kQkRows);
  const int64_t bk = std::min<int64_t>(block_k, s_pad);
  const int64_t nq = (t + bq - 1) / bq, nk = (s_pad + bk - 1) / bk;

  // Per (batch row, KV head): k^T and v^T strips, key rows padded to h_pad.
  Buf kt = Alloc(b * kh * strips * h * kStrip), vt = Alloc(b * kh * strips * hv * kStrip);
  Buf krows = Alloc(b * kh * s_pad * h_pad);
  ParallelFor(pool, b * kh, [&](int64_t idx) {
    const int64_t bi = idx / kh, ki = idx % kh;
    const float* ksrc = kp + (bi * s * kh + ki) * h;
    PackStripsT(ksrc, s, h, kh * h, kt.get() + idx * strips * h * kStrip);
    PackStripsT(vp + (bi * s * kh + ki) * hv, s, hv, kh * hv, vt.get() + idx * strips * hv * kStrip);
    PackRows(ksrc, s, h, kh * h, s_pad, h_pad, krows.get() + idx * s_pad * h_pad);
  });

  const float q_scale = scale * kLog2e;
  const float inf = std::numeric_limits<float>::infinity();
  const bool segmented = pb.q_seg != nullptr;

  // Loads query block i of head ni: scaled rows (for q k^T), plain rows padded to h_pad (for
  // ds^T q), do rows padded to hv_pad, base-2 lse (+inf for empty and padding rows), delta.
  struct QBlock {
    Buf qs, qr, dob;
    std::vector<float> lse2, dlt;
    std::vector<int32_t> seg;
  };
  auto load_q = [&](QBlock& qb, int64_t bi, int64_t ni, int64_t i) {
    const int64_t t0 = i * bq, rows = std::min<int64_t>(bq, t - t0);
    for (int64_t r = 0; r < bq; ++r) {
      const bool ok = r < rows;
      const float* qsrc = qp + ((bi * t + t0 + r) * n + ni) * h;
      const float* dsrc = dop + ((bi * t + t0 + r) * n + ni) * hv;
      for (int64_t d = 0; d < h; ++d) qb.qs.get()[r * h + d] = ok ? qsrc[d] * q_scale : 0.f;
      for (int64_t d = 0; d < h_pad; ++d) qb.qr.get()[r * h_pad + d] = (ok && d < h) ? qsrc[d] : 0.f;
      for (int64_t d = 0; d < hv_pad; ++d)
        qb.dob.get()[r * hv_pad + d] = (ok && d < hv) ? dsrc[d] : 0.f;
      const float l = ok ? lp[(bi * n + ni) * t + t0 + r] : -inf;
      qb.lse2[r] = std::isfinite(l) ? l * kLog2e : inf;
      qb.dlt[r] = ok ? dlp[(bi * n + ni) * t + t0 + r] : 0.f;
      if (segmented) qb.seg[r] = ok ? pb.q_seg[bi * t + t0 + r] : -2;
    }
  };
  auto new_qblock = [&]() {
    QBlock qb{Alloc(bq * h), Alloc(bq * h_pad), Alloc(bq * hv_pad), std::vector<float>(bq),
              std::vector<float>(bq), std::vector<int32_t>(segmented ? bq : 0)};
    return qb;
  };
  // p and ds of block pair (i, j) into pbuf / dsb ([bq, bk]).
  auto probs = [&](const QBlock& qb, const Masking& mk, BlockKind kind, int64_t bi, int64_t ni,
                   int64_t i, int64_t c0, int64_t cols, float* pbuf, float* dsb) {
    const int64_t ki = ni / g;
    const LogitMods mods = pb.Mods(bi, ni);
    const float* ktd = kt.get() + (bi * kh + ki) * strips * h * kStrip;
    const float* vtd = vt.get() + (bi * kh + ki) * strips * hv * kStrip;
    vf dummy[kQkRows];
    for (int64_t rt = 0; rt < bq; rt += kQkRows) {
      for (int64_t st = 0; st < cols / kStrip; ++st) {
        const int64_t strip = c0 / kStrip + st;
        float* sd = pbuf + rt * bk + st * kStrip;
        if (kind == kFull)
          QkTile<false>(qb.qs.get() + rt * h, h, ktd + strip * h * kStrip, h, sd, bk, dummy,
                        i * bq + rt + q_offset, c0 + st * kStrip, mk.band, nullptr, nullptr,
                        mods);
        else
          QkTile<true>(qb.qs.get() + rt * h, h, ktd + strip * h * kStrip, h, sd, bk, dummy,
                       i * bq + rt + q_offset, c0 + st * kStrip, mk.band,
                       segmented ? qb.seg.data() + rt : nullptr,
                       segmented ? mk.k_seg + c0 + st * kStrip : nullptr, mods);
        QkTile<false>(qb.dob.get() + rt * hv_pad, hv_pad, vtd + strip * hv * kStrip, hv,
                      dsb + rt * bk + st * kStrip, bk, dummy, 0, 0, mk.band);
      }
    }
    for (int64_t r = 0; r < bq; ++r) {
      float* pr = pbuf + r * bk;
      float* dr = dsb + r * bk;
      const vf l2 = splat(qb.lse2[r]), dl = splat(qb.dlt[r]);
      if (pb.cap2 > 0.f) {  // d cap tanh(x / cap) / dx = 1 - tanh^2 (masked: -inf -> 0)
        const vf inv = splat(1.f / pb.cap2), one = splat(1.f);
        for (int64_t c = 0; c < cols; c += kLanes) {
          const vf sv = load(pr + c);
          const vf p = exp2v(sv - l2);
          const vf th = sv * inv;
          const vf th2 = th * th;
          store(pr + c, p);
          store(dr + c, p * (load(dr + c) - dl) * (one - (th2 < one ? th2 : one)));
        }
        continue;
      }
      for (int64_t c = 0; c < cols; c += kLanes) {
        const vf p = exp2v(load(pr + c) - l2);
        store(pr + c, p);
        store(dr + c, p * (load(dr + c) - dl));
      }
    }
  };

  // One pass over key blocks (longest causal columns first): dk, dv of the block, and its dq
  // contribution added to the running thread's own accumulator [B, N, T, h_pad], summed after.
  const int64_t tasks = b * kh * nk;
  const int64_t slots = MaxSlots(pool, tasks);
  const int64_t t_pad = nq * bq;
  Buf dq_acc = Alloc(slots * b * n * t_pad * h_pad);
  std::fill(dq_acc.get(), dq_acc.get() + slots * b * n * t_pad * h_pad, 0.f);
  const int64_t slots_used = ParallelForSlots(pool, tasks, [&](int64_t task, int64_t slot) {
    const int64_t j = task / (b * kh), ki = (task / b) % kh, bi = task % b;
    const Masking mk = pb.ForRow(bi);
    const int64_t c0 = j * bk, cols = std::min<int64_t>(bk, s_pad - c0);
    QBlock qb = new_qblock();
    Buf pbuf = Alloc(bq * bk), dsb = Alloc(bq * bk), dka = Alloc(bk * h_pad), dva = Alloc(bk * hv_pad);
    std::fill(dka.get(), dka.get() + bk * h_pad, 0.f);
    std::fill(dva.get(), dva.get() + bk * hv_pad, 0.f);
    const float* kr = krows.get() + (bi * kh + ki) * s_pad * h_pad;
    float* dq_slot = dq_acc.get() + slot * b * n * t_pad * h_pad;
    for (int64_t gi = 0; gi < g; ++gi) {
      const int64_t ni = ki * g + gi;
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t t0 = i * bq, rows = std::min<int64_t>(bq, t - t0);
        const BlockKind kind = mk.Kind(t0, rows, c0, cols);
        if (kind == kEmpty) continue;
        load_q(qb, bi, ni, i);
        probs(qb, mk, kind, bi, ni, i, c0, cols, pbuf.get(), dsb.get());
        PvBlock<true>(pbuf.get(), bk, bq, qb.dob.get(), hv_pad, dva.get(), hv_pad, nullptr, hv_pad,
                      cols);
        PvBlock<true>(dsb.get(), bk, bq, qb.qr.get(), h_pad, dka.get(), h_pad, nullptr, h_pad,
                      cols);
        // Whole blocks of bq rows (the accumulator's T is padded to nq bq; padding rows of ds
        // are zero).
        PvBlock(dsb.get(), bk, cols, kr + c0 * h_pad, h_pad,
                dq_slot + ((bi * n + ni) * t_pad + t0) * h_pad, h_pad, nullptr, h_pad, bq);
      }
    }
    for (int64_t c = 0; c < std::min<int64_t>(cols, s - c0); ++c) {
      float* dkd = dkp + ((bi * s + c0 + c) * kh + ki) * h;
      float* dvd = dvp + ((bi * s + c0 + c) * kh + ki) * hv;
      for (int64_t d = 0; d < h; ++d) dkd[d] = dka.get()[c * h_pad + d] * scale;
      for (int64_t d = 0; d < hv; ++d) dvd[d] = dva.get()[c * hv_pad + d];
    }
  });

  // dq = scale * (sum of the threads' accumulators).
  ParallelFor(pool, b * n, [&](int64_t idx) {
    const int64_t bi = idx / n, ni = idx % n;
    for (int64_t r = 0; r < t; ++r) {
      float* dst = dqp + ((bi * t + r) * n + ni) * h;
      for (int64_t d = 0; d < h; ++d) {
        float acc = 0.f;
        for (int64_t sl = 0; sl < slots_used; ++sl)
          acc += dq_acc.get()[((sl * b + bi) * n + ni) * t_pad * h_pad + r * h_pad + d];
        dst[d] = acc * scale;
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

// The operands and attributes both attention calls end with, in ParseProblem's order: segment ids
// (query, key), key lengths, ALiBi slopes; scale, soft-cap, band, query offset and tiles.
template <typename Binding>
auto BindMasking(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Attr<float>("scale")
      .template Attr<float>("soft_cap")
      .template Attr<int64_t>("left")
      .template Attr<int64_t>("right")
      .template Attr<int64_t>("q_offset")
      .template Attr<int64_t>("block_q")
      .template Attr<int64_t>("block_k");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxattn_flash_attention_fwd_f32, FlashForward,
                              BindMasking(ffi::Ffi::Bind()
                                              .Ctx<ffi::ThreadPool>()
                                              .Arg<ffi::Buffer<ffi::F32>>()     // q
                                              .Arg<ffi::Buffer<ffi::F32>>()     // k
                                              .Arg<ffi::Buffer<ffi::F32>>())    // v
                                  .Ret<ffi::Buffer<ffi::F32>>()                 // out
                                  .Ret<ffi::Buffer<ffi::F32>>());               // lse

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxattn_flash_attention_bwd_f32, FlashBackward,
                              BindMasking(ffi::Ffi::Bind()
                                              .Ctx<ffi::ThreadPool>()
                                              .Arg<ffi::Buffer<ffi::F32>>()     // q
                                              .Arg<ffi::Buffer<ffi::F32>>()     // k
                                              .Arg<ffi::Buffer<ffi::F32>>()     // v
                                              .Arg<ffi::Buffer<ffi::F32>>()     // d_out
                                              .Arg<ffi::Buffer<ffi::F32>>()     // lse
                                              .Arg<ffi::Buffer<ffi::F32>>())    // delta
                                  .Ret<ffi::Buffer<ffi::F32>>()                 // dq
                                  .Ret<ffi::Buffer<ffi::F32>>()                 // dk
                                  .Ret<ffi::Buffer<ffi::F32>>());               // dv
