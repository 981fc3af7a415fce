// The CPU's routed experts' GEMMs in one call each: every expert's rows times its weight, the
// work cut into (expert, column block) tiles that torch's intra-op threads share, each row
// block of a tile one batch-reduce GEMM of torch's own (at::native::cpublas::brgemm: oneDNN's
// AMX / AVX-512-BF16 micro-kernels) over weights laid out once into its VNNI blocks, each
// column block of w^T in pairs of K side by side (executor/fused_moe.py pack). Why
// (executor/fused_moe.py): a loop of one oneDNN call per expert streams each small expert at
// 12-16 GB/s and pays a call's setup per expert; tiles of all experts at once keep both cores
// streaming. Outputs are rounded to bf16 as a GEMM's are; the SwiGLU between the two GEMMs and
// the routing scale stay torch's, so the rounding is the executor's loop's.
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

using at::BFloat16;
constexpr int64_t BLOCK_N = 64;  // columns a tile computes (a packed block of the weight)
constexpr int64_t BLOCK_M = 64;  // rows a tile computes

bool available() { return at::native::cpublas::could_pack(at::kBFloat16); }

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

// xs [A, K] bf16, its rows sorted by expert, counts[e] of them expert e's; expert e's [N, K]
// weight laid out by pack() (fused_moe.py), whole or in parts by rows (starts). Returns [A, N]
// bf16: each row times its expert's weight^T, rounded to bf16 as a GEMM's output is.
torch::Tensor grouped(torch::Tensor xs, const std::vector<int64_t>& counts,
                      const std::vector<torch::Tensor>& w, int64_t n_out) {
  const int64_t rows = xs.size(0), k = xs.size(1);
  const auto start = starts(xs, counts, w, n_out);
  auto ys = torch::empty({rows, n_out}, xs.options());
  const BFloat16* x = xs.data_ptr<BFloat16>();
  BFloat16* y = ys.data_ptr<BFloat16>();
  const auto work = tiles(start, n_out / BLOCK_N);
  at::parallel_for(0, work.size(), 1, [&](int64_t first, int64_t last) {
    alignas(64) float acc[BLOCK_M * BLOCK_N];
    for (int64_t i = first; i < last; ++i) {
      const auto [e, b] = work[i];
      const BFloat16* wb = block(w, counts.size(), e, b, n_out, k);
      for (int64_t m = start[e]; m < start[e + 1]; m += BLOCK_M) {
        const int64_t n = std::min(BLOCK_M, start[e + 1] - m);
        at::native::cpublas::brgemm(n, BLOCK_N, k, k, BLOCK_N, BLOCK_N, false, x + m * k, wb,
                                    acc);
        for (int64_t r = 0; r < n; ++r) {
          BFloat16* out = y + (m + r) * n_out + b * BLOCK_N;
          for (int64_t c = 0; c < BLOCK_N; ++c) out[c] = BFloat16(acc[r * BLOCK_N + c]);
        }
      }
    }
    at::native::cpublas::brgemm_release();
  });
  return ys;
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
      for (int64_t r = 0; r < m; ++r) {
        BFloat16* out = y + (m0 + r) * n_out + b * BLOCK_N;
        for (int64_t c = 0; c < BLOCK_N; ++c) out[c] = BFloat16(acc[r * BLOCK_N + c]);
      }
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available);
  m.def("grouped", &grouped);
  m.def("grouped_widened", &grouped_widened);
  m.def("has_pairs", &has_pairs);
  m.def("grouped_pairs", &grouped_pairs);
  register_small_ops(m);
}
