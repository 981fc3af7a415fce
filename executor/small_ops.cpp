// The small bf16 ops between a CPU layer's GEMMs, each one pass over its rows where torch runs
// four to eight ops of its own (executor/small_ops.py says why). Each rounds to bf16 where the
// torch ops it replaces do, so that a token's arithmetic is theirs: rotary and the experts'
// combination bit for bit, RMSNorm but for its sum of squares' order.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

inline float f32(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// fp32 -> bf16, to nearest even, a NaN kept quiet: c10::BFloat16's rounding.
inline uint16_t bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline const uint16_t* bits(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

inline uint16_t* bits(torch::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

void check_bf16(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.device().is_cpu(), what,
              ": a contiguous bf16 CPU tensor");
}

}  // namespace

// Mixtral's RMSNorm over x's last dimension: w * bf16(x * rsqrt(mean(x^2) + eps)), in fp32
// with the product rounded before the weight's multiply (executor/layer_math.py rms_norm); with
// fp32_scale, gpt-oss's: bf16(w * (x * rsqrt(...))), rounded once (rms_norm_fp32).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps,
                       bool fp32_scale) {
  check_bf16(x, "rms_norm x");
  check_bf16(w, "rms_norm w");
  const int64_t h = x.size(-1), rows = x.numel() / h;
  TORCH_CHECK(w.numel() == h, "rms_norm: w as wide as x's last dimension");
  auto out = torch::empty_like(x);
  const uint16_t *xs = bits(x), *ws = bits(w);
  uint16_t* ys = bits(out);
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const uint16_t* a = xs + r * h;
      uint16_t* y = ys + r * h;
      float sum = 0.f;
      for (int64_t i = 0; i < h; ++i) sum += f32(a[i]) * f32(a[i]);
      const float scale = 1.f / std::sqrt(sum / float(h) + float(eps));
      if (fp32_scale) {
        for (int64_t i = 0; i < h; ++i) y[i] = bf16(f32(ws[i]) * (f32(a[i]) * scale));
      } else {
        for (int64_t i = 0; i < h; ++i) y[i] = bf16(f32(ws[i]) * f32(bf16(f32(a[i]) * scale)));
      }
    }
  });
  return out;
}

// Rotary by the half-split convention, x [T, n, D] with cos and sin [T, D]: each product
// rounded, then their sum (x * cos + rotate_half(x) * sin in bf16, apply_rotary's ops).
torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  check_bf16(x, "rotary x");
  check_bf16(cos, "rotary cos");
  check_bf16(sin, "rotary sin");
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                  cos.size(0) == x.size(0) && cos.size(1) == x.size(2) && x.size(2) % 2 == 0,
              "rotary: x [T, n, D], cos and sin [T, D]");
  const int64_t t = x.size(0), n = x.size(1), d = x.size(2), half = d / 2;
  auto out = torch::empty_like(x);
  const uint16_t *xs = bits(x), *cs = bits(cos), *ss = bits(sin);
  uint16_t* ys = bits(out);
  at::parallel_for(0, t * n, 64, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const uint16_t *a = xs + r * d, *c = cs + (r / n) * d, *s = ss + (r / n) * d;
      uint16_t* y = ys + r * d;
      for (int64_t i = 0; i < d; ++i) {
        const float rotated = i < half ? -f32(a[i + half]) : f32(a[i - half]);
        y[i] = bf16(f32(bf16(f32(a[i]) * f32(c[i]))) + f32(bf16(rotated * f32(s[i]))));
      }
    }
  });
  return out;
}

