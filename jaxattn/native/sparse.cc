// DeepSeek Sparse Attention on the CPU, as XLA FFI custom calls: the lightning indexer with its
// top-k selection, and attention over the selected positions.
//
// Indexer + top-k (jaxattn_indexer_topk_f32).  One task is (batch row, block of query rows).  For
// each block of visible keys it computes the scores
//
//   I[t, s] = k_scale[s] * sum_j w[t, j] * ReLU(q[t, j] . k[s])
//
// with register-blocked 8 x 32 tiles over keys packed as k^T strips (the q k^T tile of the flash
// kernel, one indexer head at a time, the ReLU-weighted sum accumulated in the cache-resident score
// tile), then streams each row's scores through its candidate set: a score enters only when it beats
// the current threshold (AVX-512 compare masks, 16 keys per instruction), and when the set reaches
// 4k entries it is cut back to its best k, whose worst score becomes the new threshold.  On random
// scores about k ln(S / k) candidates per row ever enter.  Candidates are 64-bit keys
// (order-preserving score bits, then the complement of the position), so a plain integer order is
// "higher score first, ties to the lower position" -- the order of `lax.top_k` -- and keys are
// visited in increasing position, so a later key that ties the threshold always loses (strict
// comparison is exact).  Rows keep at most k positions (-1 padding), in score or position order.
//
// Sparse attention (jaxattn_sparse_attention_f32).  One task is (batch row, 16 query rows); for each
// KV head it gathers the selected key rows into k^T strips and the value rows into a packed block,
// then runs the flash kernel's tiles on the G query heads of that KV head: q k^T, a base-2 softmax,
// p v.  Slots < 0 (or >= S) are skipped; a row with none gives zeros.

#include "common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using namespace jaxattn_native;  // NOLINT

