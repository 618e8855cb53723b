// Fused split-KV decode attention on the CPU: one call computes a chunk of one batch's KV for every KV head.
//
// For each KV head the chunk's keys are streamed once, a tile of RW tokens at a time, converted from
// fp32/fp16/bf16/int8 to fp32 in registers (never into a copy of the cache), giving the scores of the GQA group's
// query rows; then the chunk's row max, exp and row sum; then the values are streamed once into the un-normalised
// output. Query rows are taken four at a time and the value columns four vectors at a time, so every converted
// vector feeds several FMAs from registers. Every sum runs in a fixed order (per lane along the head dim, then a
// fixed tree across lanes; tokens in column order), so a result depends neither on the thread that runs it nor on
// how many threads there are. Per-token antiquant (a scale, optionally an offset, per token or page slot) is
// applied here; per-channel antiquant is folded into the query and the output by the caller.
//
// AVX-512 (F, DQ, BW, VL) or AVX2 + FMA + F16C where the compiler targets them, plain loops elsewhere. The order of
// operations is fixed for a given build. Several chunks run on the library's own threads, which sleep between
// calls and while waiting (attnops_decode_chunks_parallel).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "threads.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ATTNOPS_AVX2 1
#include <immintrin.h>
#else
#define ATTNOPS_AVX2 0
#endif
#if ATTNOPS_AVX2 && defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ATTNOPS_AVX512 1
#else
#define ATTNOPS_AVX512 0
#endif
#define ATTNOPS_AMX_SCORES (ATTNOPS_AMX && ATTNOPS_AVX512)  // bf16 keys' scores on the tile unit

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

// ---- 8-lane vectors (softmax) ----------------------------------------------------------------------------------
constexpr int W = 8;

#if ATTNOPS_AVX2
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset(float x) { return _mm256_set1_ps(x); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V x) { _mm256_storeu_ps(p, x); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }

// lane i of the result: the sum of the lanes of a[i] (a fixed tree of pairwise adds)
inline V vsum8(const V* a) {
  V s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  V s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  V s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  V lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}

// exp(x) for x <= 0: 2^n p(r) with r = x - n ln2 (Cephes' polynomial, about 2 ulp); 0 below -87; NaN for NaN
// (max_ps returns its second operand when either is NaN, so a NaN x goes on into the polynomial).
inline V vexp(V x) {
  const V zero_below = _mm256_cmp_ps(x, vset(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(vset(-87.0f), x);
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

inline V vsum8(const V* a) {
  V r;
  for (int i = 0; i < W; ++i) {
    const float* x = a[i].x;
    r.x[i] = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
  }
  return r;
}

inline V vexp(V a) { for (int i = 0; i < W; ++i) a.x[i] = std::exp(a.x[i]); return a; }

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
#endif

// ---- row vectors: RW lanes (16 with AVX-512, else 8); the head-dim loops and the token tiles step RW ----------
#if ATTNOPS_AVX512
constexpr int RW = 16;
using R = __m512;
inline R rzero() { return _mm512_setzero_ps(); }
inline R rset(float x) { return _mm512_set1_ps(x); }
inline R rload(const float* p) { return _mm512_loadu_ps(p); }
inline void rstore(float* p, R x) { _mm512_storeu_ps(p, x); }
inline R rfma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }

// the first `valid` (< RW) values at src, the other lanes 0; reads nothing past them
template <int DT>
inline R rconvert_part(const char* src, int valid) {
  const __mmask16 m = static_cast<__mmask16>((1u << valid) - 1u);
  if constexpr (DT == F32) {
    return _mm512_maskz_loadu_ps(m, src);
  } else if constexpr (DT == F16) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, src));
  } else if constexpr (DT == BF16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, src)), 16));
  } else {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, src)));
  }
}

template <int DT>
inline R rconvert(const char* src) {
  if constexpr (DT == F32) {
    return _mm512_loadu_ps(src);
  } else if constexpr (DT == F16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  } else if constexpr (DT == BF16) {
    __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  } else {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
  }
}

// lane t of the result: the sum of the lanes of a[t] (a fixed tree: 128-bit lane halves, then quarters, then the
// four 128-bit lanes)
inline R rsum_lanes(const R* a) {
  R b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  const R h01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const R h23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, 0x88), _mm512_shuffle_f32x4(h01, h23, 0xDD));
}
#else
constexpr int RW = W;
using R = V;
inline R rzero() { return vzero(); }
inline R rset(float x) { return vset(x); }
inline R rload(const float* p) { return vload(p); }
inline void rstore(float* p, R x) { vstore(p, x); }
inline R rfma(R a, R b, R c) { return vfma(a, b, c); }
inline R rsum_lanes(const R* a) { return vsum8(a); }

template <int DT>
inline R rconvert(const char* src) { return vconvert<DT>(src); }

template <int DT>
inline R rconvert_part(const char* src, int valid) {
  alignas(64) char tail[RW * 4] = {0};
  std::memcpy(tail, src, valid * itemsize(DT));
  return vconvert<DT>(tail);
}
#endif

// the RW values at src converted to fp32 when `valid` >= RW, else the first `valid` and zeros
template <int DT>
inline R rconvert_n(const char* src, int valid) {
  return valid >= RW ? rconvert<DT>(src) : rconvert_part<DT>(src, valid);
}

constexpr int MAXR = 4;  // query rows per register block
constexpr int TB = 4;    // tokens per register block of the scores

// RW tokens of a chunk (the last tile of a chunk may hold fewer: `count`; the rest read a zero row): where head 0
// of each token's K and V rows and antiquant parameters are, and the steps to the next head.
struct Tile {
  const char* k[RW];
  const char* v[RW];
  int64_t k_sn[RW], v_sn[RW];  // head steps, bytes
  const float* ks[RW];         // per-token scale / offset of the keys and the values, or null
  const float* ko[RW];
  const float* vs[RW];
  const float* vo[RW];
  int64_t ks_sn[RW], vs_sn[RW];  // floats
  int count;
  bool k_quant, v_quant;  // whether any token has per-token parameters
};

inline const float* param(int64_t addr, int64_t idx) {
  return addr ? reinterpret_cast<const float*>(addr) + idx : nullptr;
}

inline float at(const float* p, int64_t idx, float none) { return p ? p[idx] : none; }

