// Shared pieces of the native CPU kernels: 16-float vectors (GCC/Clang vector extensions, so any
// target compiles; the loader passes -march=native), register-blocked q k^T and p v tiles, a
// vectorized 2^x, 64-byte aligned buffers and a parallel loop over XLA's intra-op thread pool.

#ifndef JAXATTN_NATIVE_COMMON_H_
#define JAXATTN_NATIVE_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxattn_native {

namespace ffi = xla::ffi;

constexpr int kLanes = 16;
constexpr int kStrip = 32;  // columns of one packed k^T strip (two vectors)
constexpr int kQkRows = 8;  // rows of a q k^T register tile
constexpr int kPvRows = 6;  // rows of a p v register tile (24 accumulators)
constexpr int kPvVecs = 4;  // vectors (64 columns) of a p v register tile
constexpr float kLog2e = 1.4426950408889634f;  // logits are computed in base 2

typedef float vf __attribute__((vector_size(64)));
typedef float vfu __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef int32_t viu __attribute__((vector_size(64), aligned(4)));

inline vf load(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void store(float* p, vf x) { *reinterpret_cast<vfu*>(p) = x; }
// A broadcast (not `vf{} + x`, which is an fp add: it must turn -0 into +0, so is not free).
inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }

inline float hmax(vf x) {
  float m = x[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, x[i]);
  return m;
}

inline float hsum(vf x) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += x[i];
  return s;
}