// Order-preserving unsigned image of a float: a < b  <=>  Ordered(a) < Ordered(b) (and +0 > -0,
// which never arise here: scores start from +0).
inline uint32_t Ordered(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

inline float FromOrdered(uint32_t u) {
  const uint32_t bits = (u & 0x80000000u) ? (u & 0x7FFFFFFFu) : ~u;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// The k-th largest of u[0:n] (1 <= k <= n) by radix selection, most significant digit first:
// digits start below the bits all values share, each pass histograms only the values still in
// play (four interleaved histograms, so runs of one digit do not serialize on a counter) and
// keeps those of the chosen digit in `tmp` (capacity n).  `*equal_kept` gets how many of the k
// largest equal the result.
inline uint32_t KthLargest(const uint32_t* u, int64_t n, int64_t k, uint32_t* tmp,
                           int64_t* equal_kept) {
  uint32_t all_and = ~0u, all_or = 0u;
  for (int64_t i = 0; i < n; ++i) {
    all_and &= u[i];
    all_or |= u[i];
  }
  const uint32_t varying = all_and ^ all_or;
  if (varying == 0) {  // all equal
    *equal_kept = k;
    return u[0];
  }
  int bits = 32 - __builtin_clz(varying);
  uint32_t prefix = bits == 32 ? 0u : (all_and >> bits) << bits;  // the shared high bits
  int64_t need = k, m = n;
  const uint32_t* src = u;
  while (bits > 0) {
    const int d = bits < 8 ? bits : 8;
    const int shift = bits - d;
    const uint32_t dmask = (1u << d) - 1;
    int32_t counts[4][256] = {};
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) {
      counts[0][(src[i] >> shift) & dmask]++;
      counts[1][(src[i + 1] >> shift) & dmask]++;
      counts[2][(src[i + 2] >> shift) & dmask]++;
      counts[3][(src[i + 3] >> shift) & dmask]++;
    }
    for (; i < m; ++i) counts[0][(src[i] >> shift) & dmask]++;
    uint32_t digit = dmask;
    int64_t c = 0;
    for (;; --digit) {
      c = counts[0][digit] + counts[1][digit] + counts[2][digit] + counts[3][digit];
      if (c >= need || digit == 0) break;
      need -= c;
    }
    prefix |= digit << shift;
    int64_t out = 0;
    for (int64_t j = 0; j < m; ++j) {
      tmp[out] = src[j];
      out += ((src[j] >> shift) & dmask) == digit;
    }
    m = out;
    src = tmp;
    bits = shift;
  }
  *equal_kept = need;
  return prefix;
}

// A candidate set is cut back to k entries when it holds kCapacity k: 4 cuts about half as often
// as 2 over a 16k-key row (2k + k ln(S / 2k) entries ever enter), measured 0.33 s -> 0.26 s for
// the selection at T = 16k; 8 gains nothing more.
constexpr int64_t kCapacity = 4;

// The candidate set of one query row, in increasing position order (keys are offered in that
// order and cuts are stable).
struct Candidates {
  uint32_t* score;  // ordered images of the scores, capacity kCapacity k + 16
  int32_t* pos;
  uint32_t* tmp;  // scratch, capacity kCapacity k + 16
  int64_t count;
  float thr;  // a score must be > thr to enter (-inf: anything finite)

  // Keeps the k best (higher score first, ties to the lower position = the earlier entry).
  void Cut(int64_t k) {
    if (count <= k) return;
    int64_t equal_kept;
    const uint32_t kth = KthLargest(score, count, k, tmp, &equal_kept);
    int64_t out = 0;
    for (int64_t i = 0; i < count; ++i) {
      const uint32_t u = score[i];
      const bool keep = u > kth || (u == kth && equal_kept-- > 0);
      score[out] = u;
      pos[out] = pos[i];
      out += keep;
    }
    count = k;
    thr = FromOrdered(kth);
  }

  inline void Push(float s, int64_t p, int64_t k) {
    if (!(s > thr)) return;
    score[count] = Ordered(s);
    pos[count] = static_cast<int32_t>(p);
    if (++count >= kCapacity * k) Cut(k);
  }
};

// Streams scores row[0:n] (positions col0 + i) through the candidate set.  With AVX-512 the
// scores above the threshold are appended with compress instructions, 16 keys at a time and
// without a branch per accepted key (accepted keys are scattered, so per-key branches would
// mispredict on almost every one).
inline void FilterRow(const float* row, const float* k_scale, int64_t n, int64_t col0,
                      Candidates& cand, int64_t k) {
  int64_t c = 0;
#if defined(__AVX512F__)
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  __m512 thr = _mm512_set1_ps(cand.thr);
  for (; c + kLanes <= n; c += kLanes) {
    __m512 v = _mm512_loadu_ps(row + c);
    if (k_scale) v = _mm512_mul_ps(v, _mm512_loadu_ps(k_scale + c));
    const __mmask16 m = _mm512_cmp_ps_mask(v, thr, _CMP_GT_OQ);
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i ordered = _mm512_xor_si512(bits, _mm512_or_si512(_mm512_srai_epi32(bits, 31), sign));
    const __m512i positions = _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(col0 + c)));
    _mm512_storeu_si512(cand.score + cand.count, _mm512_maskz_compress_epi32(m, ordered));
    _mm512_storeu_si512(cand.pos + cand.count, _mm512_maskz_compress_epi32(m, positions));
    cand.count += __builtin_popcount(m);
    if (cand.count >= kCapacity * k) {
      cand.Cut(k);
      thr = _mm512_set1_ps(cand.thr);
    }
  }
#endif
  for (; c < n; ++c) cand.Push(k_scale ? row[c] * k_scale[c] : row[c], col0 + c, k);
}