// f(t0, tile, next) for the chunk's tokens in column order, RW at a time (`next`: the tile after, whose rows the
// call prefetches, whichever run or page they lie in; `zero`: a zeroed row for the padding).
template <int KT, int VT, class F>
void each_tile(const Run* runs, int nruns, const char* zero, F&& f) {
  Tile tiles[2];
  Tile* filling = &tiles[0];
  Tile* ready = nullptr;  // a full tile waiting for the next one (its prefetch target)
  int64_t t0 = 0;
  auto start = [](Tile& tile) {
    tile.count = 0;
    tile.k_quant = tile.v_quant = false;
  };
  auto pad = [zero](Tile& tile) {
    for (int c = tile.count; c < RW; ++c) {
      tile.k[c] = tile.v[c] = zero;
      tile.k_sn[c] = tile.v_sn[c] = 0;
      tile.ks[c] = tile.ko[c] = tile.vs[c] = tile.vo[c] = nullptr;
      tile.ks_sn[c] = tile.vs_sn[c] = 0;
    }
  };
  auto complete = [&]() {  // the filling tile is full (or the last): run the one before it
    pad(*filling);
    if (ready) {
      f(t0, *ready, *filling);
      t0 += ready->count;
    }
    ready = filling;
    filling = filling == &tiles[0] ? &tiles[1] : &tiles[0];
    start(*filling);
  };
  start(*filling);
  for (int i = 0; i < nruns; ++i) {
    const Run& u = runs[i];
    for (int64_t r = 0; r < u.blocks; ++r)
      for (int64_t l = 0; l < u.length; ++l) {
        Tile& tile = *filling;
        const int c = tile.count++;
        tile.k[c] = reinterpret_cast<const char*>(u.k_addr) + (r * u.k_sr + l * u.k_sl) * itemsize(KT);
        tile.v[c] = reinterpret_cast<const char*>(u.v_addr) + (r * u.v_sr + l * u.v_sl) * itemsize(VT);
        tile.k_sn[c] = u.k_sn * itemsize(KT);
        tile.v_sn[c] = u.v_sn * itemsize(VT);
        const int64_t ki = r * u.ks_sr + l * u.ks_sl, vi = r * u.vs_sr + l * u.vs_sl;
        tile.ks[c] = param(u.ks_addr, ki);
        tile.ko[c] = param(u.ko_addr, ki);
        tile.vs[c] = param(u.vs_addr, vi);
        tile.vo[c] = param(u.vo_addr, vi);
        tile.ks_sn[c] = u.ks_sn;
        tile.vs_sn[c] = u.vs_sn;
        tile.k_quant |= u.ks_addr != 0;
        tile.v_quant |= u.vs_addr != 0;
        if (tile.count == RW) complete();
      }
  }
  if (filling->count) complete();
  if (ready) {
    pad(*filling);  // empty: its rows are the zero row
    f(t0, *ready, *filling);
  }
}

struct Chunk {
  const float* q;     // [heads, rows, dp] (zero-padded)
  const uint16_t* query_tiles;  // the tile unit's B tiles of the unscaled bf16 query (amx_query), or null
  int groups, steps;  // of query_tiles: 16 query rows per group, 32 of d per step
  float scale;        // of the scores from query_tiles
  const float* qsum;  // [heads, rows]
  int heads, rows, d, dv, dp, dvp;  // dp, dvp: d, dv rounded up to RW
  float* weights;     // [rows, RW]: a tile's probabilities times the value scales
  float* offsets;     // [heads, rows]: sum over tokens of probability x value scale x value offset
  float* scores;      // [heads, rows, tokens]
  float* o;           // [heads, rows, dvp]
  int64_t tokens;
};

// sums[j, t] = q_j . k_t for NR rows of q (row step dp) and the RW tokens at k (d values each)
template <int KT, int NR>
void score_block(const float* q, int d, int dp, const char* const* k, const char* const* next, float* sums,
                 int64_t sstep) {
  R lanes[NR][RW];
  for (int g = 0; g < RW; g += TB) {
    R acc[TB][NR];
    for (int t = 0; t < TB; ++t)
      for (int j = 0; j < NR; ++j) acc[t][j] = rzero();
    const char* kt[TB];
    const char* later[TB];  // the same rows one tile later
    for (int t = 0; t < TB; ++t) {
      kt[t] = k[g + t];
      later[t] = next ? next[g + t] : nullptr;
    }
    auto step = [&](int c, auto full) {
      R kv[TB];
      for (int t = 0; t < TB; ++t) {
        const char* src = kt[t] + c * itemsize(KT);
        if (later[t]) __builtin_prefetch(later[t] + c * itemsize(KT), 0, 3);
        if constexpr (decltype(full)::value) kv[t] = rconvert<KT>(src);
        else kv[t] = rconvert_part<KT>(src, d - c);
      }
      for (int j = 0; j < NR; ++j) {
        const R qv = rload(q + j * dp + c);
        for (int t = 0; t < TB; ++t) acc[t][j] = rfma(qv, kv[t], acc[t][j]);
      }
    };
    int c = 0;
    for (; c + RW <= d; c += RW) step(c, std::true_type{});
    if (c < d) step(c, std::false_type{});
    for (int t = 0; t < TB; ++t)
      for (int j = 0; j < NR; ++j) lanes[j][g + t] = acc[t][j];
  }
  for (int j = 0; j < NR; ++j) rstore(sums + j * sstep, rsum_lanes(lanes[j]));
}

template <int KT>
void score_rows(const float* q, int nr, int d, int dp, const char* const* k, const char* const* next, float* sums,
                int64_t sstep) {
  switch (nr) {
    case 1: return score_block<KT, 1>(q, d, dp, k, next, sums, sstep);
    case 2: return score_block<KT, 2>(q, d, dp, k, next, sums, sstep);
    case 3: return score_block<KT, 3>(q, d, dp, k, next, sums, sstep);
    default: return score_block<KT, 4>(q, d, dp, k, next, sums, sstep);
  }
}

