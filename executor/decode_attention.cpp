// A decode step's attention on an AMX host: each sequence's one query step against its cached
// keys and values (bf16, rows strided as the cache keeps them), the G query heads of a K/V head
// as the rows of one small product. torch's CPU flash attention took 0.6-0.85 ms a layer at the
// bench's [64, 4 x 4, 64] against ~90 keys, a few times the read of its 5 MB of K/V
// (executor/attention.py says which runs take this). Its arithmetic is the flash kernel's for
// bf16: the scores' products summed in fp32 by AMX (as oneDNN's brgemm in it sums them), scaled,
// the softmax's exponentials summed in fp32 and rounded to bf16 for the values' product, which
// AVX512-BF16 sums in fp32, divided by the total at the end.
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

bool has_amx();  // fused_moe.cpp

namespace {

constexpr int64_t KEYS = 16;  // keys a scores tile covers
constexpr int64_t MAX_D = 128;  // key width: four B tiles of 32
constexpr int64_t MAX_DV = 256;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tile 0: the scores [16 keys, g] (fp32); 1: 16 key rows of 32 (bf16); 2..: q^T in K pairs, one
// tile a 32 of the key width ([16 pairs, g] of bf16 pairs).
__attribute__((target("amx-tile"))) void configure(int64_t g, int64_t d) {
  TileConfig c{};
  c.palette = 1;
  c.rows[0] = 16, c.colsb[0] = uint16_t(g * 4);
  c.rows[1] = 16, c.colsb[1] = 64;
  for (int64_t t = 0; t < d / 32; ++t) c.rows[2 + t] = 16, c.colsb[2 + t] = uint16_t(g * 4);
  asm volatile("" : : "r"(&c) : "memory");  // GCC 12 drops the stores otherwise (fused_moe.cpp)
  _tile_loadconfig(&c);
}

// e^x for x <= 0 (-inf included, as 0): x = n ln2 + r, Cephes' expf polynomial for e^r, scaled
// by 2^n; within 2 ulp of fp32's, before the rounding to bf16 that the values' product takes.
__attribute__((target("avx512f"))) inline __m512 exp_le0(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_scalef_ps(live, p, n);
}

struct Heads {
  int64_t g, s, d, dv;  // query rows, keys, key width, value width
  float scale;
};

// A thread's buffers for one K/V head. The scores stay as the tiles store them, [key][row]:
// 16 / g keys a vector, lane l of row l % g, so the softmax runs on whole vectors.
struct Work {
  std::vector<float> scores;  // [keys, g], then -inf to a whole 32
  std::vector<uint32_t> probs;  // [key pairs, g]: a row's two keys' bf16 (a zero past the last)
  std::vector<uint32_t> q_pairs;  // [d / 32][16 pairs][g]
  std::vector<uint16_t> tail;  // [16, d]: the last keys short of a tile, zeros after
  std::vector<uint16_t> to_pairs;  // [32]: word i of a 32 of probs from word to_pairs[i]
  std::vector<uint16_t> v_pairs;  // [key pairs, dv, 2] (pair_values)
  float total[16];  // each row's sum
  explicit Work(const Heads& h)
      : scores((h.s + 32) * h.g), probs((h.s + 32) * h.g / 2), q_pairs(h.d / 2 * h.g),
        tail(KEYS * h.d), to_pairs(32), v_pairs((h.s + 1) / 2 * 2 * h.dv) {
    for (int64_t e = 0; e < 32; ++e) {  // element e of 32: key e / g, row e % g
      const int64_t key = e / h.g, row = e % h.g;
      to_pairs[((key / 2) * h.g + row) * 2 + key % 2] = uint16_t(e);
    }
  }
};

// scores [s, g] = keys [s, d] @ q[g, d]^T: by AMX tiles of 16 keys.
__attribute__((target("amx-tile,amx-bf16"))) void scores_of(const uint16_t* q, const uint16_t* k,
                                                           int64_t ks, const Heads& h, Work& w) {
  const int64_t tiles = h.d / 32;
  for (int64_t r = 0; r < h.g; ++r)  // q^T in K pairs: pair p of row r at [p][r]
    for (int64_t p = 0; p < h.d / 2; ++p) {
      uint32_t pair;
      std::memcpy(&pair, q + r * h.d + 2 * p, 4);
      w.q_pairs[p * h.g + r] = pair;
    }
  const uint32_t* qt = w.q_pairs.data();
  const int64_t qstride = h.g * 4, next = 16 * h.g;
  switch (tiles) {  // a tile's number is an immediate
    case 4: _tile_loadd(5, qt + 3 * next, qstride); [[fallthrough]];
    case 3: _tile_loadd(4, qt + 2 * next, qstride); [[fallthrough]];
    case 2: _tile_loadd(3, qt + next, qstride); [[fallthrough]];
    default: _tile_loadd(2, qt, qstride);
  }
  for (int64_t j0 = 0; j0 < h.s; j0 += KEYS) {
    const uint16_t* rows = k + j0 * ks;
    int64_t stride = ks * 2;
    if (j0 + KEYS > h.s) {  // the last keys: copied beside zeros, not read past the view
      std::fill(w.tail.begin(), w.tail.end(), uint16_t(0));
      for (int64_t j = j0; j < h.s; ++j)
        std::memcpy(w.tail.data() + (j - j0) * h.d, k + j * ks, h.d * 2);
      rows = w.tail.data(), stride = h.d * 2;
    }
    _tile_zero(0);
    for (int64_t t = 0; t < tiles; ++t) {
      _tile_loadd(1, rows + t * 32, stride);
      switch (t) {
        case 0: _tile_dpbf16ps(0, 1, 2); break;
        case 1: _tile_dpbf16ps(0, 1, 3); break;
        case 2: _tile_dpbf16ps(0, 1, 4); break;
        default: _tile_dpbf16ps(0, 1, 5); break;
      }
    }
    _tile_stored(0, w.scores.data() + j0 * h.g, h.g * 4);
  }
}

// v with each lane the max (or sum) over the lanes of its row (lanes g apart).
template <bool MAX>
__attribute__((target("avx512f"))) __m512 across_keys(__m512 v, int64_t g) {
  for (int64_t step = g; step < 16; step *= 2) {
    const __m512i rot = _mm512_and_si512(
        _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(int(step))),
        _mm512_set1_epi32(15));
    const __m512 other = _mm512_permutexvar_ps(rot, v);
    v = MAX ? _mm512_max_ps(v, other) : _mm512_add_ps(v, other);
  }
  return v;
}