// sc[r, 0:32] += sum_j w[r, j] ReLU(q[r, j, :] . kt[:, 0:32]) for kQkRows rows.
inline void IndexTile(const float* q, int64_t ldq, int64_t hi, int64_t d, const float* w,
                      const float* kt, float* sc, int64_t lds) {
  for (int64_t j = 0; j < hi; ++j) {
    vf acc[kQkRows][2];
    DotTile(q + j * d, ldq, kt, d, acc);
    const vf zero = vf{};
#pragma GCC unroll 8
    for (int r = 0; r < kQkRows; ++r) {
      const vf wr = splat(w[r * hi + j]);
      float* s = sc + r * lds;
      store(s, load(s) + wr * vmax(acc[r][0], zero));
      store(s + kLanes, load(s + kLanes) + wr * vmax(acc[r][1], zero));
    }
  }
}

ffi::Error IndexerTopk(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> keys,
                       ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> k_scale,
                       ffi::Buffer<ffi::S32> q_offset, ffi::Buffer<ffi::S32> lengths, int64_t k,
                       int64_t by_position, int64_t block_q, int64_t block_k,
                       ffi::ResultBuffer<ffi::S32> out) {
  const auto qd = q.dimensions(), kd = keys.dimensions();
  if (qd.size() != 4 || kd.size() != 3)
    return ffi::Error::InvalidArgument("indexer_topk: q [B, T, HI, d], keys [B, S, d]");
  const int64_t b = qd[0], t = qd[1], hi = qd[2], d = qd[3], s = kd[1];
  if (kd[0] != b || kd[2] != d || w.element_count() != b * t * hi ||
      (k_scale.element_count() != 0 && k_scale.element_count() != b * s) ||
      q_offset.element_count() != 1 || lengths.element_count() != b)
    return ffi::Error::InvalidArgument("indexer_topk: inconsistent operand shapes");
  if (k <= 0 || block_q <= 0 || block_q % kQkRows || block_k <= 0 || block_k % kStrip)
    return ffi::Error::InvalidArgument("indexer_topk: bad k or block sizes");
  int32_t* op = out->typed_data();
  std::fill(op, op + b * t * k, -1);
  if (b * t == 0 || s == 0) return ffi::Error::Success();
  const float* qp = q.typed_data();
  const float* kp = keys.typed_data();
  const float* wp = w.typed_data();
  const float* ks = k_scale.element_count() ? k_scale.typed_data() : nullptr;
  const int64_t offset = q_offset.typed_data()[0];
  const int32_t* lens = lengths.typed_data();

  const int64_t strips = (s + kStrip - 1) / kStrip;
  Buf kt = Alloc(b * strips * d * kStrip);
  ParallelFor(pool, b, [&](int64_t bi) {
    PackStripsT(kp + bi * s * d, s, d, d, kt.get() + bi * strips * d * kStrip);
  });

  const int64_t bq = std::min<int64_t>(block_q, (t + kQkRows - 1) / kQkRows * kQkRows);
  const int64_t nq = (t + bq - 1) / bq;
  const int64_t ldq = hi * d;
  ParallelFor(pool, b * nq, [&](int64_t task) {
    const int64_t i = nq - 1 - task / b, bi = task % b;  // longest rows first
    const int64_t t0 = i * bq, rows = std::min<int64_t>(bq, t - t0);
    const int64_t len = std::min<int64_t>(std::max<int32_t>(lens[bi], 0), s);
    // Keys visible to row r: [0, min(offset + t0 + r + 1, len)).
    auto visible = [&](int64_t r) {
      return std::max<int64_t>(0, std::min<int64_t>(offset + t0 + r + 1, len));
    };
    const int64_t last = visible(rows - 1);
    Buf qb = Alloc(bq * ldq), wb = Alloc(bq * hi), sc = Alloc(bq * block_k);
    std::fill(qb.get(), qb.get() + bq * ldq, 0.f);
    std::fill(wb.get(), wb.get() + bq * hi, 0.f);
    std::memcpy(qb.get(), qp + (bi * t + t0) * ldq, rows * ldq * sizeof(float));
    std::memcpy(wb.get(), wp + (bi * t + t0) * hi, rows * hi * sizeof(float));
    const int64_t cap = kCapacity * k + kLanes;
    std::vector<uint32_t> score_buf(bq * cap);
    std::vector<int32_t> pos_buf(bq * cap);
    std::vector<uint32_t> tmp_buf(cap);
    std::vector<Candidates> cand(bq);
    for (int64_t r = 0; r < bq; ++r)
      cand[r] = Candidates{score_buf.data() + r * cap, pos_buf.data() + r * cap, tmp_buf.data(), 0,
                           -std::numeric_limits<float>::infinity()};
    const float* ktb = kt.get() + bi * strips * d * kStrip;
    for (int64_t c0 = 0; c0 < last; c0 += block_k) {
      const int64_t cols = std::min<int64_t>(block_k, last - c0);
      const int64_t tile_strips = (cols + kStrip - 1) / kStrip;
      std::fill(sc.get(), sc.get() + bq * block_k, 0.f);
      for (int64_t rt = 0; rt < rows; rt += kQkRows) {
        for (int64_t st = 0; st < tile_strips; ++st)
          IndexTile(qb.get() + rt * ldq, ldq, hi, d, wb.get() + rt * hi,
                    ktb + (c0 / kStrip + st) * d * kStrip, sc.get() + rt * block_k + st * kStrip,
                    block_k);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = std::min<int64_t>(visible(r) - c0, cols);
        if (n > 0)
          FilterRow(sc.get() + r * block_k, ks ? ks + bi * s + c0 : nullptr, n, c0, cand[r], k);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      Candidates& cr = cand[r];
      cr.Cut(k);
      int32_t* dst = op + (bi * t + t0 + r) * k;
      if (by_position) {  // already in position order
        std::copy(cr.pos, cr.pos + cr.count, dst);
      } else {  // higher score first, ties to the lower position
        std::vector<uint64_t> keys(cr.count);
        for (int64_t j = 0; j < cr.count; ++j)
          keys[j] = (static_cast<uint64_t>(cr.score[j]) << 32) |
                    (0xFFFFFFFFu - static_cast<uint32_t>(cr.pos[j]));
        std::sort(keys.begin(), keys.end(), std::greater<uint64_t>());
        for (int64_t j = 0; j < cr.count; ++j)
          dst[j] = static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(keys[j]));
      }
    }
  });
  return ffi::Error::Success();
}