// 2^x for x <= 0 (and -inf -> 0): round to the nearest integer n with the 1.5 * 2^23 trick, a
// degree-6 Taylor polynomial of 2^f on [-0.5, 0.5] (relative error < 1.3e-7), then 2^n through the
// exponent bits.  Inputs below -127 give 0.
inline vf exp2v(vf x) {
  const vf lo = splat(-127.f);
  x = x < lo ? lo : x;
  const vf magic = splat(12582912.f);
  vf t = x + magic;
  vf n = t - magic;
  vf f = x - n;
  vf p = splat(1.5403530393381606e-4f);
  p = p * f + splat(1.3333558146428443e-3f);
  p = p * f + splat(9.6181291076284772e-3f);
  p = p * f + splat(5.5504108664821580e-2f);
  p = p * f + splat(2.4022650695910071e-1f);
  p = p * f + splat(6.9314718055994531e-1f);
  p = p * f + splat(1.f);
  vi ti;
  std::memcpy(&ti, &t, sizeof(ti));
  vi bits = ((ti - 0x4B400000) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

struct Band {
  int64_t left, right;  // >= 0, or a large value for unbounded
  int64_t q_offset;
  int64_t s_len;        // valid keys; columns >= s_len are masked
};

// acc[r] = q[r, 0:h] . kt[0:h, 0:32] for kQkRows rows (row stride ldq; kt a packed 32-column
// strip): the 8 x 32 register tile every q k^T product here runs on.
inline void DotTile(const float* q, int64_t ldq, const float* kt, int64_t h,
                    vf (&acc)[kQkRows][2]) {
#pragma GCC unroll 8
  for (int r = 0; r < kQkRows; ++r) acc[r][0] = acc[r][1] = vf{};
  for (int64_t d = 0; d < h; ++d) {
    const vf k0 = load(kt + d * kStrip);
    const vf k1 = load(kt + d * kStrip + kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < kQkRows; ++r) {
      const vf a = splat(q[r * ldq + d]);
      acc[r][0] += a * k0;
      acc[r][1] += a * k1;
    }
  }
}

// tanh(x) = sign(x) (1 - 2^(-2|x| log2 e)) / (1 + 2^(-2|x| log2 e)); absolute error ~1e-7.
inline vf tanhv(vf x) {
  const vf ax = vmax(x, -x);
  const vf e = exp2v(splat(-2.8853900817779268f) * ax);
  const vf r = (splat(1.f) - e) / (splat(1.f) + e);
  return x < vf{} ? -r : r;
}

// Logit terms after q k^T, in base-2 units (everything times log2 e): ALiBi's
// alibi2 * (column - row position) and the soft-cap cap2 * tanh(x / cap2) (0: none).
struct LogitMods {
  float alibi2 = 0.f;
  float cap2 = 0.f;
};

// s[r, 0:32] = q[r, :] . kt[:, 0:32] for kQkRows rows (+ ALiBi, soft-cap); updates the per-row
// running vector max.  row_pos0 / col0: position of row 0 and column of lane 0.  kMasked: entries
// outside the band, at columns >= s_len, or (when q_seg is given) whose query segment id q_seg[r]
// differs from the key's k_seg[0:32] are set to -inf.
template <bool kMasked>
inline void QkTile(const float* q, int64_t ldq, const float* kt, int64_t h, float* s, int64_t lds,
                   vf* rowmax, int64_t row_pos0, int64_t col0, const Band& band,
                   const int32_t* q_seg = nullptr, const int32_t* k_seg = nullptr,
                   LogitMods mods = {}) {
  vf acc[kQkRows][2];
  DotTile(q, ldq, kt, h, acc);
  if (mods.alibi2 != 0.f) {
    vf cf;
    for (int i = 0; i < kLanes; ++i) cf[i] = static_cast<float>(col0 + i);
#pragma GCC unroll 8
    for (int r = 0; r < kQkRows; ++r) {
      const vf rel = cf - splat(static_cast<float>(row_pos0 + r));
      acc[r][0] += splat(mods.alibi2) * rel;
      acc[r][1] += splat(mods.alibi2) * (rel + splat(static_cast<float>(kLanes)));
    }
  }
  if (mods.cap2 > 0.f) {
    const vf cap = splat(mods.cap2), inv = splat(1.f / mods.cap2);
#pragma GCC unroll 8
    for (int r = 0; r < kQkRows; ++r) {
      acc[r][0] = cap * tanhv(acc[r][0] * inv);
      acc[r][1] = cap * tanhv(acc[r][1] * inv);
    }
  }
  if (kMasked) {
    const vf neg_inf = splat(-std::numeric_limits<float>::infinity());
    vi iota;
    for (int i = 0; i < kLanes; ++i) iota[i] = i;
    const vi c0 = iota + static_cast<int32_t>(col0);
    const vi c1 = c0 + kLanes;
    const vi s_len = vi{} + static_cast<int32_t>(std::min<int64_t>(band.s_len, 1 << 30));
    vi ks0 = vi{}, ks1 = vi{};
    if (q_seg) {
      ks0 = *reinterpret_cast<const viu*>(k_seg);
      ks1 = *reinterpret_cast<const viu*>(k_seg + kLanes);
    }
#pragma GCC unroll 8
    for (int r = 0; r < kQkRows; ++r) {
      const int64_t pos = row_pos0 + r;
      const int32_t lo = static_cast<int32_t>(std::max<int64_t>(pos - band.left, -(1 << 30)));
      const int32_t hi = static_cast<int32_t>(std::min<int64_t>(pos + band.right, 1 << 30));
      const vi vlo = vi{} + lo, vhi = vi{} + hi;
      vi ok0 = (c0 >= vlo) & (c0 <= vhi) & (c0 < s_len);
      vi ok1 = (c1 >= vlo) & (c1 <= vhi) & (c1 < s_len);
      if (q_seg) {
        const vi qs = vi{} + q_seg[r];
        ok0 &= ks0 == qs;
        ok1 &= ks1 == qs;
      }
      acc[r][0] = ok0 ? acc[r][0] : neg_inf;
      acc[r][1] = ok1 ? acc[r][1] : neg_inf;
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kQkRows; ++r) {
    store(s + r * lds, acc[r][0]);
    store(s + r * lds + kLanes, acc[r][1]);
    rowmax[r] = vmax(rowmax[r], vmax(acc[r][0], acc[r][1]));
  }
}

// o[r, 0:16*NV] = alpha[r] * o[r, :] + p[r, 0:n] v[0:n, :] for MR rows (alpha null: 1).
// kTransA: p is stored transposed, element (r, j) at p[j * ldp + r] (p^T v without a transpose).
template <int MR, int NV, bool kTransA = false>
inline void PvTile(const float* p, int64_t ldp, int64_t n, const float* v, int64_t ldv, float* o,
                   int64_t ldo, const float* alpha) {
  vf acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const vf a = splat(alpha ? alpha[r] : 1.f);
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) acc[r][c] = load(o + r * ldo + c * kLanes) * a;
  }
  for (int64_t j = 0; j < n; ++j) {
    vf vv[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) vv[c] = load(v + j * ldv + c * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const vf a = splat(kTransA ? p[j * ldp + r] : p[r * ldp + j]);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) acc[r][c] += a * vv[c];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) store(o + r * ldo + c * kLanes, acc[r][c]);
  }
}

template <int MR, bool kTransA = false>
inline void PvRows(const float* p, int64_t ldp, int64_t n, const float* v, int64_t ldv, float* o,
                   int64_t ldo, const float* alpha, int64_t hv_pad) {
  int64_t c = 0;
  for (; c + kPvVecs * kLanes <= hv_pad; c += kPvVecs * kLanes)
    PvTile<MR, kPvVecs, kTransA>(p, ldp, n, v + c, ldv, o + c, ldo, alpha);
  switch ((hv_pad - c) / kLanes) {
    case 3: PvTile<MR, 3, kTransA>(p, ldp, n, v + c, ldv, o + c, ldo, alpha); break;
    case 2: PvTile<MR, 2, kTransA>(p, ldp, n, v + c, ldv, o + c, ldo, alpha); break;
    case 1: PvTile<MR, 1, kTransA>(p, ldp, n, v + c, ldv, o + c, ldo, alpha); break;
    default: break;
  }
}

