// bf16 x bf16 -> fp32 GEMM for the chunked CPU attention engine (ops/common/bf16_products.py) on CPUs with
// AVX512-BF16: C = alpha * A B (+ C), A [m, k] row-major (row stride lda), B either [n, k] ("nt": B's rows are C's
// columns, as keys in Q K^T) or [k, n] ("nn": B's rows run along the reduction, as values in P V), C fp32 [m, n].
// attnops_bf16_gemm_grad is the backward's dP GEMM with dS = P (dP - D) formed in its registers and written rounded
// to bf16 (no fp32 dP or dS tile); attnops_transpose16 transposes the dK/dV GEMMs' bf16 operands;
// attnops_bf16_backward_tiles and attnops_bf16_forward_tiles run a job's tiles from a table (bf16_tiles.py).
//
// vdpbf16ps multiplies pairs of bf16 exactly and adds them to fp32 lanes: the products are those of an fp32 GEMM
// on the widened operands; only the order of the fp32 sums differs, and denormal inputs and results are flushed
// to zero (the instruction ignores MXCSR). Per block of KC reduction steps the B columns are packed in panels of
// NR = 64 (four vectors of 16 lanes, each lane one bf16 pair along k, zero-padded past n and k), and a 6 x 64
// register tile of C (24 accumulators) runs over the panel, each A pair broadcast from its row. Sums run in a fixed
// order (k pairs in order within a block, blocks in order), so a result does not depend on the calling thread.
//
// Where the build and the CPU have AMX-BF16 (and Linux grants the process the tile state), the products run on the
// tile unit instead: 32 x 64 blocks of C, each half of 32 columns from four 16 x 16 accumulator tiles, the A rows
// copied zero-padded into a 32 x KC block, the panels read as B tiles (their layout is AMX's pairs layout, padded
// with zero pairs to a multiple of 16). tdpbf16ps has vdpbf16ps' semantics (exact pair products, fp32 sums,
// denormals flushed); with alpha 1 the products are summed onto C in the tiles, otherwise scaled and added after.
// Which unit serves is decided once per process, so every result of a process comes from the same one, whatever
// the thread.
//
// Without AVX512-BF16 in the build (other CPUs, portable builds) or on the CPU running it, attnops_bf16_gemm_ready
// returns 0 and the entry points return 1: the engine keeps its fp32 products there.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define ATTNOPS_BF16_GEMM 1
#include <immintrin.h>
#else
#define ATTNOPS_BF16_GEMM 0
#endif
#include "amx.h"

namespace {

#if ATTNOPS_BF16_GEMM
constexpr int64_t MR = 6;         // C rows per register tile
constexpr int64_t NV = 4;         // vectors of 16 columns per register tile
constexpr int64_t NR = 16 * NV;   // C columns per panel
constexpr int64_t KC = 256;       // reduction steps per packed block (a panel: KC/2 x NR dwords = 32 KiB, in L1)

inline uint32_t load_pair(const uint16_t* p) {
  uint32_t x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

// Panels of B's columns [0, n) for reduction steps [k0, k1), `stride` pair rows each: panel q, pair t, lane j
// holds (B[k0 + 2t, 64q + j], B[k0 + 2t + 1, 64q + j]) as one dword (0 past n, k1 and the pairs).
void pack_nt(const uint16_t* b, int64_t ldb, int64_t n, int64_t k0, int64_t k1, int64_t stride, uint32_t* out) {
  const int64_t panels = (n + NR - 1) / NR, pairs = (k1 - k0) / 2;  // pairs: the whole ones
  std::memset(out, 0, sizeof(uint32_t) * panels * stride * NR);
  int64_t col = 0;
  if (16 * ldb < (int64_t{1} << 31)) {  // 16 columns at a time: pair t of each gathered into one vector
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(static_cast<int>(ldb)));
    for (; col + 16 <= n; col += 16) {
      const uint16_t* first = b + col * ldb + k0;
      uint32_t* dst = out + (col / NR) * stride * NR + col % NR;
      for (int64_t t = 0; t < pairs; ++t) _mm512_storeu_si512(dst + t * NR, _mm512_i32gather_epi32(rows, first + 2 * t, 2));
      if (2 * pairs < k1 - k0)
        for (int64_t j = 0; j < 16; ++j) dst[pairs * NR + j] = first[j * ldb + 2 * pairs];
    }
  }
  for (; col < n; ++col) {
    const uint16_t* row = b + col * ldb + k0;
    uint32_t* dst = out + (col / NR) * stride * NR + col % NR;
    int64_t t = 0;
    for (; 2 * t + 1 < k1 - k0; ++t) dst[t * NR] = load_pair(row + 2 * t);
    if (2 * t < k1 - k0) dst[t * NR] = row[2 * t];
  }
}

void pack_nn(const uint16_t* b, int64_t ldb, int64_t n, int64_t k0, int64_t k1, int64_t stride, uint32_t* out) {
  const int64_t pairs = (k1 - k0 + 1) / 2, panels = (n + NR - 1) / NR;
  for (int64_t q = 0; q < panels; ++q) {
    std::memset(out + (q * stride + pairs) * NR, 0, sizeof(uint32_t) * (stride - pairs) * NR);
    for (int64_t t = 0; t < pairs; ++t) {
      const uint16_t* lo = b + (k0 + 2 * t) * ldb;
      const bool has_hi = k0 + 2 * t + 1 < k1;
      uint32_t* dst = out + (q * stride + t) * NR;
      for (int64_t v = 0; v < NV; ++v) {
        const int64_t c0 = q * NR + 16 * v, valid = n - c0;
        const __mmask16 mask = valid >= 16 ? 0xFFFF : (valid <= 0 ? 0 : static_cast<__mmask16>((1u << valid) - 1u));
        const __m512i l = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, lo + c0));
        const __m512i h = has_hi ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, lo + ldb + c0))
                                 : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + 16 * v, _mm512_or_si512(l, _mm512_slli_epi32(h, 16)));
      }
    }
  }
}

