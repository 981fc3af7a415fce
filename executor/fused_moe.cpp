// The CPU's routed experts' GEMMs in one call each: every expert's rows times its weight, the
// work cut into (expert, column block) tiles that torch's intra-op threads share. Three forms,
// by what the host has (executor/fused_moe.py says why and which): AMX tiles of our own, K
// pairs by AVX512-BF16, or blocks widened to fp32 for torch's fp32 brgemm. Outputs are rounded
// to bf16 as a GEMM's are; the SwiGLU between the two GEMMs and the routing scale stay torch's,
// so the rounding is the executor's loop's.
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cpuid.h>
#include <cstdint>
#include <cstring>
#include <vector>

using at::BFloat16;
constexpr int64_t BLOCK_N = 64;  // columns a tile computes (a packed block of the weight)
constexpr int64_t BLOCK_M = 64;  // rows a widened tile's brgemm computes

// A tile: an expert hit and one column block of its weight, over all the expert's rows (the
// block, 64 x K, stays in cache while its row blocks pass; a prefill's many rows would
// otherwise stream the whole weight once per row block).
using Tile = std::array<int64_t, 2>;

static std::vector<Tile> tiles(const std::vector<int64_t>& start, int64_t blocks) {
  std::vector<Tile> out;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(start.size()); ++e)
    if (start[e + 1] > start[e])
      for (int64_t b = 0; b < blocks; ++b) out.push_back({e, b});
  return out;
}

// The first row of each expert's in xs (and one past the last), the arguments checked. An
// expert's weight comes in `parts` tensors (w.size() / counts.size()), each a run of its column
// blocks (a gate's, then an up's, each packed where it was loaded: no stacked copy).
static std::vector<int64_t> starts(const torch::Tensor& xs, const std::vector<int64_t>& counts,
                                   const std::vector<torch::Tensor>& w, int64_t n_out) {
  TORCH_CHECK(xs.scalar_type() == at::kBFloat16 && xs.is_contiguous() && xs.dim() == 2,
              "grouped: xs a contiguous bf16 matrix");
  const size_t parts = counts.empty() ? 1 : w.size() / counts.size();
  TORCH_CHECK(parts && counts.size() * parts == w.size() && n_out % (BLOCK_N * parts) == 0,
              "grouped: counts and weights");
  std::vector<int64_t> start(counts.size() + 1, 0);
  for (size_t e = 0; e < counts.size(); ++e) start[e + 1] = start[e] + counts[e];
  TORCH_CHECK(start.back() == xs.size(0), "grouped: counts do not add up to the rows");
  for (size_t i = 0; i < w.size(); ++i)
    TORCH_CHECK(!counts[i / parts] || w[i].numel() * int64_t(parts) == n_out * xs.size(1),
                "grouped: a weight's shape");
  return start;
}

// Column block b of expert e's weight (packed blocks of BLOCK_N columns x k) in its part.
static const BFloat16* block(const std::vector<torch::Tensor>& w, size_t experts, int64_t e,
                             int64_t b, int64_t n_out, int64_t k) {
  const int64_t parts = w.size() / experts, per = n_out / BLOCK_N / parts;
  return w[e * parts + b / per].data_ptr<BFloat16>() + (b % per) * k * BLOCK_N;
}

// A tile's m rows of fp32 sums (BLOCK_N apart) into its block of y (rows ldy apart), rounded
// to bf16 as a GEMM's outputs are.
static void round_rows(const float* acc, int64_t m, BFloat16* y, int64_t ldy) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < BLOCK_N; ++c) y[r * ldy + c] = BFloat16(acc[r * BLOCK_N + c]);
}

// ---- The AMX form. Each column block laid out by fused_moe.pack as two halves of 32 columns,
// each [K / 32][2 column tiles][16 K pairs][16 columns][2]: one tile load is 1 KB contiguous,
// and a half streams in order. Up to 32 rows a pass (two row tiles, C in 2 x 2 tiles), so at a
// decode's few rows an expert the weight is read once; more rows take further passes over the
// block from L2. Bit for bit the sums of oneDNN's AMX brgemm over the same rows, at
// 1.1-1.25x its stream (measured at 1-70 rows an expert: docs/decisions.md, 2026-12-07).
constexpr int64_t AMX_ROWS = 32;

