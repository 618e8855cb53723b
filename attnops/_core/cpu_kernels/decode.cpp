// Fused split-KV decode attention on the CPU: one call computes a chunk of one batch's KV for every KV head.
//
// For each KV head the chunk's keys are streamed once, 8 tokens at a time (converted from fp32/fp16/bf16/int8 to
// fp32 into an L1 tile, never into a copy of the cache), giving the scores of the GQA group's query rows; then the
// chunk's row max, exp and row sum; then the values are streamed once into the un-normalised output. Every sum
// runs in a fixed order (8 lanes, then a fixed tree), so a result depends neither on the thread that runs it nor on
// how many threads there are. Per-token antiquant (a scale, optionally an offset, per token or page slot) is applied
// here; per-channel antiquant is folded into the query and the output by the caller.
//
// AVX2 + FMA + F16C where the compiler targets them (head-dim loops in AVX-512 where it targets that too), plain
// loops elsewhere. The order of operations is fixed for a given build.
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ATTNOPS_AVX2 1
#include <immintrin.h>
#else
#define ATTNOPS_AVX2 0
#endif

namespace {

enum DType { F32 = 0, F16 = 1, BF16 = 2, I8 = 3 };

constexpr int64_t itemsize(int dt) { return dt == F32 ? 4 : (dt == I8 ? 1 : 2); }

// One run of tokens: R blocks of L tokens; element (r, n, l, d) at addr + (r*sr + n*sn + l*sl + d) * itemsize.
struct Run {
  int64_t k_addr, k_sr, k_sn, k_sl;
  int64_t v_addr, v_sr, v_sn, v_sl;
  int64_t blocks, length;
  // per-token antiquant of the keys and of the values: the scale (and the offset, same strides) of token (r, l)
  // of head n at addr + (r*sr + n*sn + l*sl) floats; addr 0: none
  int64_t ks_addr, ko_addr, ks_sr, ks_sn, ks_sl;
  int64_t vs_addr, vo_addr, vs_sr, vs_sn, vs_sl;
};
static_assert(sizeof(Run) == 20 * sizeof(int64_t), "Run is 20 int64 fields");

constexpr int W = 8;  // vector width (floats) and tokens per tile

#if ATTNOPS_AVX2
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset(float x) { return _mm256_set1_ps(x); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V x) { _mm256_storeu_ps(p, x); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }

template <int DT>
inline V vconvert(const void* src) {
  if constexpr (DT == F32) {
    return _mm256_loadu_ps(static_cast<const float*>(src));
  } else if constexpr (DT == F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(src)));
  } else if constexpr (DT == BF16) {
    __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(src)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  } else {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(src))));
  }
}

// lane i of the result: the sum of the lanes of a[i] (a fixed tree of pairwise adds)
inline V vsum8(const V* a) {
  V s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  V s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  V s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  V lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}