// acc = A[0:R, k0:k1] panel: the register tile's sums, k pairs in order.
template <int R>
inline void products(const uint16_t* a, int64_t lda, int64_t k0, int64_t k1, const uint32_t* panel,
                     __m512 (&acc)[R][NV]) {
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  const int64_t full = (k1 - k0) / 2;
  for (int64_t t = 0; t < full; ++t) {
    const uint32_t* bp = panel + t * NR;
    __m512bh bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(bp + 16 * v);
    for (int i = 0; i < R; ++i) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(load_pair(a + i * lda + k0 + 2 * t)));
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], av, bv[v]);
    }
  }
  if ((k1 - k0) % 2) {  // the last step alone: its pair's high half is 0 in A and in the panel
    const uint32_t* bp = panel + full * NR;
    for (int i = 0; i < R; ++i) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i * lda + k1 - 1]));
      for (int v = 0; v < NV; ++v)
        acc[i][v] = _mm512_dpbf16_ps(acc[i][v], av, (__m512bh)_mm512_loadu_si512(bp + 16 * v));
    }
  }
}

inline __mmask16 lanes(int64_t valid) { return valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1u); }

// C[0:rows, 0:cols] (+)= alpha * the products, sums(i, v): those of row i, columns [16v, 16v + 16); add: C holds
// earlier sums (or the caller's C) to add to.
template <class Sums>
inline void store_tile(const Sums& sums, int64_t rows, float* c, int64_t ldc, int64_t cols, float alpha, bool add) {
  const __m512 va = _mm512_set1_ps(alpha);
  for (int v = 0; v < NV; ++v) {
    const int64_t valid = cols - 16 * v;
    if (valid <= 0) break;
    const __mmask16 mask = lanes(valid);
    for (int64_t i = 0; i < rows; ++i) {
      float* dst = c + i * ldc + 16 * v;
      __m512 r = _mm512_mul_ps(sums(i, v), va);
      if (add) r = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, dst), r);
      _mm512_mask_storeu_ps(dst, mask, r);
    }
  }
}

// C[0:R, 0:cols] (+)= alpha * A[0:R, k0:k1] panel (store_tile).
template <int R>
void tile(const uint16_t* a, int64_t lda, int64_t k0, int64_t k1, const uint32_t* panel, float* c, int64_t ldc,
          int64_t cols, float alpha, bool add) {
  __m512 acc[R][NV];
  products<R>(a, lda, k0, k1, panel, acc);
  store_tile([&](int64_t i, int v) { return acc[i][v]; }, R, c, ldc, cols, alpha, add);
}

// The score gradient of rows [0, R) and columns [0, cols) of a panel, from dP = A[0:R, 0:k] panel (one reduction
// block): ds16 = bf16(P * (dP - delta)) (0 where unit_zero and P == 1), the formula and rounding of
// attnops_softmax_grad with its bf16 copy (softmax.cpp) on the dP that attnops_bf16_gemm would write.
template <class Sums>
inline void store_grad(const Sums& sums, int64_t rows, const float* p, int64_t ldp, const float* delta,
                       bool unit_zero, uint16_t* ds16, int64_t ld16, int64_t cols) {
  for (int v = 0; v < NV; ++v) {
    const int64_t valid = cols - 16 * v;
    if (valid <= 0) break;
    const __mmask16 mask = lanes(valid);
    for (int64_t i = 0; i < rows; ++i) {
      const __m512 pv = _mm512_maskz_loadu_ps(mask, p + i * ldp + 16 * v);
      __m512 ds = _mm512_mul_ps(pv, _mm512_sub_ps(sums(i, v), _mm512_set1_ps(delta[i])));
      if (unit_zero) ds = _mm512_mask_mov_ps(ds, _mm512_cmp_ps_mask(pv, _mm512_set1_ps(1.0f), _CMP_EQ_OQ),
                                             _mm512_setzero_ps());
      _mm256_mask_storeu_epi16(ds16 + i * ld16 + 16 * v, mask, (__m256i)_mm512_cvtneps_pbh(ds));
    }
  }
}

template <int R>
void grad_tile(const uint16_t* a, int64_t lda, int64_t k, const uint32_t* panel, const float* p, int64_t ldp,
               const float* delta, bool unit_zero, uint16_t* ds16, int64_t ld16, int64_t cols) {
  __m512 acc[R][NV];
  products<R>(a, lda, 0, k, panel, acc);
  store_grad([&](int64_t i, int v) { return acc[i][v]; }, R, p, ldp, delta, unit_zero, ds16, ld16, cols);
}

using GradFn = void (*)(const uint16_t*, int64_t, int64_t, const uint32_t*, const float*, int64_t, const float*, bool,
                        uint16_t*, int64_t, int64_t);