// Whether this CPU has AMX-BF16 and the kernel lets this process use its tile data (Linux
// 5.16+: arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, a no-op where already granted).
bool has_amx() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24)))
    return false;
  constexpr long REQ_XCOMP_PERM = 0x1023, XTILEDATA = 18;
  return syscall(SYS_arch_prctl, REQ_XCOMP_PERM, XTILEDATA) == 0;
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3 C (rows lo, lo, hi, hi), 4-5 A (lo, hi), 6-7 B (16 K pairs), for m = lo + hi rows.
__attribute__((target("amx-tile"))) static void configure(int64_t m) {
  TileConfig c{};
  c.palette = 1;
  const uint8_t lo = std::min<int64_t>(m, 16), hi = m - lo;
  const uint8_t rows[8] = {lo, lo, hi, hi, lo, hi, 16, 16};
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = rows[t];
    c.colsb[t] = rows[t] ? 64 : 0;
  }
  // GCC 12 does not count ldtilecfg as reading c, and drops the stores above without this
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// acc [m, BLOCK_N] (fp32) = x [m, k] (rows k apart) @ the block wb, for m <= AMX_ROWS.
template <bool TWO>
__attribute__((target("amx-tile,amx-bf16"))) static void amx_pass(const BFloat16* x,
                                                                   int64_t k,
                                                                   const BFloat16* wb,
                                                                   float* acc) {
  for (int64_t half = 0; half < 2; ++half) {
    const BFloat16* wh = wb + half * k * 32;
    _tile_zero(0);
    _tile_zero(1);
    if (TWO) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t k0 = 0; k0 < k; k0 += 32) {
      _tile_loadd(4, x + k0, k * 2);
      _tile_loadd(6, wh + k0 * 32, 64);
      _tile_loadd(7, wh + k0 * 32 + 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (TWO) {
        _tile_loadd(5, x + 16 * k + k0, k * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    float* a = acc + half * 32;
    _tile_stored(0, a, BLOCK_N * 4);
    _tile_stored(1, a + 16, BLOCK_N * 4);
    if (TWO) {
      _tile_stored(2, a + 16 * BLOCK_N, BLOCK_N * 4);
      _tile_stored(3, a + 16 * BLOCK_N + 16, BLOCK_N * 4);
    }
  }
}

// 16 lanes of e^x: x = n ln2 + r, Cephes' expf polynomial for e^r, scaled by 2^n (vscalefps:
// inf past fp32's largest, 0 past its smallest); within 2 ulp of fp32's, where torch's SiLU takes
// Sleef's within 1.
__attribute__((target("avx512f"))) static __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.8f)), _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                        5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// 16 lanes rounded to bf16 as BFloat16(float) rounds (to nearest even, a NaN quiet), kept as
// fp32 (the low half zero).
__attribute__((target("avx512f"))) static __m512 round16(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  const __m512i kept = _mm512_and_si512(up, _mm512_set1_epi32(int32_t(0xffff0000u)));
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(kept, nan, _mm512_set1_epi32(0x7fc00000)));
}

// A tile's m rows of gate and up sums (fp32, BLOCK_N apart) into its block of y as the loop's
// torch ops compute them: each GEMM output rounded to bf16, F.silu (x / (1 + e^-x) in fp32,
// rounded), then its product with the up, rounded.
__attribute__((target("avx512f"))) static void swiglu_rows(const float* gate, const float* up,
                                                          int64_t m, BFloat16* y, int64_t ldy) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < BLOCK_N; c += 16) {
      const __m512 g = round16(_mm512_loadu_ps(gate + r * BLOCK_N + c));
      const __m512 u = round16(_mm512_loadu_ps(up + r * BLOCK_N + c));
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 s = round16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
      const __m512i out = _mm512_castps_si512(round16(_mm512_mul_ps(s, u)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + c),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(out, 16)));
    }
}