// Gathers key rows keys[sel[j] * ld : + h] (j < m) into k^T strips [ceil(m/32), h, 32], zero
// padded; 16 rows per AVX-512 gather instruction.
// `small_offsets`: every element offset sel * ld + h fits in int32 (the gather's index type).
void GatherKeysT(const float* keys, int64_t ld, int64_t h, const int32_t* sel, int64_t m,
                 bool small_offsets, float* kt) {
  const int64_t strips = (m + kStrip - 1) / kStrip;
  for (int64_t st = 0; st < strips; ++st) {
    float* dst = kt + st * h * kStrip;
    for (int half = 0; half < 2; ++half) {
      const int64_t j0 = st * kStrip + half * kLanes;
      const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(kLanes, m - j0));
#if defined(__AVX512F__)
      if (valid == kLanes && small_offsets) {
        alignas(64) int32_t off[kLanes];
        for (int i = 0; i < kLanes; ++i) off[i] = static_cast<int32_t>(sel[j0 + i] * ld);
        const __m512i vo = _mm512_load_si512(off);
        for (int64_t dd = 0; dd < h; ++dd)
          _mm512_storeu_ps(dst + dd * kStrip + half * kLanes, _mm512_i32gather_ps(vo, keys + dd, 4));
        continue;
      }
#endif
      for (int64_t c = 0; c < kLanes; ++c) {
        float* col = dst + half * kLanes + c;
        if (c < valid) {
          const float* src = keys + sel[j0 + c] * ld;
          for (int64_t dd = 0; dd < h; ++dd) col[dd * kStrip] = src[dd];
        } else {
          for (int64_t dd = 0; dd < h; ++dd) col[dd * kStrip] = 0.f;
        }
      }
    }
  }
}