constexpr GradFn kGradTiles[MR + 1] = {nullptr,      grad_tile<1>, grad_tile<2>, grad_tile<3>,
                                       grad_tile<4>, grad_tile<5>, grad_tile<6>};

using TileFn = void (*)(const uint16_t*, int64_t, int64_t, int64_t, const uint32_t*, float*, int64_t, int64_t, float,
                        bool);
constexpr TileFn kTiles[MR + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

bool cpu_has_bf16() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  return has;
}

#if ATTNOPS_AMX
constexpr int64_t AM = 32;  // C rows per tile block (two tiles of 16)

using attnops::amx_granted;
using attnops::Tiles;

// out [AM, KC] = A[0:rows, k0:k1], zero past rows and k1 (whole tile rows to read, and nothing past the operand)
void pack_rows(const uint16_t* a, int64_t lda, int64_t rows, int64_t k0, int64_t k1, uint16_t* out) {
  const int64_t width = (k1 - k0 + 31) / 32 * 32;  // what the tiles read of each row
  for (int64_t i = 0; i < AM; ++i) {
    const int64_t valid = i < rows ? k1 - k0 : 0;
    if (valid) std::memcpy(out + i * KC, a + i * lda + k0, sizeof(uint16_t) * valid);
    std::memset(out + i * KC + valid, 0, sizeof(uint16_t) * (width - valid));
  }
}

// c [AM, NR] (row stride ldc) = rows (pack_rows) times a panel of `stride` pair rows (a multiple of 16), 16 pairs at
// a time in order, summed onto c's own values with `onto`, else from 0; in two halves of 32 columns. Tiles: tmm0-3
// the four 16 x 16 quarters of a half, tmm4-5 16 A rows x 32 bf16 each, tmm6-7 16 pairs x 16 columns of a panel each
// (every tile loaded feeds two products, and none is loaded again while a product still reads it).
void block_products(const uint16_t* rows, const uint32_t* panel, int64_t stride, float* c, int64_t ldc, bool onto) {
  const int64_t step = ldc * static_cast<int64_t>(sizeof(float));
  for (int64_t half = 0; half < NR; half += 32) {
    float* top = c + half;
    float* bottom = top + 16 * ldc;
    if (onto) {
      _tile_loadd(0, top, step);
      _tile_loadd(1, top + 16, step);
      _tile_loadd(2, bottom, step);
      _tile_loadd(3, bottom + 16, step);
    } else {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t t = 0; t < stride; t += 16) {
      const uint32_t* b = panel + t * NR + half;
      _tile_loadd(4, rows + 2 * t, KC * sizeof(uint16_t));
      _tile_loadd(5, rows + 16 * KC + 2 * t, KC * sizeof(uint16_t));
      _tile_loadd(6, b, NR * sizeof(uint32_t));
      _tile_loadd(7, b + 16, NR * sizeof(uint32_t));
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, top, step);
    _tile_stored(1, top + 16, step);
    _tile_stored(2, bottom, step);
    _tile_stored(3, bottom + 16, step);
  }
}

// C[0:rows, 0:cols] (+)= alpha * A-rows x panel on the tile unit. With alpha 1 the products are summed onto C in
// the tiles (a whole block straight in C, a part through a copy); a whole block without `add` is scaled in C; else
// they are scaled and added from a copy (store_tile).
void tile_block(const uint16_t* rows_of_a, int64_t rows, const uint32_t* panel, int64_t stride, float* c, int64_t ldc,
                int64_t cols, float alpha, bool add) {
  if (alpha == 1.0f && rows == AM && cols == NR) return block_products(rows_of_a, panel, stride, c, ldc, add);
  if (!add && rows == AM && cols == NR) {  // the products straight in C, then scaled there
    block_products(rows_of_a, panel, stride, c, ldc, false);
    const __m512 va = _mm512_set1_ps(alpha);
    for (int64_t i = 0; i < AM; ++i)
      for (int v = 0; v < NV; ++v) {
        float* row = c + i * ldc + 16 * v;
        _mm512_storeu_ps(row, _mm512_mul_ps(_mm512_loadu_ps(row), va));
      }
    return;
  }
  alignas(64) float sums[AM * NR];
  const bool onto = alpha == 1.0f && add;
  if (onto) {
    std::memset(sums, 0, sizeof sums);
    for (int64_t i = 0; i < rows; ++i) std::memcpy(sums + i * NR, c + i * ldc, sizeof(float) * cols);
  }
  block_products(rows_of_a, panel, stride, sums, NR, onto);
  store_tile([&](int64_t i, int v) { return _mm512_load_ps(sums + i * NR + 16 * v); }, rows, c, ldc, cols,
             onto ? 1.0f : alpha, add && !onto);
}
#endif

// Whether the products run on the tile unit (AMX) in this process.
bool use_amx() {
#if ATTNOPS_AMX
  return amx_granted();
#else
  return false;
#endif
}

// Pair rows per packed panel: the block's pairs, padded to whole B tiles (16 pairs) for the tile unit.
inline int64_t panel_stride(int64_t pairs, bool amx) { return amx ? (pairs + 15) / 16 * 16 : pairs; }

// A tile's band (MaskSpec.tile_band, as attnops_softmax_block takes it): row i keeps column j where
// lo <= j - i <= hi or j < prefix.
struct Band {
  int64_t lo, hi, prefix;
};