// grouped() over the AMX layout. A thread's tile configuration follows its passes' rows; at
// the end it is released through torch's brgemm_release, which also tells torch's own AMX
// brgemm (flash attention's) that its configuration is gone. With swiglu, the weights' first
// half of columns a gate's and the second an up's: a tile computes the gate's block and the
// up's and writes their SwiGLU, [rows, n_out / 2], where the loop ran the GEMM, F.silu_, mul_
// and the copy of the gate's strided half for the next GEMM.
static torch::Tensor amx_grouped(torch::Tensor xs, const std::vector<int64_t>& counts,
                                 const std::vector<torch::Tensor>& w, int64_t n_out, bool swiglu) {
  const int64_t rows = xs.size(0), k = xs.size(1), width = swiglu ? n_out / 2 : n_out;
  const auto start = starts(xs, counts, w, n_out);
  TORCH_CHECK(k % 32 == 0, "grouped: K a multiple of 32 in the AMX form");
  TORCH_CHECK(width % BLOCK_N == 0, "grouped_swiglu: a gate of whole blocks");
  auto ys = torch::empty({rows, width}, xs.options());
  const BFloat16* x = xs.data_ptr<BFloat16>();
  BFloat16* y = ys.data_ptr<BFloat16>();
  const auto work = tiles(start, width / BLOCK_N);
  at::parallel_for(0, work.size(), 1, [&](int64_t first, int64_t last) {
    alignas(64) float acc[AMX_ROWS * BLOCK_N], up[AMX_ROWS * BLOCK_N];
    int64_t configured = 0;
    for (int64_t i = first; i < last; ++i) {
      const auto [e, b] = work[i];
      const BFloat16* wb = block(w, counts.size(), e, b, n_out, k);
      const BFloat16* wu = swiglu ? block(w, counts.size(), e, b + width / BLOCK_N, n_out, k)
                                  : nullptr;
      for (int64_t m = start[e]; m < start[e + 1]; m += AMX_ROWS) {
        const int64_t n = std::min(AMX_ROWS, start[e + 1] - m);
        if (n != configured) {
          configure(n);
          configured = n;
        }
        const auto pass = n > 16 ? amx_pass<true> : amx_pass<false>;
        pass(x + m * k, k, wb, acc);
        BFloat16* out = y + m * width + b * BLOCK_N;
        if (swiglu) {
          pass(x + m * k, k, wu, up);
          swiglu_rows(acc, up, n, out, width);
        } else {
          round_rows(acc, n, out, width);
        }
      }
    }
    at::native::cpublas::brgemm_release();
  });
  return ys;
}

torch::Tensor grouped(torch::Tensor xs, const std::vector<int64_t>& counts,
                      const std::vector<torch::Tensor>& w, int64_t n_out) {
  return amx_grouped(xs, counts, w, n_out, false);
}

torch::Tensor grouped_swiglu(torch::Tensor xs, const std::vector<int64_t>& counts,
                             const std::vector<torch::Tensor>& w, int64_t n_out) {
  return amx_grouped(xs, counts, w, n_out, true);
}

constexpr int64_t K_CHUNK = 256;  // weight rows widened at once: 64 KB of fp32, in L2
constexpr int64_t DIRECT_M = 4;  // an expert with this many rows or fewer skips the widening

// acc[M, BLOCK_N] = x[M, k] @ wb [k, BLOCK_N] (bf16) for the few rows of a
// decode, the weight read once and widened in registers: at one row a tile is a matrix-vector
// product, which the widen-then-GEMM path ran at 11-16 GB/s on the AVX2 EPYC, this at 18-26
// (1.5-1.9x at 1-4 rows; at 8 rows 1.0-1.2x, where the sums no longer fit the registers). The
// whole block a pass (V = 8 vectors of 8 columns), so the weight is read in order: in two
// halves, to keep the sums of 2-3 rows in AVX2's 16 registers, it was slower than spilling.
template <int M, int V>
__attribute__((target("avx2,fma"))) static void direct_avx2(const float* x, int64_t k,
                                                           const uint16_t* wb, float* acc) {
  for (int64_t h = 0; h < BLOCK_N; h += 8 * V) {
    __m256 sum[M][V];
    for (int r = 0; r < M; ++r)
      for (int j = 0; j < V; ++j) sum[r][j] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < k; ++kk) {
      const uint16_t* row = wb + kk * BLOCK_N + h;
      for (int j = 0; j < V; ++j) {
        const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 8 * j));
        const __m256 w = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
        for (int r = 0; r < M; ++r)
          sum[r][j] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * k + kk]), w, sum[r][j]);
      }
    }
    for (int r = 0; r < M; ++r)
      for (int j = 0; j < V; ++j) _mm256_storeu_ps(acc + r * BLOCK_N + h + 8 * j, sum[r][j]);
  }
}

// The same sums without AVX2 (the compiler's own vectors).
static void direct_plain(const float* x, int64_t m, int64_t k, const uint16_t* wb, float* acc) {
  std::fill(acc, acc + m * BLOCK_N, 0.0f);
  for (int64_t kk = 0; kk < k; ++kk)
    for (int64_t r = 0; r < m; ++r) {
      const float xr = x[r * k + kk];
      for (int64_t c = 0; c < BLOCK_N; ++c) {
        uint32_t bits = uint32_t(wb[kk * BLOCK_N + c]) << 16;
        float w;
        std::memcpy(&w, &bits, sizeof w);
        acc[r * BLOCK_N + c] += xr * w;
      }
    }
}