// The scores scaled and masked (a key not allowed -inf), each row's e^(score - max) summed in
// fp32 (total) and rounded to bf16 into probs' key pairs.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void softmax_of(const bool* allowed,
                                                                      int64_t allowed_step,
                                                                      const Heads& h, Work& w) {
  const int64_t n = h.s * h.g, padded = (n + 31) / 32 * 32;
  float* sc = w.scores.data();
  std::fill(sc + n, sc + padded, NEG_INF);
  if (allowed != nullptr)
    for (int64_t j = 0; j < h.s; ++j)
      if (!allowed[j * allowed_step]) std::fill(sc + j * h.g, sc + (j + 1) * h.g, NEG_INF);
  const __m512 scale = _mm512_set1_ps(h.scale);
  __m512 top = _mm512_set1_ps(NEG_INF);
  for (int64_t e = 0; e < padded; e += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sc + e), scale);
    _mm512_storeu_ps(sc + e, x);
    top = _mm512_max_ps(top, x);
  }
  top = across_keys<true>(top, h.g);
  const __m512i order = _mm512_loadu_si512(w.to_pairs.data());
  __m512 sum = _mm512_setzero_ps();
  auto* probs = reinterpret_cast<uint16_t*>(w.probs.data());
  for (int64_t e = 0; e < padded; e += 32) {
    const __m512 a = exp_le0(_mm512_sub_ps(_mm512_loadu_ps(sc + e), top));
    const __m512 b = exp_le0(_mm512_sub_ps(_mm512_loadu_ps(sc + e + 16), top));
    sum = _mm512_add_ps(sum, _mm512_add_ps(a, b));
    const __m512i both = _mm512_inserti64x4(
        _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(a)), (__m256i)_mm512_cvtneps_pbh(b), 1);
    _mm512_storeu_si512(probs + e, _mm512_permutexvar_epi16(order, both));
  }
  _mm512_storeu_ps(w.total, across_keys<false>(sum, h.g));
}

// values [s, dv] in K pairs for vdpbf16ps: [key pairs][dv / 32][2][16 columns][2 keys], each
// two rows read once, in order, and interleaved by vpermt2w (a zero row past the last).
__attribute__((target("avx512f,avx512bw"))) void pair_values(const uint16_t* v, int64_t vs,
                                                             const Heads& h, Work& w) {
  alignas(64) static const uint16_t lo_idx[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                  37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                  11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(lo_idx);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  uint16_t* out = w.v_pairs.data();
  for (int64_t j = 0; j < h.s; j += 2, out += 2 * h.dv)
    for (int64_t c = 0; c < h.dv; c += 32) {
      const __m512i a = _mm512_loadu_si512(v + j * vs + c);
      const __m512i b =
          j + 1 < h.s ? _mm512_loadu_si512(v + (j + 1) * vs + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + 2 * c, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(out + 2 * c + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
}

// out [R, dv] = probs [R, s] @ values [s, dv] / total, rounded to bf16, for rows r0.. of probs:
// 32 columns a pass in 2 R fp32 sums.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void values_of(const Heads& h,
                                                                      const Work& w, int64_t r0,
                                                                      uint16_t* out) {
  const int64_t pairs = (h.s + 1) / 2;
  const uint32_t* pp = w.probs.data() + r0;
  for (int64_t c = 0; c < h.dv; c += 32) {
    __m512 acc[R][2];
    for (auto& a : acc) a[0] = a[1] = _mm512_setzero_ps();
    const uint16_t* vp = w.v_pairs.data() + 2 * c;
    for (int64_t p = 0; p < pairs; ++p, vp += 2 * h.dv) {
      const __m512bh x0 = (__m512bh)_mm512_loadu_si512(vp);
      const __m512bh x1 = (__m512bh)_mm512_loadu_si512(vp + 32);
      for (int i = 0; i < R; ++i) {
        const __m512bh bp = (__m512bh)_mm512_set1_epi32(int(pp[p * h.g + i]));
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], bp, x0);
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], bp, x1);
      }
    }
    for (int i = 0; i < R; ++i) {
      const __m512 inv = _mm512_set1_ps(1.0f / w.total[r0 + i]);
      for (int half = 0; half < 2; ++half)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (r0 + i) * h.dv + c + 16 * half),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[i][half], inv)));
    }
  }
}