// A step's routed assignments laid out for the grouped GEMMs (MoEModel.experts' argsort,
// bincount, index_selects and _by_token in one pass): top_i [T, K] sorted by expert, stably (a
// counting sort); xs [A, H] each sorted assignment's token row of x; scale [A] its routing
// weight in fp32; source [T * K] the sorted row at each token's k-th place, its experts in index
// order (combine's); counts [E].
std::vector<torch::Tensor> dispatch(const torch::Tensor& x, const torch::Tensor& top_w,
                                    const torch::Tensor& top_i, int64_t experts) {
  check_bf16(x, "dispatch x");
  TORCH_CHECK(top_i.scalar_type() == at::kLong && top_i.is_contiguous() && top_i.dim() == 2 &&
                  top_i.size(0) == x.size(0) && experts > 0,
              "dispatch: top_i [T, K] int64");
  TORCH_CHECK((top_w.scalar_type() == at::kFloat || top_w.scalar_type() == at::kBFloat16) &&
                  top_w.is_contiguous() && top_w.sizes() == top_i.sizes(),
              "dispatch: top_w [T, K] fp32 or bf16");
  const int64_t k = top_i.size(1), a_n = top_i.numel(), h = x.size(1);
  const int64_t* ids = top_i.data_ptr<int64_t>();
  std::vector<int64_t> next(experts + 1, 0), pos(a_n);
  for (int64_t a = 0; a < a_n; ++a) {
    TORCH_CHECK(ids[a] >= 0 && ids[a] < experts, "dispatch: an expert id out of range");
    ++next[ids[a] + 1];
  }
  auto counts = torch::empty({experts}, top_i.options());
  int64_t* c = counts.data_ptr<int64_t>();
  for (int64_t e = 0; e < experts; ++e) c[e] = next[e + 1], next[e + 1] += next[e];
  for (int64_t a = 0; a < a_n; ++a) pos[a] = next[ids[a]]++;
  auto xs = torch::empty({a_n, h}, x.options());
  auto scale = torch::empty({a_n}, top_w.options().dtype(at::kFloat));
  auto source = torch::empty({a_n}, top_i.options());
  float* sc = scale.data_ptr<float>();
  int64_t* src = source.data_ptr<int64_t>();
  const bool half = top_w.scalar_type() == at::kBFloat16;
  const uint16_t* w16 = half ? bits(top_w) : nullptr;
  const float* w32 = half ? nullptr : top_w.data_ptr<float>();
  for (int64_t a = 0; a < a_n; ++a) {
    sc[pos[a]] = half ? f32(w16[a]) : w32[a];
    int64_t rank = 0;  // its place among its token's experts, by index (then by k)
    for (int64_t j = a - a % k; j < a - a % k + k; ++j)
      rank += ids[j] < ids[a] || (ids[j] == ids[a] && j < a);
    src[a - a % k + rank] = pos[a];
  }
  const uint16_t* xr = bits(x);
  uint16_t* out = bits(xs);
  at::parallel_for(0, a_n, 16, [&](int64_t first, int64_t last) {
    for (int64_t a = first; a < last; ++a)
      std::memcpy(out + pos[a] * h, xr + (a / k) * h, h * sizeof(uint16_t));
  });
  return {xs, scale, source, counts};
}

// The routed experts' outputs back to their tokens: ys [A, H] rows sorted by expert, each
// scaled by its fp32 routing weight and rounded; a token's K rows (source[t * K + k], in expert
// index order) added in turn, each sum rounded (MoEModel.experts' mul_, gather and adds).
torch::Tensor combine(const torch::Tensor& ys, const torch::Tensor& scale,
                      const torch::Tensor& source, int64_t k) {
  check_bf16(ys, "combine ys");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.numel() == ys.size(0),
              "combine: an fp32 scale per row");
  TORCH_CHECK(source.scalar_type() == at::kLong && source.is_contiguous() &&
                  source.numel() == ys.size(0) && k > 0 && ys.size(0) % k == 0,
              "combine: a source row per assignment, K per token");
  const int64_t h = ys.size(1), tokens = ys.size(0) / k;
  auto out = torch::empty({tokens, h}, ys.options());
  const uint16_t* y = bits(ys);
  const float* s = scale.data_ptr<float>();
  const int64_t* src = source.data_ptr<int64_t>();
  uint16_t* o = bits(out);
  at::parallel_for(0, tokens, 8, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      uint16_t* acc = o + t * h;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t row = src[t * k + j];
        const uint16_t* a = y + row * h;
        const float w = s[row];
        if (j == 0)
          for (int64_t i = 0; i < h; ++i) acc[i] = bf16(f32(a[i]) * w);
        else
          for (int64_t i = 0; i < h; ++i) acc[i] = bf16(f32(acc[i]) + f32(bf16(f32(a[i]) * w)));
      }
    }
  });
  return out;
}