static void direct(const float* x, int64_t m, int64_t k, const uint16_t* wb, float* acc) {
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (!avx2) return direct_plain(x, m, k, wb, acc);
  if (m == 1) return direct_avx2<1, 8>(x, k, wb, acc);
  if (m == 2) return direct_avx2<2, 8>(x, k, wb, acc);
  if (m == 3) return direct_avx2<3, 8>(x, k, wb, acc);
  return direct_avx2<4, 8>(x, k, wb, acc);
}

// grouped() over weights in plain column blocks ([N / BLOCK_N, K, BLOCK_N], still bf16): each
// tile widens its block K_CHUNK rows at a time into fp32 and multiplies the expert's rows (fp32,
// widened once a call) by it with torch's fp32 brgemm (oneDNN's ukernel, or its sgemm), the sums
// in fp32 across chunks, rounded to bf16 at the end as a GEMM's output is; an expert of DIRECT_M
// rows or fewer goes through direct().
torch::Tensor grouped_widened(torch::Tensor xs, const std::vector<int64_t>& counts,
                              const std::vector<torch::Tensor>& w, int64_t n_out) {
  const int64_t rows = xs.size(0), k = xs.size(1);
  const auto start = starts(xs, counts, w, n_out);
  auto x32 = xs.to(at::kFloat).contiguous();
  auto ys = torch::empty({rows, n_out}, xs.options());
  const float* x = x32.data_ptr<float>();
  BFloat16* y = ys.data_ptr<BFloat16>();
  const auto work = tiles(start, n_out / BLOCK_N);
  at::parallel_for(0, work.size(), 1, [&](int64_t first, int64_t last) {
    std::vector<float> wide(K_CHUNK * BLOCK_N), acc;
    for (int64_t i = first; i < last; ++i) {
      const auto [e, b] = work[i];
      const int64_t m0 = start[e], m = start[e + 1] - m0;
      acc.resize(m * BLOCK_N);  // direct() writes every sum; brgemm's chunks add to zeros
      const auto* wb = reinterpret_cast<const uint16_t*>(block(w, counts.size(), e, b, n_out, k));
      if (m <= DIRECT_M) {
        direct(x + m0 * k, m, k, wb, acc.data());
      } else {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t k0 = 0; k0 < k; k0 += K_CHUNK) {
          const int64_t kc = std::min(K_CHUNK, k - k0);
          const uint16_t* src = wb + k0 * BLOCK_N;
          uint32_t* dst = reinterpret_cast<uint32_t*>(wide.data());
          for (int64_t j = 0; j < kc * BLOCK_N; ++j) dst[j] = uint32_t(src[j]) << 16;
          for (int64_t r = 0; r < m; r += BLOCK_M)
            at::native::cpublas::brgemm(std::min(BLOCK_M, m - r), BLOCK_N, kc, k, BLOCK_N,
                                        BLOCK_N, true, x + (m0 + r) * k + k0, wide.data(),
                                        acc.data() + r * BLOCK_N, false);
        }
      }
      round_rows(acc.data(), m, y + m0 * n_out + b * BLOCK_N, n_out);
    }
  });
  return ys;
}

// The pairs form: where the host has AVX512-BF16 but no AMX (Zen 4, Cooper Lake).
bool has_pairs() { return __builtin_cpu_supports("avx512bf16"); }

constexpr int PAIRS_M = 6;  // rows a pass of a block: 6 x 4 sums + 4 weights in 32 registers

// y[M, BLOCK_N] = x[M, 2 kp] @ wb (a block in pairs of K) in bf16 products summed in fp32 by
// vdpbf16ps, two K a lane: no widening pass, half the fp32 path's instructions. Each product
// is exact in fp32 and each sum rounded to nearest, as an FMA chain's (denormals flushed, as
// oneDNN's bf16 GEMMs on these hosts do). The outputs rounded to bf16 to nearest even.
template <int M>
__attribute__((target("avx512f,avx512bf16"))) static void pairs_rows(
    const uint32_t* x, int64_t kp, const uint32_t* wb, BFloat16* y, int64_t ldy) {
  __m512 sum[M][4];
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < 4; ++j) sum[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kp; ++p) {
    const uint32_t* row = wb + p * BLOCK_N;
    __m512bh w[4];
    for (int j = 0; j < 4; ++j) w[j] = (__m512bh)_mm512_loadu_si512(row + 16 * j);
    for (int r = 0; r < M; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * kp + p]));
      for (int j = 0; j < 4; ++j) sum[r][j] = _mm512_dpbf16_ps(sum[r][j], xr, w[j]);
    }
  }
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + 16 * j),
                          (__m256i)_mm512_cvtneps_pbh(sum[r][j]));
}