// o[r, :] = sum_j p[r, j] vrows[j][:] for `rows` rows (a multiple of 2) and n value rows read in
// place (no copy); o has hv_pad >= hv columns, of which the first hv are computed.
template <int MR, int NV>
inline void PvGatherTile(const float* p, int64_t ldp, int64_t n, const float* const* vrows,
                         int64_t col, float* o, int64_t ldo) {
  vf acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) acc[r][c] = vf{};
  for (int64_t j = 0; j < n; ++j) {
    vf vv[NV];
    const float* vr = vrows[j] + col;
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) vv[c] = load(vr + c * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const vf a = splat(p[r * ldp + j]);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) acc[r][c] += a * vv[c];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) store(o + r * ldo + col + c * kLanes, acc[r][c]);
}

template <int MR>
inline void PvGatherRows(const float* p, int64_t ldp, int64_t n, const float* const* vrows,
                         int64_t hv, float* o, int64_t ldo) {
  // Full vectors of the value rows first; a ragged tail (hv % 16) reads past the row end only
  // within the padded output columns, so it goes through a zero-padded copy instead.
  int64_t c = 0;
  for (; c + kPvVecs * kLanes <= hv; c += kPvVecs * kLanes)
    PvGatherTile<MR, kPvVecs>(p, ldp, n, vrows, c, o, ldo);
  switch ((hv - c) / kLanes) {
    case 3: PvGatherTile<MR, 3>(p, ldp, n, vrows, c, o, ldo); c += 3 * kLanes; break;
    case 2: PvGatherTile<MR, 2>(p, ldp, n, vrows, c, o, ldo); c += 2 * kLanes; break;
    case 1: PvGatherTile<MR, 1>(p, ldp, n, vrows, c, o, ldo); c += kLanes; break;
    default: break;
  }
  if (c < hv) {  // tail columns: scalar
    for (int r = 0; r < MR; ++r)
      for (int64_t cc = c; cc < hv; ++cc) {
        float acc = 0.f;
        for (int64_t j = 0; j < n; ++j) acc += p[r * ldp + j] * vrows[j][cc];
        o[r * ldo + cc] = acc;
      }
  }
}

inline void PvGather(const float* p, int64_t ldp, int64_t n, const float* const* vrows,
                     int64_t hv, float* o, int64_t ldo, int64_t rows) {
  int64_t r = 0;
  for (; r + kPvRows <= rows; r += kPvRows)
    PvGatherRows<kPvRows>(p + r * ldp, ldp, n, vrows, hv, o + r * ldo, ldo);
  for (; r + 2 <= rows; r += 2)
    PvGatherRows<2>(p + r * ldp, ldp, n, vrows, hv, o + r * ldo, ldo);
}