// Whether the band masks every entry of rows [i0, i0 + rows) x columns [j0, j0 + cols): none is a prefix column
// and all lie left or right of the rows' band (the spans [i + lo, i + hi] of consecutive rows make one span).
inline bool masked_whole(const Band* band, int64_t i0, int64_t rows, int64_t j0, int64_t cols) {
  return band != nullptr && j0 >= band->prefix &&
         (band->hi < band->lo || j0 + cols - 1 < i0 + band->lo || j0 > i0 + rows - 1 + band->hi);
}

// attnops_bf16_gemm on this CPU; band: C is a score tile that band masks afterwards, so register tiles it masks
// whole are skipped (left as they are: the softmax pass writes -inf over them).
void gemm(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int b_nt,
          float* c, int64_t ldc, float alpha, int accumulate, const Band* band) {
  if (k == 0) {
    for (int64_t i = 0; i < m && !accumulate; ++i) std::memset(c + i * ldc, 0, sizeof(float) * n);
    return;
  }
  thread_local std::vector<uint32_t> packed;
  const int64_t panels = (n + NR - 1) / NR;
  packed.resize(static_cast<size_t>(panels * (KC / 2) * NR));  // KC / 2: a multiple of 16 pairs
  const bool amx = use_amx();
  for (int64_t k0 = 0; k0 < k; k0 += KC) {
    const int64_t k1 = k0 + KC < k ? k0 + KC : k;
    const int64_t stride = panel_stride((k1 - k0 + 1) / 2, amx);
    (b_nt ? pack_nt : pack_nn)(b, ldb, n, k0, k1, stride, packed.data());
    const bool add = accumulate || k0 > 0;
#if ATTNOPS_AMX
    if (amx) {
      const Tiles tiles;
      thread_local std::vector<uint16_t> rows_of_a(AM * KC);
      for (int64_t i = 0; i < m; i += AM) {
        const int64_t rows = m - i < AM ? m - i : AM;
        pack_rows(a + i * lda, lda, rows, k0, k1, rows_of_a.data());
        for (int64_t q = 0; q < panels; ++q) {
          const int64_t cols = n - q * NR < NR ? n - q * NR : NR;
          if (!masked_whole(band, i, rows, q * NR, cols))
            tile_block(rows_of_a.data(), rows, packed.data() + q * stride * NR, stride, c + i * ldc + q * NR, ldc,
                       cols, alpha, add);
        }
      }
      continue;
    }
#endif
    for (int64_t q = 0; q < panels; ++q) {
      const uint32_t* panel = packed.data() + q * stride * NR;
      const int64_t cols = n - q * NR < NR ? n - q * NR : NR;
      for (int64_t i = 0; i < m; i += MR) {
        const int64_t rows = m - i < MR ? m - i : MR;
        if (!masked_whole(band, i, rows, q * NR, cols))
          kTiles[rows](a + i * lda, lda, k0, k1, panel, c + i * ldc + q * NR, ldc, cols, alpha, add);
      }
    }
  }
}
#endif

}  // namespace