// p v for `rows` rows (a multiple of 2): tiles of kPvRows rows, then the remainder.  kTransA: p
// stored transposed ([n, rows] with row stride ldp).
template <bool kTransA = false>
inline void PvBlock(const float* p, int64_t ldp, int64_t n, const float* v, int64_t ldv, float* o,
                    int64_t ldo, const float* alpha, int64_t hv_pad, int64_t rows) {
  int64_t r = 0;
  const int64_t step = kTransA ? 1 : ldp;  // p offset of row r
  for (; r + kPvRows <= rows; r += kPvRows)
    PvRows<kPvRows, kTransA>(p + r * step, ldp, n, v, ldv, o + r * ldo, ldo,
                             alpha ? alpha + r : nullptr, hv_pad);
  for (; r + 2 <= rows; r += 2)
    PvRows<2, kTransA>(p + r * step, ldp, n, v, ldv, o + r * ldo, ldo, alpha ? alpha + r : nullptr,
                       hv_pad);
}

struct AlignedFree {
  void operator()(float* p) const { std::free(p); }
};
using Buf = std::unique_ptr<float[], AlignedFree>;

inline Buf Alloc(int64_t n) {
  size_t bytes = static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float);
  bytes = (bytes + 63) / 64 * 64;
  return Buf(static_cast<float*>(std::aligned_alloc(64, bytes)));
}

// The number of threads ParallelForSlots may use for `count` items (the caller and pool threads).
inline int64_t MaxSlots(ffi::ThreadPool& pool, int64_t count) {
  return std::max<int64_t>(0, std::min<int64_t>(pool.num_threads() - 1, count - 1)) + 1;
}

// Runs fn(item, slot) for items 0..count-1 on the caller and up to MaxSlots - 1 pool threads;
// `slot` numbers the threads that took items (0 <= slot < MaxSlots, fixed per thread for the call),
// for per-thread accumulators without atomics.  Returns how many slots were used.  The caller takes
// items too and waits only for items to finish (not for tasks to start), so a busy or absent pool
// cannot deadlock it; late tasks find no items left and return without touching the caller's frame.
inline int64_t ParallelForSlots(ffi::ThreadPool& pool, int64_t count,
                                const std::function<void(int64_t, int64_t)>& fn) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::atomic<int64_t> slot{0};
    int64_t count = 0;
    const std::function<void(int64_t, int64_t)>* fn = nullptr;
  };
  auto state = std::make_shared<State>();
  state->count = count;
  state->fn = &fn;
  auto drain = [](State& st) {
    int64_t slot = -1;
    for (;;) {
      const int64_t i = st.next.fetch_add(1, std::memory_order_relaxed);
      if (i >= st.count) return;
      if (slot < 0) slot = st.slot.fetch_add(1, std::memory_order_relaxed);
      (*st.fn)(i, slot);
      st.done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t workers = MaxSlots(pool, count) - 1;
  for (int64_t w = 0; w < workers; ++w) pool.Schedule([state, drain]() { drain(*state); });
  drain(*state);
  while (state->done.load(std::memory_order_acquire) < count) std::this_thread::yield();
  return state->slot.load();
}

// fn(0..count-1) in parallel, as ParallelForSlots without the slot.
inline void ParallelFor(ffi::ThreadPool& pool, int64_t count, const std::function<void(int64_t)>& fn) {
  ParallelForSlots(pool, count, [&fn](int64_t i, int64_t) { fn(i); });
}

// Packs rows [S, d] (row stride ld) into k^T strips [ceil(S/32), d, 32], zero padded: the layout
// the q k^T tile reads.
inline void PackStripsT(const float* rows, int64_t s, int64_t d, int64_t ld, float* kt) {
  const int64_t strips = (s + kStrip - 1) / kStrip;
  for (int64_t st = 0; st < strips; ++st) {
    float* dst = kt + st * d * kStrip;
    for (int64_t c = 0; c < kStrip; ++c) {
      const int64_t j = st * kStrip + c;
      if (j < s) {
        const float* src = rows + j * ld;
        for (int64_t dd = 0; dd < d; ++dd) dst[dd * kStrip + c] = src[dd];
      } else {
        for (int64_t dd = 0; dd < d; ++dd) dst[dd * kStrip + c] = 0.f;
      }
    }
  }
}

// Copies rows [S, d] (row stride ld) into [s_pad, d_pad] (s_pad >= S, d_pad >= d), zero padded:
// the layout the p v tile reads.
inline void PackRows(const float* rows, int64_t s, int64_t d, int64_t ld, int64_t s_pad,
                     int64_t d_pad, float* dst) {
  for (int64_t j = 0; j < s_pad; ++j) {
    float* row = dst + j * d_pad;
    if (j < s) std::memcpy(row, rows + j * ld, d * sizeof(float));
    std::fill(row + (j < s ? d : 0), row + d_pad, 0.f);
  }
}

inline int64_t Prod(ffi::Span<const int64_t> dims, size_t begin, size_t end) {
  int64_t p = 1;
  for (size_t i = begin; i < end; ++i) p *= dims[i];
  return p;
}

}  // namespace jaxattn_native

#endif  // JAXATTN_NATIVE_COMMON_H_