// exp(x) for x <= 0: 2^n p(r) with r = x - n ln2 (Cephes' polynomial, about 2 ulp); 0 below -87.
inline V vexp(V x) {
  const V zero_below = _mm256_cmp_ps(x, vset(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, vset(-87.0f));
  const V n = _mm256_round_ps(_mm256_mul_ps(x, vset(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  V r = _mm256_fnmadd_ps(n, vset(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, vset(-2.12194440e-4f), r);
  V p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vfma(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, vset(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(zero_below, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#else
struct V {
  float x[W];
};
inline V vzero() { return V{}; }
inline V vset(float a) { V r; for (int i = 0; i < W; ++i) r.x[i] = a; return r; }
inline V vload(const float* p) { V r; std::memcpy(r.x, p, sizeof r.x); return r; }
inline void vstore(float* p, V a) { std::memcpy(p, a.x, sizeof a.x); }
inline V vfma(V a, V b, V c) { for (int i = 0; i < W; ++i) c.x[i] = std::fma(a.x[i], b.x[i], c.x[i]); return c; }
inline V vadd(V a, V b) { for (int i = 0; i < W; ++i) a.x[i] += b.x[i]; return a; }

template <int DT>
inline V vconvert(const void* src) {
  V r;
  for (int i = 0; i < W; ++i) {
    if constexpr (DT == F32) {
      r.x[i] = static_cast<const float*>(src)[i];
    } else if constexpr (DT == F16) {
      r.x[i] = static_cast<float>(static_cast<const _Float16*>(src)[i]);
    } else if constexpr (DT == BF16) {
      uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(src)[i]) << 16;
      std::memcpy(&r.x[i], &u, 4);
    } else {
      r.x[i] = static_cast<float>(static_cast<const int8_t*>(src)[i]);
    }
  }
  return r;
}

inline V vsum8(const V* a) {
  V r;
  for (int i = 0; i < W; ++i) {
    const float* x = a[i].x;
    r.x[i] = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
  }
  return r;
}

inline V vexp(V a) { for (int i = 0; i < W; ++i) a.x[i] = std::exp(a.x[i]); return a; }
#endif

// Row vectors: the head-dim loops step RW floats (16 with AVX-512, else 8); to8 folds one into 8 lanes.
#if ATTNOPS_AVX2 && defined(__AVX512F__) && defined(__AVX512DQ__)
constexpr int RW = 16;
using R = __m512;
inline R rzero() { return _mm512_setzero_ps(); }
inline R rset(float x) { return _mm512_set1_ps(x); }
inline R rload(const float* p) { return _mm512_loadu_ps(p); }
inline void rstore(float* p, R x) { _mm512_storeu_ps(p, x); }
inline R rfma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
inline V to8(R a) { return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)); }

template <int DT>
inline R rconvert(const void* src) {
  if constexpr (DT == F32) {
    return _mm512_loadu_ps(static_cast<const float*>(src));
  } else if constexpr (DT == F16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(src)));
  } else if constexpr (DT == BF16) {
    __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(src)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  } else {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(src))));
  }
}
#else
constexpr int RW = W;
using R = V;
inline R rzero() { return vzero(); }
inline R rset(float x) { return vset(x); }
inline R rload(const float* p) { return vload(p); }
inline void rstore(float* p, R x) { vstore(p, x); }
inline R rfma(R a, R b, R c) { return vfma(a, b, c); }
inline V to8(R a) { return a; }

template <int DT>
inline R rconvert(const void* src) { return vconvert<DT>(src); }
#endif

// Converts one token's row of n values (n a multiple of W; the source holds exactly `valid` of them) to fp32.
template <int DT>
inline void convert_row(const char* src, int valid, int n, float* dst) {
  int i = 0;
  for (; i + RW <= valid; i += RW) rstore(dst + i, rconvert<DT>(src + i * itemsize(DT)));
  if (i < n) {  // a head dim that is not a multiple of RW: the last values through a zero-padded copy
    alignas(64) char tail[RW * 4] = {0};
    std::memcpy(tail, src + i * itemsize(DT), (valid - i) * itemsize(DT));
    rstore(dst + i, rconvert<DT>(tail));
  }
}

// Asks for the `bytes` at p ahead of use (the same row of a token further along the run); never faults.
inline void prefetch(const char* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

constexpr int AHEAD = 16;  // tokens ahead that the prefetches ask for (measured: 8-32 alike, none 1.7x slower)

// W tokens of a chunk: where head 0 of each token's K and V rows and antiquant parameters are, and the step to
// the next head (runs may differ in their strides, so per token).
struct Tile {
  const char* k[W];
  const char* v[W];
  int64_t k_sn[W], v_sn[W], k_sl[W], v_sl[W];  // head and token steps, bytes
  const float* ks[W];                    // per-token scale / offset of the keys and the values, or null
  const float* ko[W];
  const float* vs[W];
  const float* vo[W];
  int64_t ks_sn[W], vs_sn[W];            // floats
  int count;
};

inline const float* param(int64_t addr, int64_t idx) {
  return addr ? reinterpret_cast<const float*>(addr) + idx : nullptr;
}

inline float at(const float* p, int64_t idx, float none) { return p ? p[idx] : none; }

// f(t0, tile) for the chunk's tokens in column order, W at a time (the last tile may hold fewer).
template <int KT, int VT, class F>
void each_tile(const Run* runs, int nruns, F&& f) {
  Tile tile;
  tile.count = 0;
  int64_t t0 = 0;
  for (int i = 0; i < nruns; ++i) {
    const Run& u = runs[i];
    for (int64_t r = 0; r < u.blocks; ++r)
      for (int64_t l = 0; l < u.length; ++l) {
        const int c = tile.count++;
        tile.k[c] = reinterpret_cast<const char*>(u.k_addr) + (r * u.k_sr + l * u.k_sl) * itemsize(KT);
        tile.v[c] = reinterpret_cast<const char*>(u.v_addr) + (r * u.v_sr + l * u.v_sl) * itemsize(VT);
        tile.k_sn[c] = u.k_sn * itemsize(KT);
        tile.v_sn[c] = u.v_sn * itemsize(VT);
        tile.k_sl[c] = u.k_sl * itemsize(KT);
        tile.v_sl[c] = u.v_sl * itemsize(VT);
        const int64_t ki = r * u.ks_sr + l * u.ks_sl, vi = r * u.vs_sr + l * u.vs_sl;
        tile.ks[c] = param(u.ks_addr, ki);
        tile.ko[c] = param(u.ko_addr, ki);
        tile.vs[c] = param(u.vs_addr, vi);
        tile.vo[c] = param(u.vo_addr, vi);
        tile.ks_sn[c] = u.ks_sn;
        tile.vs_sn[c] = u.vs_sn;
        if (tile.count == W) {
          f(t0, tile);
          t0 += W;
          tile.count = 0;
        }
      }
  }
  if (tile.count) f(t0, tile);
}

struct Chunk {
  const float* q;     // [heads, rows, dp] (zero-padded)
  const float* qsum;  // [heads, rows]
  int heads, rows, d, dv, dp, dvp;  // dp, dvp: d, dv rounded up to RW
  float* buf;         // [W, max(dp, dvp)]
  float* scores;      // [heads, rows, tokens]
  float* o;           // [heads, rows, dvp]
  int64_t tokens;
};

// scores[n, :, t0:t0+count] = (q_n . (k_t + offset_t)) * scale_t for every head n
template <int KT>
void tile_scores(const Chunk& h, int64_t t0, const Tile& tile) {
  for (int t = tile.count; t < W; ++t) std::memset(h.buf + t * h.dp, 0, sizeof(float) * h.dp);
  alignas(32) float out[W];
  for (int n = 0; n < h.heads; ++n) {
    for (int t = 0; t < tile.count; ++t) {
      const char* src = tile.k[t] + n * tile.k_sn[t];
      prefetch(src + AHEAD * tile.k_sl[t], h.d * itemsize(KT));
      convert_row<KT>(src, h.d, h.dp, h.buf + t * h.dp);
    }
    for (int j = 0; j < h.rows; ++j) {
      R acc[W];
      for (int t = 0; t < W; ++t) acc[t] = rzero();
      const float* qj = h.q + (n * h.rows + j) * h.dp;
      for (int c = 0; c < h.dp; c += RW) {
        const R qv = rload(qj + c);
        for (int t = 0; t < W; ++t) acc[t] = rfma(qv, rload(h.buf + t * h.dp + c), acc[t]);
      }
      V lanes[W];
      for (int t = 0; t < W; ++t) lanes[t] = to8(acc[t]);
      vstore(out, vsum8(lanes));
      const float qs = h.qsum[n * h.rows + j];
      float* s = h.scores + (n * h.rows + j) * h.tokens + t0;
      for (int t = 0; t < tile.count; ++t)
        s[t] = (out[t] + at(tile.ko[t], n * tile.ks_sn[t], 0.f) * qs) * at(tile.ks[t], n * tile.ks_sn[t], 1.f);
    }
  }
}

// o[n, j, :] += sum_t p[n, j, t] scale_t (v_t + offset_t), the tile's tokens in order, for every head n
template <int VT>
void tile_values(const Chunk& h, int64_t t0, const Tile& tile) {
  for (int n = 0; n < h.heads; ++n) {
    float scale[W];
    for (int t = 0; t < tile.count; ++t) {
      float* row = h.buf + t * h.dvp;
      const char* src = tile.v[t] + n * tile.v_sn[t];
      prefetch(src + AHEAD * tile.v_sl[t], h.dv * itemsize(VT));
      convert_row<VT>(src, h.dv, h.dvp, row);
      const float off = at(tile.vo[t], n * tile.vs_sn[t], 0.f);
      if (off != 0.f)
        for (int c = 0; c < h.dv; ++c) row[c] += off;
      scale[t] = at(tile.vs[t], n * tile.vs_sn[t], 1.f);
    }
    for (int j = 0; j < h.rows; ++j) {
      const float* p = h.scores + (n * h.rows + j) * h.tokens + t0;
      float* oj = h.o + (n * h.rows + j) * h.dvp;
      if (tile.count == W) {
        R w[W];
        for (int t = 0; t < W; ++t) w[t] = rset(p[t] * scale[t]);
        for (int c = 0; c < h.dvp; c += RW) {
          R a = rload(oj + c);
          for (int t = 0; t < W; ++t) a = rfma(w[t], rload(h.buf + t * h.dvp + c), a);
          rstore(oj + c, a);
        }
      } else {
        for (int c = 0; c < h.dvp; c += RW) {
          R a = rload(oj + c);
          for (int t = 0; t < tile.count; ++t) a = rfma(rset(p[t] * scale[t]), rload(h.buf + t * h.dvp + c), a);
          rstore(oj + c, a);
        }
      }
    }
  }
}

// row max and sum of exp(s - max) of scores s [tokens], s replaced by exp(s - max)
inline void softmax_row(float* s, int64_t tokens, float* m_out, float* l_out) {
  float m = -INFINITY;
  for (int64_t t = 0; t < tokens; ++t) m = s[t] > m ? s[t] : m;
  const float shift = m > -INFINITY ? m : 0.f;
  const V neg = vset(-shift);
  V acc[W];
  for (int t = 0; t < W; ++t) acc[t] = vzero();
  int64_t t = 0;
  for (; t + W * W <= tokens; t += W * W)
    for (int i = 0; i < W; ++i) {
      const V e = vexp(vadd(vload(s + t + i * W), neg));
      vstore(s + t + i * W, e);
      acc[i] = vadd(acc[i], e);
    }
  alignas(32) float lanes[W];
  vstore(lanes, vsum8(acc));
  float total = 0.f;
  for (int i = 0; i < W; ++i) total += lanes[i];
  for (; t < tokens; ++t) {
    s[t] = std::exp(s[t] - shift);
    total += s[t];
  }
  *m_out = m;
  *l_out = total;
}

inline int padded(int x) { return (x + RW - 1) / RW * RW; }

// where the scores [rows, tokens] (after a call: exp(s - m)) start in the scratch, in floats
inline int64_t scores_offset(int64_t rows, int d, int dv) {
  const int64_t dp = padded(d), dvp = padded(dv);
  return rows * (dp + 1 + dvp) + W * (dp > dvp ? dp : dvp);
}

template <int KT, int VT>
void chunk(const float* q, int heads, int rows, int d, int dv, const Run* runs, int nruns, int64_t tokens,
           float* scratch, float* m_out, float* l_out, float* o_out) {
  const int dp = padded(d), dvp = padded(dv), hr = heads * rows;
  float* qpad = scratch;            // hr * dp
  float* qsum = qpad + hr * dp;     // hr
  float* opad = qsum + hr;          // hr * dvp
  float* buf = opad + hr * dvp;     // W * max(dp, dvp)
  float* scores = scratch + scores_offset(hr, d, dv);  // hr * tokens
  const Chunk h{qpad, qsum, heads, rows, d, dv, dp, dvp, buf, scores, opad, tokens};
  std::memset(qpad, 0, sizeof(float) * hr * dp);
  for (int i = 0; i < hr; ++i) {
    std::memcpy(qpad + i * dp, q + i * d, sizeof(float) * d);
    float s = 0.f;
    for (int c = 0; c < d; ++c) s += q[i * d + c];
    qsum[i] = s;
  }
  each_tile<KT, VT>(runs, nruns, [&](int64_t t0, const Tile& tile) { tile_scores<KT>(h, t0, tile); });
  for (int i = 0; i < hr; ++i) softmax_row(scores + i * tokens, tokens, m_out + i, l_out + i);
  std::memset(opad, 0, sizeof(float) * hr * dvp);
  each_tile<KT, VT>(runs, nruns, [&](int64_t t0, const Tile& tile) { tile_values<VT>(h, t0, tile); });
  for (int i = 0; i < hr; ++i) std::memcpy(o_out + i * dv, opad + i * dvp, sizeof(float) * dv);
}

using ChunkFn = void (*)(const float*, int, int, int, int, const Run*, int, int64_t, float*, float*, float*, float*);

template <int KT>
ChunkFn pick_value(int vt) {
  switch (vt) {
    case F32: return chunk<KT, F32>;
    case F16: return chunk<KT, F16>;
    case BF16: return chunk<KT, BF16>;
    case I8: return chunk<KT, I8>;
  }
  return nullptr;
}

}  // namespace

extern "C" {

// Floats of scratch one call needs (rows: heads x query rows per head).
int64_t attnops_decode_scratch(int rows, int d, int dv, int64_t tokens) {
  return scores_offset(rows, d, dv) + rows * tokens;
}

// Where, after a call, the scratch holds exp(s - m) [heads, rows, tokens] (the unnormalised probabilities), in
// floats from its start.
int64_t attnops_decode_probabilities(int rows, int d, int dv) { return scores_offset(rows, d, dv); }

// q [heads, rows, d] fp32 (scaled); runs: the chunk's `tokens` tokens in column order; outputs per head and row:
// the max m [heads, rows], the sum of exp(s - m) l [heads, rows] and the un-normalised output o [heads, rows, dv].
// Returns 0, or -1 for an unknown dtype code.
int attnops_decode_chunk(const float* q, int heads, int rows, int d, int dv, int kt, int vt, const int64_t* runs,
                         int nruns, int64_t tokens, float* scratch, float* m_out, float* l_out, float* o_out) {
  ChunkFn fn = nullptr;
  switch (kt) {
    case F32: fn = pick_value<F32>(vt); break;
    case F16: fn = pick_value<F16>(vt); break;
    case BF16: fn = pick_value<BF16>(vt); break;
    case I8: fn = pick_value<I8>(vt); break;
  }
  if (!fn) return -1;
  fn(q, heads, rows, d, dv, reinterpret_cast<const Run*>(runs), nruns, tokens, scratch, m_out, l_out, o_out);
  return 0;
}

}  // extern "C"