void weigh_values(const uint16_t* v, int64_t vs, const Heads& h, Work& w, uint16_t* out) {
  pair_values(v, vs, h, w);
  for (int64_t r0 = 0; r0 < h.g; r0 += 8) switch (std::min<int64_t>(8, h.g)) {
      case 1: values_of<1>(h, w, r0, out); break;
      case 2: values_of<2>(h, w, r0, out); break;
      case 4: values_of<4>(h, w, r0, out); break;
      default: values_of<8>(h, w, r0, out); break;
    }
}

const uint16_t* bits(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

}  // namespace

// What decode_attention serves: query rows a K/V head that divide 16, a key width a multiple of
// 32 up to 128 and a value width of 32 up to 256.
bool decode_attention_serves(int64_t g, int64_t d, int64_t dv) {
  return g >= 1 && g <= 16 && 16 % g == 0 && d % 32 == 0 && d <= MAX_D && dv % 32 == 0 &&
         dv <= MAX_DV;
}

// q [B, nkv, G, D] (contiguous), keys [B, nkv, S, D] and values [B, nkv, S, Dv] (each row
// contiguous, the rest strided: the cache's views), allowed [B, 1, 1, S] bool or None (all),
// all bf16 but the mask -> [B, nkv, G, Dv] bf16. Where the host has AMX (fused_moe.cpp's
// has_amx).
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& keys,
                               const torch::Tensor& values,
                               const c10::optional<torch::Tensor>& mask, double scale) {
  const bool bf16 = q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
                    values.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 && q.is_contiguous() && q.dim() == 4 && keys.dim() == 4 && values.dim() == 4 &&
                  keys.stride(3) == 1 && values.stride(3) == 1 && keys.size(0) == q.size(0) &&
                  keys.size(1) == q.size(1) && keys.size(3) == q.size(3) &&
                  values.size(0) == q.size(0) && values.size(1) == q.size(1) &&
                  values.size(2) == keys.size(2) && keys.size(2) > 0,
              "decode_attention: bf16 q [B, nkv, G, D], keys [B, nkv, S, D], values [B, nkv, S, "
              "Dv], rows contiguous");
  static const bool amx = has_amx();  // asks the kernel for the tile data once
  TORCH_CHECK(amx, "decode_attention: this host has no AMX-BF16");
  const int64_t b = q.size(0), nkv = q.size(1);
  const Heads h{q.size(2), keys.size(2), q.size(3), values.size(3), float(scale)};
  TORCH_CHECK(decode_attention_serves(h.g, h.d, h.dv), "decode_attention: heads it serves");
  const bool* allowed = nullptr;
  int64_t mb = 0, mj = 0;
  if (mask.has_value()) {
    const auto& m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && m.size(0) == b &&
                    m.size(3) == h.s,
                "decode_attention: a bool mask [B, 1, 1, S]");
    allowed = m.data_ptr<bool>(), mb = m.stride(0), mj = m.stride(3);
  }
  auto out = torch::empty({b, nkv, h.g, h.dv}, q.options());
  const uint16_t *qs = bits(q), *ks = bits(keys), *vs = bits(values);
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, b * nkv, 1, [&](int64_t first, int64_t last) {
    Work w(h);
    configure(h.g, h.d);
    for (int64_t t = first; t < last; ++t) {
      const int64_t i = t / nkv, j = t % nkv;
      scores_of(qs + t * h.g * h.d, ks + i * keys.stride(0) + j * keys.stride(1), keys.stride(2),
                h, w);
      softmax_of(allowed ? allowed + i * mb : nullptr, mj, h, w);
      weigh_values(vs + i * values.stride(0) + j * values.stride(1), values.stride(2), h, w,
                   os + t * h.g * h.dv);
    }
    at::native::cpublas::brgemm_release();
  });
  return out;
}

void register_decode_attention(pybind11::module_& m) {
  m.def("decode_attention", &decode_attention);
  m.def("decode_attention_serves", &decode_attention_serves);
}