extern "C" {

// Whether this build and this CPU run the bf16 GEMM, and on what: 2 on the tile unit (AMX-BF16), 1 on vdpbf16ps
// (AVX512-BF16), 0 not at all.
int attnops_bf16_gemm_ready() {
#if ATTNOPS_BF16_GEMM
  return cpu_has_bf16() ? (use_amx() ? 2 : 1) : 0;
#else
  return 0;
#endif
}

// C = alpha * A B (+ C when accumulate); b_nt: B is [n, k] (row stride ldb), else [k, n]. Returns 0, or 1 where
// the GEMM is not available (attnops_bf16_gemm_ready).
int attnops_bf16_gemm(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
                      int b_nt, float* c, int64_t ldc, float alpha, int accumulate) {
#if ATTNOPS_BF16_GEMM
  if (!cpu_has_bf16()) return 1;
  gemm(m, n, k, a, lda, b, ldb, b_nt, c, ldc, alpha, accumulate, nullptr);
  return 0;
#else
  (void)m, (void)n, (void)k, (void)a, (void)lda, (void)b, (void)ldb, (void)b_nt, (void)c, (void)ldc, (void)alpha,
      (void)accumulate;
  return 1;
#endif
}

// dst [cols, rows] (row stride ldd) = src [rows, cols] (row stride lds) transposed, for 16-bit elements (bf16
// operands): in 16 x 16 blocks, each read and written while in L1 (PyTorch's strided copy of a transposed bf16
// operand runs about ten times slower). Available on every CPU. Returns 0.
int attnops_transpose16(int64_t rows, int64_t cols, const uint16_t* src, int64_t lds, uint16_t* dst, int64_t ldd) {
  constexpr int64_t B = 16;
  for (int64_t i0 = 0; i0 < rows; i0 += B) {
    const int64_t i1 = i0 + B < rows ? i0 + B : rows;
    for (int64_t j0 = 0; j0 < cols; j0 += B) {
      const int64_t j1 = j0 + B < cols ? j0 + B : cols;
      for (int64_t j = j0; j < j1; ++j)
        for (int64_t i = i0; i < i1; ++i) dst[j * ldd + i] = src[i * lds + j];
    }
  }
  return 0;
}

// The backward's score gradient rounded for its products, without an fp32 dP or dS tile: ds16 [m, n] (bf16, row
// stride ld16) = P * (A B^T - delta), 0 where unit_zero and P == 1; A [m, k] (dy rows), B [n, k] (values), P [m, n]
// fp32 (row stride ldp), delta [m]. Returns 0; 1 where the GEMM is not available; 2 for k > 256 (more than one
// reduction block: call attnops_bf16_gemm and attnops_softmax_grad).
int attnops_bf16_gemm_grad(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda, const uint16_t* b,
                           int64_t ldb, const float* p, int64_t ldp, const float* delta, int unit_zero, uint16_t* ds16,
                           int64_t ld16) {
#if ATTNOPS_BF16_GEMM
  if (!cpu_has_bf16()) return 1;
  if (k > KC || k == 0) return 2;
  thread_local std::vector<uint32_t> packed;
  const bool amx = use_amx();
  const int64_t panels = (n + NR - 1) / NR, stride = panel_stride((k + 1) / 2, amx);
  packed.resize(static_cast<size_t>(panels * stride * NR));
  pack_nt(b, ldb, n, 0, k, stride, packed.data());
#if ATTNOPS_AMX
  if (amx) {
    const Tiles tiles;
    thread_local std::vector<uint16_t> rows_of_a(AM * KC);
    alignas(64) float sums[AM * NR];
    for (int64_t i = 0; i < m; i += AM) {
      const int64_t rows = m - i < AM ? m - i : AM;
      pack_rows(a + i * lda, lda, rows, 0, k, rows_of_a.data());
      for (int64_t q = 0; q < panels; ++q) {
        const int64_t cols = n - q * NR < NR ? n - q * NR : NR;
        block_products(rows_of_a.data(), packed.data() + q * stride * NR, stride, sums, NR, false);
        store_grad([&](int64_t r, int v) { return _mm512_load_ps(sums + r * NR + 16 * v); }, rows, p + i * ldp + q * NR,
                   ldp, delta + i, unit_zero != 0, ds16 + i * ld16 + q * NR, ld16, cols);
      }
    }
    return 0;
  }
#endif
  for (int64_t q = 0; q < panels; ++q) {
    const int64_t cols = n - q * NR < NR ? n - q * NR : NR;
    for (int64_t i = 0; i < m; i += MR) {
      const int64_t rows = m - i < MR ? m - i : MR;
      kGradTiles[rows](a + i * lda, lda, k, packed.data() + q * stride * NR, p + i * ldp + q * NR, ldp, delta + i,
                       unit_zero != 0, ds16 + i * ld16 + q * NR, ld16, cols);
    }
  }
  return 0;
#else
  (void)m, (void)n, (void)k, (void)a, (void)lda, (void)b, (void)ldb, (void)p, (void)ldp, (void)delta, (void)unit_zero,
      (void)ds16, (void)ld16;
  return 1;
#endif
}

// The scores S = alpha Q K^T [r, c] of a one-call tile whose softmax pass masks the band (lo, hi, prefix)
// afterwards: register tiles the band masks whole are not computed. Returns attnops_bf16_gemm's codes.
static int band_scores(int64_t r, int64_t c, int64_t d, const uint16_t* q, int64_t ldq, const uint16_t* k, int64_t ldk,
                       float* s, int64_t lds, float alpha, int64_t lo, int64_t hi, int64_t prefix) {
#if ATTNOPS_BF16_GEMM
  if (!cpu_has_bf16()) return 1;
  const Band band{lo, hi, prefix};
  gemm(r, c, d, q, ldq, k, ldk, 1, s, lds, alpha, 0, &band);
  return 0;
#else
  (void)r, (void)c, (void)d, (void)q, (void)ldq, (void)k, (void)ldk, (void)s, (void)lds, (void)alpha, (void)lo,
      (void)hi, (void)prefix;
  return 1;
#endif
}

// The softmax passes of the forward and backward (softmax.cpp).
int attnops_softmax_block(float* s, int64_t rows, int64_t cols, int64_t ld, float* m, float* l, float* rescale,
                          int first, int clamp, uint16_t* out16, int64_t ld16, int64_t lo, int64_t hi,
                          int64_t prefix);
int attnops_softmax_probs(float* s, int64_t rows, int64_t cols, int64_t ld, const float* m, const float* neg_log2_l,
                          uint16_t* out16, int64_t ld16, int64_t lo, int64_t hi, int64_t prefix);

// One tile of the bf16 backward (r query rows x c keys, head dims d and dv): the engine's six calls of a tile
// without explicit mask, pse, dropout or softcap, in the same order (so the same bits), without the GIL between
// them. From the staged operands Q [r, d] and Q^T [d, r], dy [r, dv] and dy^T [dv, r], the tile's keys K [c, d]
// and values V [c, dv], the rows' statistics m and -log2(l) and delta: S = alpha Q K^T (s, fp32), masked by the
// tile's band (lo, hi, prefix: see attnops_softmax_block; register tiles it masks whole are not computed),
// P = exp2(...) in place with its bf16 copy p16, dV^T += dy^T P (tv [dv, c]), ds16 = P (dy V^T - delta) (0 where
// unit_zero and P == 1), dQ += alpha dS K (dq [r, d]), dK^T += alpha Q^T dS (tk [d, c]). Returns 0; 1 where the
// GEMM is not available; 2 for dv > 256 (see attnops_bf16_gemm_grad).
static int backward_tile(int64_t r, int64_t c, int64_t d, int64_t dv, const uint16_t* q, int64_t ldq,
                         const uint16_t* qt, int64_t ldqt, const uint16_t* dy, int64_t lddy, const uint16_t* dyt,
                         int64_t lddyt, const uint16_t* k, int64_t ldk, const uint16_t* v, int64_t ldv, const float* m,
                         const float* neg_log2_l, const float* delta, int unit_zero, float alpha, float* s,
                         int64_t lds, uint16_t* p16, int64_t ldp16, uint16_t* ds16, int64_t ldds, float* dq,
                         int64_t lddq, float* tk, int64_t ldtk, float* tv, int64_t ldtv, int64_t lo, int64_t hi,
                         int64_t prefix) {
  if (dv > 256 || dv == 0) return 2;  // attnops_bf16_gemm_grad's one reduction block, checked before any write
  int code = band_scores(r, c, d, q, ldq, k, ldk, s, lds, alpha, lo, hi, prefix);
  if (code) return code;
  attnops_softmax_probs(s, r, c, lds, m, neg_log2_l, p16, ldp16, lo, hi, prefix);
  code = attnops_bf16_gemm(dv, c, r, dyt, lddyt, p16, ldp16, 0, tv, ldtv, 1.0f, 1);
  if (!code) code = attnops_bf16_gemm_grad(r, c, dv, dy, lddy, v, ldv, s, lds, delta, unit_zero, ds16, ldds);
  if (!code) code = attnops_bf16_gemm(r, d, c, ds16, ldds, k, ldk, 0, dq, lddq, alpha, 1);
  if (!code) code = attnops_bf16_gemm(d, c, r, qt, ldqt, ds16, ldds, 0, tk, ldtk, alpha, 1);
  return code;
}

}  // extern "C"