// Greedy: each row's first largest value's index, [B, V] bf16 or fp32 -> [B] int64, as torch's
// max(dim=-1).indices chooses (a NaN counts as largest; -0 and +0 are equal). The values are
// compared as order-preserving integers (a negative's magnitude bits flipped), which the
// compiler vectorizes: a batch-64 step's [64, 32000] in one read of the bf16 logits, where
// widening them to fp32 and torch's max took 2.2 ms in a run (executor/small_ops.py).
namespace {

template <typename U, typename S>
inline S key_of(U bits) {
  const S s = static_cast<S>(bits);
  constexpr int shift = sizeof(S) * 8 - 1;
  return s ^ ((s >> shift) & std::numeric_limits<S>::max());
}

constexpr int64_t GREEDY_SPAN = 256;  // values a vectorized max covers before the compare

template <typename U, typename S>
int64_t first_largest(const U* row, int64_t v) {
  constexpr U magnitude = std::numeric_limits<U>::max() >> 1;
  constexpr U inf = sizeof(U) == 2 ? 0x7f80 : 0x7f800000;
  S best = std::numeric_limits<S>::min(), largest_magnitude = 0;
  int64_t span = 0;  // the first span holding the largest key
  for (int64_t s0 = 0; s0 < v; s0 += GREEDY_SPAN) {
    const int64_t end = std::min(v, s0 + GREEDY_SPAN);
    S top = std::numeric_limits<S>::min();
    for (int64_t i = s0; i < end; ++i) {  // plain maxima, so that the compiler vectorizes it
      const S k = key_of<U, S>(row[i]);
      const S m = static_cast<S>(row[i] & magnitude);
      top = k > top ? k : top;
      largest_magnitude = m > largest_magnitude ? m : largest_magnitude;
    }
    if (top > best) best = top, span = s0;
  }
  const bool nan = static_cast<U>(largest_magnitude) > inf;
  // a NaN, or a zero (+0's key is 0, -0's -1: one value), is looked for from the start
  const bool zero = best == 0 || best == S(-1);
  for (int64_t i = nan || zero ? 0 : span; i < v; ++i) {
    const S k = key_of<U, S>(row[i]);
    if (nan ? (row[i] & magnitude) > inf : zero ? (k == 0 || k == S(-1)) : k == best) return i;
  }
  return 0;
}

}  // namespace

torch::Tensor greedy(const torch::Tensor& logits) {
  const bool half = logits.scalar_type() == at::kBFloat16;
  TORCH_CHECK((half || logits.scalar_type() == at::kFloat) && logits.dim() == 2 &&
                  logits.is_contiguous() && logits.device().is_cpu() && logits.size(1) > 0,
              "greedy: contiguous bf16 or fp32 CPU logits [B, V]");
  const int64_t rows = logits.size(0), v = logits.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const auto* base = static_cast<const char*>(logits.data_ptr());
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r)
      o[r] = half ? first_largest<uint16_t, int16_t>(
                        reinterpret_cast<const uint16_t*>(base) + r * v, v)
                  : first_largest<uint32_t, int32_t>(
                        reinterpret_cast<const uint32_t*>(base) + r * v, v);
  });
  return out;
}

void register_small_ops(pybind11::module_& m) {
  m.def("rms_norm", &rms_norm);
  m.def("rotary", &rotary);
  m.def("combine", &combine);
  m.def("dispatch", &dispatch);
  m.def("greedy", &greedy);
}