// scores[n, :, t0:t0+count] = (q_n . (k_t + offset_t)) * scale_t for every head n (the keys of `next`, the
// following tile, are prefetched meanwhile)
template <int KT>
void tile_scores(const Chunk& h, int64_t t0, const Tile& tile, const Tile& next) {
  alignas(64) float sums[MAXR * RW];
  const char* k[RW];
  const char* later[RW];
  for (int n = 0; n < h.heads; ++n) {
    for (int t = 0; t < RW; ++t) {
      k[t] = tile.k[t] + n * tile.k_sn[t];
      later[t] = next.k[t] + n * next.k_sn[t];
    }
    for (int j0 = 0; j0 < h.rows; j0 += MAXR) {
      const int nr = h.rows - j0 < MAXR ? h.rows - j0 : MAXR;
      float* s0 = h.scores + (n * h.rows + j0) * h.tokens + t0;
      const char* const* pre = j0 ? nullptr : later;
      if (tile.count == RW && !tile.k_quant) {  // straight into the scores
        score_rows<KT>(h.q + (n * h.rows + j0) * h.dp, nr, h.d, h.dp, k, pre, s0, h.tokens);
        continue;
      }
      score_rows<KT>(h.q + (n * h.rows + j0) * h.dp, nr, h.d, h.dp, k, pre, sums, RW);
      for (int j = 0; j < nr; ++j) {
        float* s = h.scores + (n * h.rows + j0 + j) * h.tokens + t0;
        const float* sj = sums + j * RW;
        if (!tile.k_quant) {
          std::memcpy(s, sj, sizeof(float) * tile.count);
          continue;
        }
        const float qs = h.qsum[n * h.rows + j0 + j];
        for (int t = 0; t < tile.count; ++t) {
          // + 0 * scale: an infinite scale gives NaN, as the dequantized key (elements of both signs times inf) does
          const float scale = at(tile.ks[t], n * tile.ks_sn[t], 1.f);
          s[t] = (sj[t] + at(tile.ko[t], n * tile.ks_sn[t], 0.f) * qs) * scale + 0.f * scale;
        }
      }
    }
  }
}

#if ATTNOPS_AMX_SCORES
constexpr int AMX_COLUMNS = 16;   // query rows per B tile (its columns)
constexpr int AMX_STEP = 32;      // bf16 of d per A row and per B tile
constexpr int AMX_TILE = 16 * AMX_COLUMNS * 2;  // bf16 per B tile

inline int amx_groups(int rows) { return (rows + AMX_COLUMNS - 1) / AMX_COLUMNS; }
inline int amx_steps(int d) { return (d + AMX_STEP - 1) / AMX_STEP; }

// The unscaled bf16 query q [heads, rows, d] as tdpbf16ps B tiles out [heads, groups, steps, 16 pairs, 16 columns,
// 2]: pair i of column c in step s of group g is (q[16g + c, 32s + 2i], q[16g + c, 32s + 2i + 1]); zero past the rows
// and d.
void amx_query(const uint16_t* q, int heads, int rows, int d, uint16_t* out) {
  const int groups = amx_groups(rows), steps = amx_steps(d);
  std::memset(out, 0, sizeof(uint16_t) * heads * groups * steps * AMX_TILE);
  for (int n = 0; n < heads; ++n)
    for (int j = 0; j < rows; ++j)
      for (int e = 0; e < d; ++e) {
        const int64_t tile = (static_cast<int64_t>(n) * groups + j / AMX_COLUMNS) * steps + e / AMX_STEP;
        out[tile * AMX_TILE + (e % AMX_STEP / 2) * 2 * AMX_COLUMNS + j % AMX_COLUMNS * 2 + e % 2] =
            q[(static_cast<int64_t>(n) * rows + j) * d + e];
      }
}

// scores[n, :, t0:t0+count] = scale * (q_n . k_t) for every head n on the tile unit: the tile's 16 keys are A (read
// where they lie when their rows are evenly spaced and d is a multiple of 32, else copied zero-padded into `keys`
// [16, steps * 32]), the query tiles B; the sums of 32 of d at a time are added in order onto a 16 x 16 tile of
// sums (token x query row). The keys of `next` are prefetched meanwhile.
void amx_tile_scores(const Chunk& h, int64_t t0, const Tile& tile, const Tile& next, uint16_t* keys) {
  alignas(64) float sums[RW * AMX_COLUMNS];
  const int width = h.steps * AMX_STEP;
  const int64_t bytes = int64_t{2} * h.d;
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(AMX_COLUMNS));
  const __m512 scale = _mm512_set1_ps(h.scale);
  const __mmask16 valid = tile.count >= RW ? 0xFFFF : static_cast<__mmask16>((1u << tile.count) - 1u);
  for (int n = 0; n < h.heads; ++n) {
    const char* first = tile.k[0] + n * tile.k_sn[0];
    const int64_t stride = tile.k[1] + n * tile.k_sn[1] - first;
    bool even = tile.count == RW && h.d % AMX_STEP == 0;
    for (int t = 2; even && t < RW; ++t) even = tile.k[t] + n * tile.k_sn[t] == first + t * stride;
    const char* a = first;
    int64_t lda = stride;
    if (!even) {
      for (int t = 0; t < RW; ++t) {
        std::memcpy(keys + t * width, tile.k[t] + n * tile.k_sn[t], bytes);
        std::memset(keys + t * width + h.d, 0, sizeof(uint16_t) * (width - h.d));
      }
      a = reinterpret_cast<const char*>(keys);
      lda = int64_t{2} * width;
    }
    for (int t = 0; t < RW; ++t)
      for (int64_t e = 0; e < bytes; e += 64) __builtin_prefetch(next.k[t] + n * next.k_sn[t] + e, 0, 3);
    for (int g = 0; g < h.groups; ++g) {
      const uint16_t* b = h.query_tiles + (static_cast<int64_t>(n) * h.groups + g) * h.steps * AMX_TILE;
      _tile_zero(0);
      for (int s = 0; s < h.steps; ++s) {
        _tile_loadd(1, a + s * AMX_STEP * 2, lda);
        _tile_loadd(2, b + s * AMX_TILE, AMX_COLUMNS * 4);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, sums, AMX_COLUMNS * 4);
      const int rows = std::min(AMX_COLUMNS, h.rows - g * AMX_COLUMNS);
      float* s0 = h.scores + (static_cast<int64_t>(n) * h.rows + g * AMX_COLUMNS) * h.tokens + t0;
      for (int j = 0; j < rows; ++j)
        _mm512_mask_storeu_ps(s0 + j * h.tokens, valid,
                              _mm512_mul_ps(_mm512_i32gather_ps(column, sums + j, 4), scale));
    }
  }
}
#endif