namespace {

// An operand of a job's tiles as attnops_bf16_backward_tiles and attnops_bf16_forward_tiles take it: heads x rows x
// cols elements from address ptr, strides s_head and s_row, unit column stride (the caller checks the dtype and the
// column stride).
struct View {
  int64_t ptr, heads, rows, cols, s_head, s_row;
  template <class T>
  T* at(int64_t h, int64_t i, int64_t j) const {
    return reinterpret_cast<T*>(ptr) + h * s_head + i * s_row + j;
  }
  // Whether [h] x [i0, i1) x [j0, j1) is a non-empty part of the operand.
  bool covers(int64_t h, int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    return 0 <= h && h < heads && 0 <= i0 && i0 < i1 && i1 <= rows && 0 <= j0 && j0 < j1 && j1 <= cols;
  }
};

// The operands of attnops_bf16_backward_tiles, in the order of its views argument.
enum Operand { kQ, kDy, kM, kNegLog2L, kDelta, kDq, kK, kV, kTk, kTv, kS, kP16, kDs16, kQs, kQt, kDys, kDyt, kViews };
constexpr int64_t kTableColumns = 9;  // h, r0, r1, c0, c1, lo, hi, prefix, tcol

// Whether every tile of the table reads and writes inside its operands (checked before any tile runs).
bool table_fits(int64_t n, const int64_t* table, const View* x) {
  const int64_t d = x[kQ].cols, dv = x[kDy].cols;
  bool ok = x[kDq].cols == d && x[kK].cols == d && x[kTk].rows == d && x[kV].cols == dv && x[kTv].rows == dv &&
            x[kK].heads == 1 && x[kV].heads == 1 && x[kTk].heads == 1 && x[kTv].heads == 1;
  for (int s : {kM, kNegLog2L, kDelta}) ok = ok && x[s].cols == 1 && x[s].s_row == 1;
  for (int64_t t = 0; t < n && ok; ++t) {
    const int64_t* e = table + t * kTableColumns;
    const int64_t h = e[0], r0 = e[1], r1 = e[2], c0 = e[3], c1 = e[4], lo = e[5], hi = e[6], tcol = e[8];
    const int64_t r = r1 - r0, c = c1 - c0;
    for (int o : {kQ, kDy, kM, kNegLog2L, kDelta, kDq}) ok = ok && x[o].covers(h, r0, r1, 0, x[o].cols);
    ok = ok && x[kK].covers(0, c0, c1, 0, d) && x[kV].covers(0, c0, c1, 0, dv) &&
         x[kTk].covers(0, 0, d, tcol, tcol + c) && x[kTv].covers(0, 0, dv, tcol, tcol + c) && lo >= -r && hi <= c;
    for (int w : {kS, kP16, kDs16}) ok = ok && x[w].covers(0, 0, 1, 0, r * c);
    for (int w : {kQs, kQt}) ok = ok && x[w].covers(0, 0, 1, 0, r * d);
    for (int w : {kDys, kDyt}) ok = ok && x[w].covers(0, 0, 1, 0, r * dv);
  }
  return ok;
}

// Rows [i0, i1) of head h of a bf16 operand staged as the engine stages them (tile_products.Bf16Products.rows and
// transposed): *a (row stride *lda) is the rows, in place where they are dense, else copied densely into dense; t
// receives their transpose [cols, rows].
void stage_rows(const View& x, int64_t h, int64_t i0, int64_t i1, uint16_t* dense, uint16_t* t, const uint16_t** a,
                int64_t* lda) {
  const int64_t rows = i1 - i0, cols = x.cols;
  *a = x.at<const uint16_t>(h, i0, 0);
  *lda = x.s_row;
  if (rows > 1 && x.s_row != cols) {
    for (int64_t i = 0; i < rows; ++i) std::memcpy(dense + i * cols, *a + i * x.s_row, sizeof(uint16_t) * cols);
    *a = dense;
    *lda = cols;
  }
  attnops_transpose16(rows, cols, *a, *lda, t, rows);
}

}  // namespace