static void pairs_block(int64_t m, const uint32_t* x, int64_t kp, const uint32_t* wb,
                        BFloat16* y, int64_t ldy) {
  switch (m) {
    case 1: return pairs_rows<1>(x, kp, wb, y, ldy);
    case 2: return pairs_rows<2>(x, kp, wb, y, ldy);
    case 3: return pairs_rows<3>(x, kp, wb, y, ldy);
    case 4: return pairs_rows<4>(x, kp, wb, y, ldy);
    case 5: return pairs_rows<5>(x, kp, wb, y, ldy);
    default: return pairs_rows<PAIRS_M>(x, kp, wb, y, ldy);
  }
}

// The pairs form's tiles: (expert, column block, first row, end row). Where the experts' column
// blocks are too few to keep the threads busy (a dense weight's few blocks, over a prefill's
// rows), an expert's rows are cut into spans of at least SPAN_MIN, so that there are about
// 4 tiles a thread; each span reads its block again, which costs little at that many rows.
constexpr int64_t SPAN_MIN = 48;
using Span = std::array<int64_t, 4>;

static std::vector<Span> spans(const std::vector<int64_t>& start, int64_t blocks) {
  int64_t hit = 0;
  for (size_t e = 0; e + 1 < start.size(); ++e) hit += start[e + 1] > start[e];
  const int64_t have = std::max<int64_t>(1, hit * blocks), want = 4 * at::get_num_threads();
  const int64_t cuts = (want + have - 1) / have;
  std::vector<Span> out;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(start.size()); ++e) {
    const int64_t m = start[e + 1] - start[e];
    if (!m) continue;
    const int64_t even = (m + cuts - 1) / cuts;
    const int64_t span = std::max(SPAN_MIN, (even + PAIRS_M - 1) / PAIRS_M * PAIRS_M);
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t r = start[e]; r < start[e + 1]; r += span)
        out.push_back({e, b, r, std::min(r + span, start[e + 1])});
  }
  return out;
}

// grouped() over weights in pairs of K (as brgemm's), each tile's rows PAIRS_M at a time over
// its block (which stays in L2 while they pass): the bf16 rows multiplied as they are.
torch::Tensor grouped_pairs(torch::Tensor xs, const std::vector<int64_t>& counts,
                            const std::vector<torch::Tensor>& w, int64_t n_out) {
  TORCH_CHECK(has_pairs(), "grouped_pairs: this host has no AVX512-BF16");
  const int64_t rows = xs.size(0), k = xs.size(1);
  const auto start = starts(xs, counts, w, n_out);
  TORCH_CHECK(k % 2 == 0, "grouped_pairs: an even K");
  auto ys = torch::empty({rows, n_out}, xs.options());
  const auto* x = reinterpret_cast<const uint32_t*>(xs.data_ptr<BFloat16>());
  BFloat16* y = ys.data_ptr<BFloat16>();
  const auto work = spans(start, n_out / BLOCK_N);
  at::parallel_for(0, work.size(), 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const auto [e, b, r0, r1] = work[i];
      const auto* wb = reinterpret_cast<const uint32_t*>(block(w, counts.size(), e, b, n_out, k));
      for (int64_t m = r0; m < r1; m += PAIRS_M)
        pairs_block(std::min<int64_t>(PAIRS_M, r1 - m), x + m * (k / 2), k / 2, wb,
                    y + m * n_out + b * BLOCK_N, n_out);
    }
  });
  return ys;
}

void register_small_ops(pybind11::module_& m);  // executor/small_ops.cpp, built beside
void register_decode_attention(pybind11::module_& m);  // executor/decode_attention.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_amx", &has_amx);
  m.def("grouped", &grouped);
  m.def("grouped_swiglu", &grouped_swiglu);
  m.def("grouped_widened", &grouped_widened);
  m.def("has_pairs", &has_pairs);
  m.def("grouped_pairs", &grouped_pairs);
  register_small_ops(m);
  register_decode_attention(m);
}