// o[j, c0 : c0 + NC*RW] += sum_t w[j, t] v_t[c0 : ...] for NR rows (w row step RW, o row step ostep), the RW
// tokens at v in order (dv values each)
template <int VT, int NR, int NC>
void value_block(const float* w, int64_t wstep, const char* const* v, const char* const* next, int c0, int dv,
                 float* o, int ostep) {
  R acc[NR][NC];
  for (int j = 0; j < NR; ++j)
    for (int i = 0; i < NC; ++i) acc[j][i] = rload(o + j * ostep + c0 + i * RW);
  for (int t = 0; t < RW; ++t) {
    R x[NC];
    const char* row = v[t] + c0 * itemsize(VT);
    const char* later = next ? next[t] + c0 * itemsize(VT) : nullptr;  // the same row one tile later
    for (int i = 0; i < NC; ++i) {
      const char* src = row + i * RW * itemsize(VT);
      if (later) __builtin_prefetch(later + i * RW * itemsize(VT), 0, 3);
      x[i] = rconvert_n<VT>(src, dv - c0 - i * RW);
    }
    for (int j = 0; j < NR; ++j) {
      const R wj = rset(w[j * wstep + t]);
      for (int i = 0; i < NC; ++i) acc[j][i] = rfma(wj, x[i], acc[j][i]);
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int i = 0; i < NC; ++i) rstore(o + j * ostep + c0 + i * RW, acc[j][i]);
}

template <int VT, int NR>
void value_rows(const float* w, int64_t wstep, const char* const* v, const char* const* next, int dv, int dvp,
                float* o) {
  int c0 = 0;
  for (; c0 + 4 * RW <= dvp; c0 += 4 * RW) value_block<VT, NR, 4>(w, wstep, v, next, c0, dv, o, dvp);
  if (c0 + 2 * RW <= dvp) {
    value_block<VT, NR, 2>(w, wstep, v, next, c0, dv, o, dvp);
    c0 += 2 * RW;
  }
  if (c0 < dvp) value_block<VT, NR, 1>(w, wstep, v, next, c0, dv, o, dvp);
}

// o[n, j, :] += sum_t p[n, j, t] scale_t (v_t + offset_t), the tile's tokens in order, for every head n
template <int VT>
void tile_values(const Chunk& h, int64_t t0, const Tile& tile, const Tile& next) {
  const char* v[RW];
  const char* later[RW];
  for (int n = 0; n < h.heads; ++n) {
    for (int t = 0; t < RW; ++t) {
      v[t] = tile.v[t] + n * tile.v_sn[t];
      later[t] = next.v[t] + n * next.v_sn[t];
    }
    // the weights: the probabilities themselves, or (a partial tile, per-token value parameters) a copy, zero past
    // the tile's tokens and times the value scales
    const float* w = h.scores + n * h.rows * h.tokens + t0;
    int64_t wstep = h.tokens;
    if (tile.count < RW || tile.v_quant) {
      for (int j = 0; j < h.rows; ++j) {
        float* wj = h.weights + j * RW;
        for (int t = 0; t < RW; ++t) wj[t] = t < tile.count ? w[j * wstep + t] : 0.f;
        if (!tile.v_quant) continue;
        float off = 0.f;
        for (int t = 0; t < tile.count; ++t) {
          wj[t] *= at(tile.vs[t], n * tile.vs_sn[t], 1.f);
          if (tile.vo[t]) off += wj[t] * tile.vo[t][n * tile.vs_sn[t]];  // no offset adds nothing (an infinite w too)
        }
        h.offsets[n * h.rows + j] += off;
      }
      w = h.weights;
      wstep = RW;
    }
    for (int j0 = 0; j0 < h.rows; j0 += MAXR) {
      const float* wj = w + j0 * wstep;
      const char* const* pre = j0 ? nullptr : later;
      float* o = h.o + (n * h.rows + j0) * h.dvp;
      switch (h.rows - j0 < MAXR ? h.rows - j0 : MAXR) {
        case 1: value_rows<VT, 1>(wj, wstep, v, pre, h.dv, h.dvp, o); break;
        case 2: value_rows<VT, 2>(wj, wstep, v, pre, h.dv, h.dvp, o); break;
        case 3: value_rows<VT, 3>(wj, wstep, v, pre, h.dv, h.dvp, o); break;
        default: value_rows<VT, 4>(wj, wstep, v, pre, h.dv, h.dvp, o); break;
      }
    }
  }
}

// row max and sum of exp(s - max) of scores s [tokens], s replaced by exp(s - max). The running max skips NaN
// scores (no single instruction keeps NaN in it); a NaN score still reaches the sum and the output through exp,
// which propagates it, as does +inf (exp(+inf - +inf) is NaN), and a NaN sum makes the max NaN too, so the row's
// statistics and output are NaN as in the formula. Every key of a chunk is visible to its rows, so a row whose
// scores are all -inf gets the formula's 0/0: m = -inf and l = NaN (the merge makes the row NaN unless another chunk
// gives it a finite score).
inline void softmax_row(float* s, int64_t tokens, float* m_out, float* l_out) {
  float m = -INFINITY;
  int64_t t = 0;
#if ATTNOPS_AVX2
  if (tokens >= W) {
    V mv = vload(s);
    for (t = W; t + W <= tokens; t += W) mv = _mm256_max_ps(mv, vload(s + t));
    alignas(32) float lanes[W];
    vstore(lanes, mv);
    for (int i = 0; i < W; ++i) m = lanes[i] > m ? lanes[i] : m;
  }
#endif
  for (; t < tokens; ++t) m = s[t] > m ? s[t] : m;
  const float shift = m > -INFINITY ? m : 0.f;
  const V neg = vset(-shift);
  V acc[W];
  for (int i = 0; i < W; ++i) acc[i] = vzero();
  t = 0;
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
  *m_out = total == total ? m : NAN;
  *l_out = m == -INFINITY && tokens > 0 ? NAN : total;
}

inline int padded(int x) { return (x + RW - 1) / RW * RW; }

// where the scores [rows, tokens] (after a call: exp(s - m)) start in the scratch, in floats
inline int64_t scores_offset(int64_t rows, int d, int dv) {
  const int64_t dp = padded(d), dvp = padded(dv);
  return rows * (dp + 2 + dvp) + (rows + 1) * RW + (dp > dvp ? dp : dvp);
}

// The scores of a chunk: scores [heads, rows, tokens] (h.scores), from bf16 keys on the tile unit where the chunk
// has the unscaled bf16 query (`qb`, with `scale`) and the process may use the unit, else with fp32 FMAs from h.q.
template <int KT, int VT>
void chunk_scores(Chunk h, const uint16_t* qb, float scale, const Run* runs, int nruns, const char* zero) {
#if ATTNOPS_AMX_SCORES
  if (KT == BF16 && qb && attnops::amx_granted()) {
    h.groups = amx_groups(h.rows);
    h.steps = amx_steps(h.d);
    h.scale = scale;
    thread_local std::vector<uint16_t> tiles_and_keys;  // kept between calls
    const size_t query = static_cast<size_t>(h.heads) * h.groups * h.steps * AMX_TILE;
    tiles_and_keys.resize(query + static_cast<size_t>(RW) * h.steps * AMX_STEP);
    amx_query(qb, h.heads, h.rows, h.d, tiles_and_keys.data());
    h.query_tiles = tiles_and_keys.data();
    uint16_t* keys = tiles_and_keys.data() + query;
    const attnops::Tiles tiles;
    each_tile<KT, VT>(runs, nruns, zero, [&](int64_t t0, const Tile& tile, const Tile& next) {
      if (tile.k_quant) tile_scores<KT>(h, t0, tile, next);
      else amx_tile_scores(h, t0, tile, next, keys);
    });
    return;
  }
#endif
  (void)qb;
  (void)scale;
  each_tile<KT, VT>(runs, nruns, zero, [&](int64_t t0, const Tile& tile, const Tile& next) {
    tile_scores<KT>(h, t0, tile, next);
  });
}

template <int KT, int VT>
void chunk(const float* q, const uint16_t* qb, float scale, int heads, int rows, int d, int dv, const Run* runs,
           int nruns, int64_t tokens, float* scratch, float* m_out, float* l_out, float* o_out) {
  const int dp = padded(d), dvp = padded(dv), hr = heads * rows;
  float* qpad = scratch;              // hr * dp
  float* qsum = qpad + hr * dp;       // hr
  float* offsets = qsum + hr;         // hr
  float* opad = offsets + hr;         // hr * dvp
  float* weights = opad + hr * dvp;   // rows * RW
  float* zero = weights + rows * RW;  // RW + max(dp, dvp): a zero row of either dtype
  float* scores = scratch + scores_offset(hr, d, dv);  // hr * tokens
  const Chunk h{qpad, nullptr, 0, 0, 1.f, qsum, heads, rows, d, dv, dp, dvp, weights, offsets, scores, opad, tokens};
  std::memset(qpad, 0, sizeof(float) * hr * dp);
  std::memset(zero, 0, sizeof(float) * (scores - zero));
  for (int i = 0; i < hr; ++i) {
    std::memcpy(qpad + i * dp, q + i * d, sizeof(float) * d);
    float s = 0.f;
    for (int c = 0; c < d; ++c) s += q[i * d + c];
    qsum[i] = s;
  }
  const char* z = reinterpret_cast<const char*>(zero);
  chunk_scores<KT, VT>(h, qb, scale, runs, nruns, z);
  for (int i = 0; i < hr; ++i) softmax_row(scores + i * tokens, tokens, m_out + i, l_out + i);
  std::memset(opad, 0, sizeof(float) * hr * dvp);
  std::memset(offsets, 0, sizeof(float) * hr);
  each_tile<KT, VT>(runs, nruns, z, [&](int64_t t0, const Tile& tile, const Tile& next) {
    tile_values<VT>(h, t0, tile, next);
  });
  for (int i = 0; i < hr; ++i)
    for (int c = 0; c < dv; ++c) o_out[i * dv + c] = opad[i * dvp + c] + offsets[i];
}

using ChunkFn = void (*)(const float*, const uint16_t*, float, int, int, int, int, const Run*, int, int64_t, float*,
                         float*, float*, float*);

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

// Floats of scratch one chunk needs (rows: heads x query rows per head).
int64_t scratch_floats(int rows, int d, int dv, int64_t tokens) { return scores_offset(rows, d, dv) + rows * tokens; }

// One chunk: q [heads, rows, d] fp32 (scaled), and optionally the same query unscaled in bf16, qb (null: none),
// with its scale; runs: the chunk's `tokens` tokens in column order; outputs per head and row: the max m [heads,
// rows], the sum of exp(s - m) l [heads, rows] and the un-normalised output o [heads, rows, dv]; afterwards the
// scratch holds exp(s - m) [heads, rows, tokens] from scores_offset on. Returns 0, or -1 for an unknown dtype code.
int run_chunk(const float* q, const uint16_t* qb, float scale, int heads, int rows, int d, int dv, int kt, int vt,
              const int64_t* runs, int nruns, int64_t tokens, float* scratch, float* m_out, float* l_out,
              float* o_out) {
  ChunkFn fn = nullptr;
  switch (kt) {
    case F32: fn = pick_value<F32>(vt); break;
    case F16: fn = pick_value<F16>(vt); break;
    case BF16: fn = pick_value<BF16>(vt); break;
    case I8: fn = pick_value<I8>(vt); break;
  }
  if (!fn) return -1;
  fn(q, qb, scale, heads, rows, d, dv, reinterpret_cast<const Run*>(runs), nruns, tokens, scratch, m_out, l_out,
     o_out);
  return 0;
}

// One chunk of a table (pointers as addresses): the arguments of one run_chunk (q_bf16: qb or 0; scale: the fp32
// bits of the scale in the low 32 bits) and p_out, where to copy exp(s - m) [heads, rows, tokens] (0: nowhere).
struct ChunkRow {
  int64_t q, q_bf16, scale, heads, rows, d, dv, kt, vt, runs, nruns, tokens, m_out, l_out, o_out, p_out;
};
constexpr int ROW = sizeof(ChunkRow) / sizeof(int64_t);  // int64 fields of a chunk's row in a table

// The fp32 value whose bits are the low 32 bits of a table field (ChunkRow and PagedCall's scale).
inline float float_bits(int64_t field) {
  const uint32_t bits = static_cast<uint32_t>(field);
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// The layout version Python checks (attnops/ops/common/cpu_kernels/layout.py): raise it with any change of meaning.
constexpr int LAYOUT_VERSION = 3;
struct Field {
  const char* name;
  size_t offset;
};
#define ATTNOPS_FIELD(S, f) Field{#f, offsetof(S, f) / sizeof(int64_t)}

template <size_t N>
std::string describe(const char* table, const Field (&fields)[N]) {
  std::string text = std::string("; ") + table;
  for (const Field& f : fields) text += std::string(" ") + f.name + ":" + std::to_string(f.offset);
  return text;
}

// Heads [h0, h1) of one chunk of a table: run_chunk on the chunk's runs moved to head h0 and on its outputs' rows of
// those heads (every head's result is computed on its own, so it has the same bits whichever heads a call takes).
// Returns run_chunk's code.
int run_heads(const ChunkRow& c, int h0, int h1, std::vector<float>& scratch, std::vector<Run>& moved) {
  const int rows = static_cast<int>(c.rows), d = static_cast<int>(c.d), dv = static_cast<int>(c.dv);
  const int heads = h1 - h0;
  const size_t need = static_cast<size_t>(scratch_floats(heads * rows, d, dv, c.tokens));
  if (scratch.size() < need) scratch.resize(need);
  const Run* runs = reinterpret_cast<const Run*>(c.runs);
  if (h0) {
    const int64_t ks = itemsize(static_cast<int>(c.kt)), vs = itemsize(static_cast<int>(c.vt));
    moved.assign(runs, runs + c.nruns);
    for (Run& u : moved) {
      u.k_addr += h0 * u.k_sn * ks;
      u.v_addr += h0 * u.v_sn * vs;
      for (int64_t* addr : {&u.ks_addr, &u.ko_addr})
        if (*addr) *addr += h0 * u.ks_sn * static_cast<int64_t>(sizeof(float));
      for (int64_t* addr : {&u.vs_addr, &u.vo_addr})
        if (*addr) *addr += h0 * u.vs_sn * static_cast<int64_t>(sizeof(float));
    }
    runs = moved.data();
  }
  const int64_t first = static_cast<int64_t>(h0) * rows;  // the heads' first row of the outputs
  const uint16_t* qb = c.q_bf16 ? reinterpret_cast<const uint16_t*>(c.q_bf16) + first * d : nullptr;
  const int code = run_chunk(reinterpret_cast<const float*>(c.q) + first * d, qb, float_bits(c.scale), heads, rows,
                             d, dv, static_cast<int>(c.kt), static_cast<int>(c.vt),
                             reinterpret_cast<const int64_t*>(runs), static_cast<int>(c.nruns), c.tokens,
                             scratch.data(),
                             reinterpret_cast<float*>(c.m_out) + first, reinterpret_cast<float*>(c.l_out) + first,
                             reinterpret_cast<float*>(c.o_out) + first * dv);
  if (code == 0 && c.p_out)
    std::memcpy(reinterpret_cast<float*>(c.p_out) + first * c.tokens,
                scratch.data() + scores_offset(heads * rows, d, dv), sizeof(float) * heads * rows * c.tokens);
  return code;
}

// A share of a table's work: heads [h0, h1) of chunk `row`.
struct Part {
  int row, h0, h1;
};

// The last chunks of a call are cut into this many parts (whole KV heads each, fewer where a chunk has fewer heads).
constexpr int TAIL_PARTS = 4;

// The parts of a table of n chunks for `threads` threads, in the order threads take them: whole chunks, then the last
// `threads` chunks in TAIL_PARTS parts each, so that what is left when the queue runs dry is short and no thread waits
// long for another one's last part (smaller parts cost more: each one walks the chunk's token descriptors again).
std::vector<Part> parts(const ChunkRow* table, int n, int threads) {
  const int whole = threads < 2 ? n : (n > threads ? n - threads : 0);
  std::vector<Part> out;
  for (int i = 0; i < n; ++i) {
    const int heads = static_cast<int>(table[i].heads);
    const int step = i < whole ? heads : (heads + TAIL_PARTS - 1) / TAIL_PARTS;
    for (int h = 0; h < heads; h += step) out.push_back({i, h, h + step < heads ? h + step : heads});
  }
  return out;
}

// Below this many K and V elements (heads x tokens x (d + dv), summed over the chunks) a call runs on the caller
// alone: waking a worker and reading the load cost more than the worker would win. The library's own workers sleep
// (about 0.1 ms of work on one core: measured break-even); PyTorch's OpenMP threads are mostly still spinning from
// the operators before (a few microseconds: two threads already win at 0.1M elements).
constexpr int64_t MIN_PARALLEL_ELEMENTS = int64_t{1} << 20;
constexpr int64_t MIN_PARALLEL_ELEMENTS_OPENMP = int64_t{1} << 16;

// The threads a call of `threads` runs on when the count is dynamic: the caller alone for a small call, else no
// more workers than there are CPUs that other processes leave free (threads.h's workers_with_a_cpu).
int dynamic_threads(const ChunkRow* rows, int n, int threads) {
  int64_t elements = 0;
  for (int i = 0; i < n; ++i) elements += rows[i].heads * rows[i].tokens * (rows[i].d + rows[i].dv);
  const int64_t least = attnops::openmp_team() ? MIN_PARALLEL_ELEMENTS_OPENMP : MIN_PARALLEL_ELEMENTS;
  return elements < least ? 1 : 1 + attnops::workers_with_a_cpu(threads - 1);
}

// The chunks of `rows` on up to `threads` threads: the caller and its workers (threads.h's run_on_pool), each
// taking the next part (parts()) from a shared counter; with `dynamic`, as many as dynamic_threads() says. Which
// thread computes a part does not change its result. Threads without work sleep instead of spinning. `done(part)`
// runs on the part's thread once it is computed. Returns 0, or the non-zero code of a part.
template <class Done>
int run_table(const ChunkRow* rows, int n, int threads, int dynamic, Done&& done) {
  if (dynamic && threads > 1) threads = dynamic_threads(rows, n, threads);
  const std::vector<Part> work = parts(rows, n, threads);
  const int count = static_cast<int>(work.size());
  std::atomic<int> next{0}, failed{0};
  attnops::run_on_pool(threads < count ? threads : count, [&] {
    thread_local std::vector<float> scratch;  // kept between calls: no page faults per call
    thread_local std::vector<Run> moved;
    for (int i = next++; i < count; i = next++) {
      const Part& part = work[i];
      const int code = run_heads(rows[part.row], part.h0, part.h1, scratch, moved);
      if (code != 0) failed = code;
      else done(part);
    }
  });
  return failed;
}

// ---- NSA decode over paged caches: one operator call in one library call ---------------------------------------
// Where a call's tensors lie (addresses; strides in elements) and what it reads. Selected attention (`picks` set):
// one chunk per request and KV head over the blocks of `unit` tokens that its `count` indices name, in order up to
// the first -1 (another negative index, or one at or past the length, selects nothing; a repeated one counts
// twice), each cut at the request's length. Compressed attention (`picks` 0): one chunk per request over all of
// its keys, every KV head. A length is clamped to [0, the block table's pages].
struct PagedCall {
  int64_t q, q_bf16, scale;  // q [batch, kv_heads, group, d] fp32, scaled, contiguous; unscaled bf16 (or 0); scale
  int64_t batch, kv_heads, group, d, dv;
  int64_t k_addr, k_sb, k_sp, k_sn, kt;      // key cache [blocks, page, kv_heads, d]: strides of a block, a row, a head
  int64_t v_addr, v_sb, v_sp, v_sn, vt;      // value cache [blocks, page, kv_heads, dv]
  int64_t blocks, page;
  int64_t table, table_sb, table_si, table_len, table_wide;  // block table [batch, table_len]; wide: int64, else int32
  int64_t lengths;                                           // int64 [batch]: the requests' KV lengths
  int64_t picks, picks_sb, picks_sn, picks_si, count, picks_wide, unit;  // indices [batch, kv_heads, count]
  int64_t out, probs;  // out [batch, kv_heads, group, dv] fp32; probs (0: none): per request [kv_heads, group, length]
};
constexpr int PAGED_CALL_FIELDS = sizeof(PagedCall) / sizeof(int64_t);

// A paged call found a key page outside the cache where the caller asked for every key (compressed attention).
constexpr int PAGE_OUTSIDE_CACHE = -2;

inline int64_t index_at(int64_t addr, bool wide, int64_t i) {
  return wide ? reinterpret_cast<const int64_t*>(addr)[i] : reinterpret_cast<const int32_t*>(addr)[i];
}

// Appends the runs of keys [start, end) of request b, KV head `head` (cut at page boundaries); returns the keys
// added. A page whose block is outside the cache adds none; `outside` counts such pages.
int64_t add_range(const PagedCall& c, int64_t b, int64_t head, int64_t start, int64_t end, std::vector<Run>& runs,
                  int64_t& outside) {
  const int64_t ks = itemsize(static_cast<int>(c.kt)), vs = itemsize(static_cast<int>(c.vt));
  int64_t added = 0;
  for (int64_t pos = start; pos < end;) {
    const int64_t row = pos % c.page, n = std::min(c.page - row, end - pos);
    const int64_t block = index_at(c.table, c.table_wide, b * c.table_sb + pos / c.page * c.table_si);
    pos += n;
    if (block < 0 || block >= c.blocks) {
      ++outside;
      continue;
    }
    Run u{};
    u.k_addr = c.k_addr + (block * c.k_sb + row * c.k_sp + head * c.k_sn) * ks;
    u.k_sn = c.k_sn;
    u.k_sl = c.k_sp;
    u.v_addr = c.v_addr + (block * c.v_sb + row * c.v_sp + head * c.v_sn) * vs;
    u.v_sn = c.v_sn;
    u.v_sl = c.v_sp;
    u.blocks = 1;
    u.length = n;
    runs.push_back(u);
    added += n;
  }
  return added;
}

int paged_attention(const PagedCall& c, int threads, int dynamic) {
  const bool selected = c.picks != 0;
  const int64_t jobs = selected ? c.batch * c.kv_heads : c.batch;
  const int64_t heads = selected ? 1 : c.kv_heads, rows = heads * c.group;  // query rows per job
  std::vector<Run> runs;
  std::vector<int64_t> first(jobs + 1, 0), tokens(jobs, 0);  // job j: runs [first[j], first[j + 1])
  int64_t outside = 0;
  for (int64_t j = 0; j < jobs; ++j) {
    const int64_t b = selected ? j / c.kv_heads : j, head = selected ? j % c.kv_heads : 0;
    const int64_t given = reinterpret_cast<const int64_t*>(c.lengths)[b];
    const int64_t length = std::clamp(given, int64_t{0}, c.table_len * c.page);
    if (!selected) {
      tokens[j] = add_range(c, b, 0, 0, length, runs, outside);
    } else {
      const int64_t at = c.picks + (b * c.picks_sb + head * c.picks_sn) * (c.picks_wide ? 8 : 4);
      const int64_t in_length = (length + c.unit - 1) / c.unit;  // the blocks that hold keys
      for (int64_t i = 0; i < c.count; ++i) {
        const int64_t pick = index_at(at, c.picks_wide, i * c.picks_si);
        if (pick == -1) break;
        if (pick < 0 || pick >= in_length) continue;
        tokens[j] += add_range(c, b, head, pick * c.unit, std::min((pick + 1) * c.unit, length), runs, outside);
      }
    }
    first[j + 1] = static_cast<int64_t>(runs.size());
  }
  if (!selected && outside) return PAGE_OUTSIDE_CACHE;
  // o straight into the output, then o / l there and exp(s - m) / l in place, on the thread that computed them
  float* out = reinterpret_cast<float*>(c.out);
  std::vector<float> m(jobs * rows), l(jobs * rows);
  std::vector<ChunkRow> table;
  std::vector<int64_t> job_of;  // the job of each chunk of the table
  int64_t probs = c.probs;
  for (int64_t j = 0; j < jobs; ++j) {
    if (tokens[j]) {
      table.push_back(ChunkRow{c.q + j * rows * c.d * 4, c.q_bf16 ? c.q_bf16 + j * rows * c.d * 2 : 0, c.scale,
                               heads, c.group, c.d, c.dv, c.kt, c.vt,
                               reinterpret_cast<int64_t>(runs.data() + first[j]), first[j + 1] - first[j], tokens[j],
                               reinterpret_cast<int64_t>(&m[j * rows]), reinterpret_cast<int64_t>(&l[j * rows]),
                               reinterpret_cast<int64_t>(out + j * rows * c.dv), probs});
      job_of.push_back(j);
    } else {
      std::fill(out + j * rows * c.dv, out + (j + 1) * rows * c.dv, 0.f);  // no keys: 0
    }
    if (probs) probs += rows * tokens[j] * 4;
  }
  return run_table(table.data(), static_cast<int>(table.size()), threads, dynamic, [&](const Part& part) {
    const ChunkRow& row = table[part.row];
    const int64_t first_row = job_of[part.row] * rows;
    for (int64_t i = part.h0 * c.group; i < part.h1 * c.group; ++i) {
      const float total = l[first_row + i];
      float* o = out + (first_row + i) * c.dv;
      for (int64_t e = 0; e < c.dv; ++e) o[e] /= total;
      if (row.p_out) {
        float* p = reinterpret_cast<float*>(row.p_out) + i * row.tokens;
        for (int64_t t = 0; t < row.tokens; ++t) p[t] /= total;
      }
    }
  });
}

}  // namespace

extern "C" {

// The chunks of `table` [n, ROW] (each row a ChunkRow) on up to `threads` threads (run_table). Returns 0, or the
// non-zero code of a part.
int attnops_decode_chunks_parallel(const int64_t* table, int n, int threads, int dynamic) {
  return run_table(reinterpret_cast<const ChunkRow*>(table), n, threads, dynamic, [](const Part&) {});
}

// One NSA decode call (`call`: a PagedCall) on up to `threads` threads as run_table runs them: the normalised output
// and probabilities. Returns 0; PAGE_OUTSIDE_CACHE (nothing written) for compressed attention whose keys lie partly
// outside the cache; or the non-zero code of a part.
int attnops_paged_attention(const int64_t* call, int threads, int dynamic) {
  return paged_attention(*reinterpret_cast<const PagedCall*>(call), threads, dynamic);
}

// The workers of later calls: PyTorch's OpenMP threads, through `parallel`, GNU OpenMP's GOMP_parallel in the copy
// PyTorch loaded (threads.h's run_on_pool); null: the library's own pool.
void attnops_use_openmp_team(void* parallel) {
  attnops::openmp_team() = reinterpret_cast<attnops::OpenMPParallel>(parallel);
}

// Whether chunks with bf16 keys and an unscaled bf16 query take their scores on the AMX tile unit (1) or with fp32
// FMAs (0) in this process.
int attnops_decode_tile_scores() {
#if ATTNOPS_AMX_SCORES
  return attnops::amx_granted() ? 1 : 0;
#else
  return 0;
#endif
}

// How many of `wanted` workers a call would find a CPU for now (threads.h's workers_with_a_cpu).
int attnops_workers_with_a_cpu(int wanted) { return attnops::workers_with_a_cpu(wanted); }

// The tables' layouts, as attnops/ops/common/cpu_kernels/layout.py describes them: "version V; Run name:offset ...;
// ChunkRow name:offset ...; DType name:code ..." (offsets in int64 fields).
const char* attnops_row_layout() {
  static const std::string text = [] {
    const Field run[] = {
        ATTNOPS_FIELD(Run, k_addr),  ATTNOPS_FIELD(Run, k_sr),    ATTNOPS_FIELD(Run, k_sn),
        ATTNOPS_FIELD(Run, k_sl),    ATTNOPS_FIELD(Run, v_addr),  ATTNOPS_FIELD(Run, v_sr),
        ATTNOPS_FIELD(Run, v_sn),    ATTNOPS_FIELD(Run, v_sl),    ATTNOPS_FIELD(Run, blocks),
        ATTNOPS_FIELD(Run, length),  ATTNOPS_FIELD(Run, ks_addr), ATTNOPS_FIELD(Run, ko_addr),
        ATTNOPS_FIELD(Run, ks_sr),   ATTNOPS_FIELD(Run, ks_sn),   ATTNOPS_FIELD(Run, ks_sl),
        ATTNOPS_FIELD(Run, vs_addr), ATTNOPS_FIELD(Run, vo_addr), ATTNOPS_FIELD(Run, vs_sr),
        ATTNOPS_FIELD(Run, vs_sn),   ATTNOPS_FIELD(Run, vs_sl)};
    const Field row[] = {
        ATTNOPS_FIELD(ChunkRow, q),     ATTNOPS_FIELD(ChunkRow, q_bf16), ATTNOPS_FIELD(ChunkRow, scale),
        ATTNOPS_FIELD(ChunkRow, heads), ATTNOPS_FIELD(ChunkRow, rows),
        ATTNOPS_FIELD(ChunkRow, d),     ATTNOPS_FIELD(ChunkRow, dv),     ATTNOPS_FIELD(ChunkRow, kt),
        ATTNOPS_FIELD(ChunkRow, vt),    ATTNOPS_FIELD(ChunkRow, runs),   ATTNOPS_FIELD(ChunkRow, nruns),
        ATTNOPS_FIELD(ChunkRow, tokens), ATTNOPS_FIELD(ChunkRow, m_out), ATTNOPS_FIELD(ChunkRow, l_out),
        ATTNOPS_FIELD(ChunkRow, o_out), ATTNOPS_FIELD(ChunkRow, p_out)};
    const Field call[] = {
        ATTNOPS_FIELD(PagedCall, q),          ATTNOPS_FIELD(PagedCall, q_bf16),    ATTNOPS_FIELD(PagedCall, scale),
        ATTNOPS_FIELD(PagedCall, batch),     ATTNOPS_FIELD(PagedCall, kv_heads),
        ATTNOPS_FIELD(PagedCall, group),      ATTNOPS_FIELD(PagedCall, d),         ATTNOPS_FIELD(PagedCall, dv),
        ATTNOPS_FIELD(PagedCall, k_addr),     ATTNOPS_FIELD(PagedCall, k_sb),      ATTNOPS_FIELD(PagedCall, k_sp),
        ATTNOPS_FIELD(PagedCall, k_sn),       ATTNOPS_FIELD(PagedCall, kt),        ATTNOPS_FIELD(PagedCall, v_addr),
        ATTNOPS_FIELD(PagedCall, v_sb),       ATTNOPS_FIELD(PagedCall, v_sp),      ATTNOPS_FIELD(PagedCall, v_sn),
        ATTNOPS_FIELD(PagedCall, vt),         ATTNOPS_FIELD(PagedCall, blocks),    ATTNOPS_FIELD(PagedCall, page),
        ATTNOPS_FIELD(PagedCall, table),      ATTNOPS_FIELD(PagedCall, table_sb),  ATTNOPS_FIELD(PagedCall, table_si),
        ATTNOPS_FIELD(PagedCall, table_len),  ATTNOPS_FIELD(PagedCall, table_wide), ATTNOPS_FIELD(PagedCall, lengths),
        ATTNOPS_FIELD(PagedCall, picks),      ATTNOPS_FIELD(PagedCall, picks_sb),  ATTNOPS_FIELD(PagedCall, picks_sn),
        ATTNOPS_FIELD(PagedCall, picks_si),   ATTNOPS_FIELD(PagedCall, count),     ATTNOPS_FIELD(PagedCall, picks_wide),
        ATTNOPS_FIELD(PagedCall, unit),       ATTNOPS_FIELD(PagedCall, out),       ATTNOPS_FIELD(PagedCall, probs)};
    static_assert(sizeof(run) / sizeof(Field) * sizeof(int64_t) == sizeof(Run), "every Run field described");
    static_assert(sizeof(row) / sizeof(Field) == ROW, "every ChunkRow field described");
    static_assert(sizeof(call) / sizeof(Field) == PAGED_CALL_FIELDS, "every PagedCall field described");
    return "version " + std::to_string(LAYOUT_VERSION) + describe("Run", run) + describe("ChunkRow", row) +
           describe("PagedCall", call) +
           "; DType F32:" + std::to_string(F32) + " F16:" + std::to_string(F16) + " BF16:" + std::to_string(BF16) +
           " I8:" + std::to_string(I8);
  }();
  return text.c_str();
}

}  // extern "C"