ffi::Error SparseAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> indices, float scale,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(),
             id = indices.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || id.size() != 3)
    return ffi::Error::InvalidArgument("sparse_attention: bad ranks");
  const int64_t b = qd[0], t = qd[1], n = qd[2], h = qd[3];
  const int64_t s = kd[1], kh = kd[2], hv = vd[3], kk = id[2];
  if (kd[0] != b || kd[3] != h || vd[0] != b || vd[1] != s || vd[2] != kh || id[0] != b ||
      id[1] != t || kh <= 0 || n % kh)
    return ffi::Error::InvalidArgument("sparse_attention: inconsistent shapes");
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const int32_t* ip = indices.typed_data();
  float* op = out->typed_data();
  const int64_t g = n / kh;
  const int64_t rows = (g + kQkRows - 1) / kQkRows * kQkRows;
  const int64_t kk_pad = std::max<int64_t>((kk + kStrip - 1) / kStrip * kStrip, kStrip);
  const int64_t hv_pad = (hv + kLanes - 1) / kLanes * kLanes;
  const float q_scale = scale * kLog2e;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const Band band{int64_t{1} << 40, int64_t{1} << 40, 0, 0};

  const bool small_offsets = s * kh * h < (int64_t{1} << 31);
  constexpr int64_t kRowsPerTask = 16;  // query rows per task: buffers allocated once per task
  const int64_t nt = (t + kRowsPerTask - 1) / kRowsPerTask;
  ParallelFor(pool, b * nt, [&](int64_t task) {
    const int64_t bi = task / nt, tb = task % nt;
    Buf kt = Alloc(kk_pad * h), qb = Alloc(rows * h), sb = Alloc(rows * kk_pad),
        ob = Alloc(rows * hv_pad);
    std::vector<const float*> vrows(kk_pad);
    std::vector<float> zero_row(hv_pad + kLanes, 0.f);
    std::vector<int32_t> sel;
    sel.reserve(kk);
    std::vector<float> rmax(rows), l(rows);
    for (int64_t ti = tb * kRowsPerTask; ti < std::min(t, (tb + 1) * kRowsPerTask); ++ti) {
    sel.clear();
    const int32_t* idx = ip + (bi * t + ti) * kk;
    for (int64_t j = 0; j < kk; ++j)
      if (idx[j] >= 0 && idx[j] < s) sel.push_back(idx[j]);
    const int64_t m = static_cast<int64_t>(sel.size());
    for (int64_t ki = 0; ki < kh; ++ki) {
      float* dst_rows = op + ((bi * t + ti) * n + ki * g) * hv;
      if (m == 0) {
        std::fill(dst_rows, dst_rows + g * hv, 0.f);
        continue;
      }
      const int64_t m_pad = (m + kStrip - 1) / kStrip * kStrip;
      GatherKeysT(kp + bi * s * kh * h + ki * h, kh * h, h, sel.data(), m, small_offsets, kt.get());
      for (int64_t j = 0; j < m; ++j) vrows[j] = vp + ((bi * s + sel[j]) * kh + ki) * hv;
      for (int64_t j = m; j < m_pad; ++j) vrows[j] = zero_row.data();
      for (int64_t r = 0; r < rows; ++r) {
        float* dst = qb.get() + r * h;
        if (r < g) {
          const float* src = qp + ((bi * t + ti) * n + ki * g + r) * h;
          for (int64_t dd = 0; dd < h; ++dd) dst[dd] = src[dd] * q_scale;
        } else {
          std::fill(dst, dst + h, 0.f);
        }
      }
      Band masked = band;
      masked.s_len = m;
      for (int64_t rt = 0; rt < rows; rt += kQkRows) {
        vf rowmax[kQkRows];
        for (int r = 0; r < kQkRows; ++r) rowmax[r] = splat(neg_inf);
        for (int64_t st = 0; st < m_pad / kStrip; ++st)
          QkTile<true>(qb.get() + rt * h, h, kt.get() + st * h * kStrip, h,
                       sb.get() + rt * kk_pad + st * kStrip, kk_pad, rowmax, 0, st * kStrip,
                       masked);
        for (int r = 0; r < kQkRows; ++r) rmax[rt + r] = hmax(rowmax[r]);
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* row = sb.get() + r * kk_pad;
        const vf mv = splat(rmax[r]);
        vf sum = vf{};
        for (int64_t c = 0; c < m_pad; c += kLanes) {
          const vf e = exp2v(load(row + c) - mv);
          store(row + c, e);
          sum += e;
        }
        l[r] = hsum(sum);
      }
      std::fill(ob.get(), ob.get() + rows * hv_pad, 0.f);
      PvGather(sb.get(), kk_pad, m_pad, vrows.data(), hv, ob.get(), hv_pad, rows);
      for (int64_t r = 0; r < g; ++r) {
        const float inv = 1.f / l[r];
        const float* src = ob.get() + r * hv_pad;
        float* dst = dst_rows + r * hv;
        for (int64_t c = 0; c < hv; ++c) dst[c] = src[c] * inv;
      }
    }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxattn_indexer_topk_f32, IndexerTopk,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("by_position")
                                  .Attr<int64_t>("block_q")
                                  .Attr<int64_t>("block_k")
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxattn_sparse_attention_f32, SparseAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