extern "C" {

// The one-call backward tiles of a job (of one KV head) in one call, in the table's order: n rows of
// (h, r0, r1, c0, c1, lo, hi, prefix, tcol), each the tile of query head h, rows [r0, r1) and keys [c0, c1) with its
// band (lo, hi, prefix), whose dK^T/dV^T sums go to columns [tcol, tcol + c1 - c0) of tk/tv. views: kViews
// operands of 6 int64 (View): Q [G, Sq, d] and dy [G, Sq, dv] (bf16), m, -log2(l), delta [G, Sq, 1] and
// dq [G, Sq, d] (fp32), K [1, Skv, d] and V [1, Skv, dv] (bf16), tk [1, d, W] and tv [1, dv, W] (fp32), then the
// workspaces (1 x 1 x size): s (fp32), p16, ds16, the staged Q and dy rows and their transposes (bf16). The rows of
// a (h, r0, r1) are staged and transposed where they differ from the previous tile's. Returns 0; 1 where the GEMM
// is not available; 2 for dv > 256; 3 (before any write) where a tile would read or write outside its operands.
int attnops_bf16_backward_tiles(int64_t n, const int64_t* table, const int64_t* views, int unit_zero, float alpha) {
  View x[kViews];
  std::memcpy(x, views, sizeof x);
  if (!table_fits(n, table, x)) return 3;
  const int64_t d = x[kQ].cols, dv = x[kDy].cols;
  uint16_t *qt = x[kQt].at<uint16_t>(0, 0, 0), *dyt = x[kDyt].at<uint16_t>(0, 0, 0);
  const uint16_t *q = nullptr, *dy = nullptr;
  int64_t ldq = 0, lddy = 0;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t* e = table + t * kTableColumns;
    const int64_t h = e[0], r0 = e[1], r1 = e[2], c0 = e[3], c1 = e[4], r = r1 - r0, c = c1 - c0;
    if (t == 0 || h != e[-kTableColumns] || r0 != e[1 - kTableColumns] || r1 != e[2 - kTableColumns]) {
      stage_rows(x[kQ], h, r0, r1, x[kQs].at<uint16_t>(0, 0, 0), qt, &q, &ldq);
      stage_rows(x[kDy], h, r0, r1, x[kDys].at<uint16_t>(0, 0, 0), dyt, &dy, &lddy);
    }
    const int code = backward_tile(
        r, c, d, dv, q, ldq, qt, r, dy, lddy, dyt, r, x[kK].at<const uint16_t>(0, c0, 0), x[kK].s_row,
        x[kV].at<const uint16_t>(0, c0, 0), x[kV].s_row, x[kM].at<const float>(h, r0, 0),
        x[kNegLog2L].at<const float>(h, r0, 0), x[kDelta].at<const float>(h, r0, 0), unit_zero, alpha,
        x[kS].at<float>(0, 0, 0), c, x[kP16].at<uint16_t>(0, 0, 0), c, x[kDs16].at<uint16_t>(0, 0, 0), c,
        x[kDq].at<float>(h, r0, 0), x[kDq].s_row, x[kTk].at<float>(0, 0, e[8]), x[kTk].s_row,
        x[kTv].at<float>(0, 0, e[8]), x[kTv].s_row, e[5], e[6], e[7]);
    if (code) return code;
  }
  return 0;
}

// A column block of the forward for r query rows in one call: the engine's calls of a tile without explicit mask,
// pse, dropout or softcap, in their order (so the same bits), without the GIL between them. S = alpha Q K^T (s,
// fp32; Q [r, d], K [c, d]), masked by the tile's band (lo, hi, prefix: see attnops_softmax_block; register tiles
// it masks whole are not computed), the online softmax's block on it with P rounded into p16 (m, l and rescale as
// attnops_softmax_block's; clamp: a first block's -inf max becomes the lowest float), then with V [c, dv]: the
// first block (rescale null) O = P V (o [r, dv]); a later one pv = P V, then O = O * rescale + pv, rounded after
// the product and after the sum as the engine's two tensor operations (two loops: no fused multiply-add). Returns
// 0; 1 where the GEMM is not available.
static int forward_tile(int64_t r, int64_t c, int64_t d, int64_t dv, const uint16_t* q, int64_t ldq,
                        const uint16_t* k, int64_t ldk, const uint16_t* v, int64_t ldv, float alpha, float* m,
                        float* l, float* rescale, int clamp, float* s, int64_t lds, uint16_t* p16, int64_t ldp16,
                        float* pv, int64_t ldpv, float* o, int64_t ldo, int64_t lo, int64_t hi, int64_t prefix) {
  int code = band_scores(r, c, d, q, ldq, k, ldk, s, lds, alpha, lo, hi, prefix);
  if (code) return code;
  const bool first = rescale == nullptr;
  attnops_softmax_block(s, r, c, lds, m, l, rescale, first, clamp, p16, ldp16, lo, hi, prefix);
  code = attnops_bf16_gemm(r, dv, c, p16, ldp16, v, ldv, 0, first ? o : pv, first ? ldo : ldpv, 1.0f, 0);
  for (int64_t i = 0; i < r && !first && !code; ++i) {
    float* row = o + i * ldo;
    const float* add = pv + i * ldpv;
    for (int64_t j = 0; j < dv; ++j) row[j] *= rescale[i];
    for (int64_t j = 0; j < dv; ++j) row[j] += add[j];
  }
  return code;
}


}  // extern "C"

namespace {

// The operands of attnops_bf16_forward_tiles, in the order of its views argument.
enum ForwardOperand { kFq, kFk, kFv, kFm, kFl, kFo, kFs, kFp16, kFpv, kFrescale, kFqs, kForwardViews };
constexpr int64_t kForwardColumns = 10;  // r0, r1, c0, c1, lo, hi, prefix, first, clamp, orow

// Whether every block of the forward's table reads and writes inside its operands (checked before any runs).
bool forward_table_fits(int64_t n, const int64_t* table, const View* x) {
  const int64_t d = x[kFq].cols, dv = x[kFv].cols;
  bool ok = x[kFk].cols == d && x[kFo].cols == dv;
  for (int o = kFq; o < kForwardViews; ++o) ok = ok && x[o].heads == 1;
  for (int s : {kFm, kFl}) ok = ok && x[s].cols == 1 && x[s].s_row == 1;
  for (int64_t t = 0; t < n && ok; ++t) {
    const int64_t* e = table + t * kForwardColumns;
    const int64_t r0 = e[0], r1 = e[1], c0 = e[2], c1 = e[3], lo = e[4], hi = e[5], orow = e[9];
    const int64_t r = r1 - r0, c = c1 - c0;
    ok = x[kFq].covers(0, r0, r1, 0, d) && x[kFm].covers(0, r0, r1, 0, 1) && x[kFl].covers(0, r0, r1, 0, 1) &&
         x[kFk].covers(0, c0, c1, 0, d) && x[kFv].covers(0, c0, c1, 0, dv) &&
         x[kFo].covers(0, orow, orow + r, 0, dv) && lo >= -r && hi <= c && (t > 0 || e[7]) &&
         x[kFs].covers(0, 0, 1, 0, r * c) && x[kFp16].covers(0, 0, 1, 0, r * c) &&
         x[kFpv].covers(0, 0, 1, 0, r * dv) && x[kFrescale].covers(0, 0, 1, 0, r) && x[kFqs].covers(0, 0, 1, 0, r * d);
    // a later block continues the rows of the block before it
    ok = ok && (e[7] || (r0 == e[-kForwardColumns] && r1 == e[1 - kForwardColumns] && orow == e[9 - kForwardColumns]));
  }
  return ok;
}

}  // namespace

extern "C" {

// The forward's column blocks of a job (row chunks of one query head) in one call, in the table's order: n rows of
// (r0, r1, c0, c1, lo, hi, prefix, first, clamp, orow), each the block of rows [r0, r1) and keys [c0, c1) with its
// band (lo, hi, prefix), the first block of its rows (first: m, l and O start there; clamp: see
// attnops_softmax_block) or a later one of the same rows, whose O rows are rows [orow, orow + r1 - r0) of o. views:
// kForwardViews operands of 6 int64 (View, one head each): Q [Sq, d] (bf16), K [Skv, d] and V [Skv, dv] (bf16),
// m and l [Sq, 1] and O [rows, dv] (fp32), then the workspaces (1 x 1 x size): s (fp32), p16 (bf16), pv and
// rescale (fp32), the staged Q rows (bf16). A first block stages its Q rows (dense, where they are not). Returns 0;
// 1 where the GEMM is not available; 3 (before any write) where a block would read or write outside its operands.
int attnops_bf16_forward_tiles(int64_t n, const int64_t* table, const int64_t* views, float alpha) {
  View x[kForwardViews];
  std::memcpy(x, views, sizeof x);
  if (!forward_table_fits(n, table, x)) return 3;
  const int64_t d = x[kFq].cols, dv = x[kFv].cols;
  const uint16_t* q = nullptr;
  int64_t ldq = d;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t* e = table + t * kForwardColumns;
    const int64_t r0 = e[0], r1 = e[1], c0 = e[2], c1 = e[3], r = r1 - r0, c = c1 - c0;
    if (e[7]) {
      q = x[kFq].at<const uint16_t>(0, r0, 0);
      ldq = x[kFq].s_row;
      if (r > 1 && ldq != d) {
        uint16_t* dense = x[kFqs].at<uint16_t>(0, 0, 0);
        for (int64_t i = 0; i < r; ++i) std::memcpy(dense + i * d, q + i * ldq, sizeof(uint16_t) * d);
        q = dense, ldq = d;
      }
    }
    const int code = forward_tile(
        r, c, d, dv, q, ldq, x[kFk].at<const uint16_t>(0, c0, 0), x[kFk].s_row, x[kFv].at<const uint16_t>(0, c0, 0),
        x[kFv].s_row, alpha, x[kFm].at<float>(0, r0, 0), x[kFl].at<float>(0, r0, 0),
        e[7] ? nullptr : x[kFrescale].at<float>(0, 0, 0), static_cast<int>(e[8]), x[kFs].at<float>(0, 0, 0), c,
        x[kFp16].at<uint16_t>(0, 0, 0), c, x[kFpv].at<float>(0, 0, 0), dv, x[kFo].at<float>(0, e[9], 0),
        x[kFo].s_row, e[4], e[5], e[6]);
    if (code) return code;
  }
  return 0;
}

}  // extern "C"
