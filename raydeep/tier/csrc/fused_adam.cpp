// The offloaded CPU update in one pass over memory: read the model-dtype gradient, multiply it by
// the one scale, run Adam/AdamW, write the fp32 master, exp_avg, exp_avg_sq and the model-dtype
// parameter. The update is memory-bound: four passes (widen, scale, torch's fused Adam, narrow)
// cost about twice torch's fused Adam alone; this one pass costs about the same as it.
//
// Bitwise: the result equals grad.to(fp32) * float(scale) -> torch's fused Adam/AdamW (fp32) ->
// out.copy_(master). torch's kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp) is compiled
// per CPU capability with -ffp-contract=fast, so where GCC fused a multiply-add differs between
// its vector loop, its scalar tail and capabilities. This file is built with -ffp-contract=off and
// spells out each fused multiply-add that torch's binary (2.13) computes, measured per capability:
//   AVX2 / AVX512 vector loop: wd: fma(p, wd, g); exp_avg: fma(c1, g - m, m);
//                              exp_avg_sq: fma(c2 * g, g, v * b2)
//   AVX2 / AVX512 scalar tail: the same except exp_avg_sq: fma(v, b2, (c2 * g) * g)
//   AVX512 scalar tail:        GCC vectorised it 8 wide: a tail of 8..15 runs its first 8 with the
//                              vector loop's exp_avg_sq
//   DEFAULT:                   no fma anywhere
// raydeep/tier/cpu_update.py checks this against torch on the running machine before using it.
//
// Optionally, in the same pass, the delayed update's lookahead terms (raydeep/tier/lookahead.py)
// from the updated master x and moments m, v, each operation rounded once in fp32 (no fma), as
// that file's torch fallback computes them:
//   r = 1 / (sqrt(v) / bc2 + eps);  rate = r * c_rate
//   AdamW: base = x * a - (r * m) * b;   Adam: base = x - (r * (m * b1 + x * a)) * b
#include <ATen/Config.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>

#if AT_PARALLEL_OPENMP
#include <omp.h>
#endif

#ifndef RAYDEEP_OPS_NS
#define RAYDEEP_OPS_NS raydeep_cpu
#endif
#define RAYDEEP_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define RAYDEEP_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kW = fVec::size();

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kFma = true;
#else
constexpr bool kFma = false;
#endif
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kTailBlock = 8;  // torch's AVX512 build runs 8 elements of its tail vectorised
#else
constexpr int64_t kTailBlock = 0;
#endif

struct NoOut {};  // out=None

// The lookahead's constants (raydeep/tier/lookahead.py computes them); `on`: write base and rate.
struct Terms {
  bool on, decoupled, same_denom;
  float bc2, eps, rate, a, b, b1;
};

struct Hyper {
  bool use_scale, maximize, has_wd, decoupled, lerp_small;
  float scale, wd, decay, coeff, c2, b2, bc2_sqrt, eps, neg_step_size, step_size;
};

// --- loads and stores of kW elements as fp32 ---------------------------------------------------
inline fVec load_f(const float* p) { return fVec::loadu(p); }
inline fVec load_f(const c10::BFloat16* p) {
  fVec out;
  at::vec::load_fp32_from_bf16(p, out);
  return out;
}
inline fVec load_f(const c10::Half* p) {
  fVec out;
  at::vec::load_fp32_from_fp16(p, out);
  return out;
}

inline void store_f(float* p, const fVec& v) { v.store(p); }
// What out.copy_(master) writes: torch's vector conversion (NaN -> 0xffff) where it has one,
// c10's scalar one (NaN -> 0x7fc0) in the DEFAULT build.
inline void store_f(c10::BFloat16* p, const fVec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), at::vec::cvtfp32_bf16(__m512(v)));
#elif defined(CPU_CAPABILITY_AVX2)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), at::vec::cvtfp32_bf16(__m256(v)));
#else
  for (int64_t i = 0; i < kW; i++) p[i] = c10::BFloat16(v[i]);
#endif
}
inline void store_f(c10::Half* p, const fVec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), at::vec::cvtfp32_fp16(__m512(v)));
#elif defined(CPU_CAPABILITY_AVX2)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), at::vec::cvtfp32_fp16(__m256(v)));
#else
  for (int64_t i = 0; i < kW; i++) p[i] = c10::Half(v[i]);
#endif
}

// Fewer than kW elements, through a padded vector: the same conversions as the vector loop.
template <typename T>
inline fVec load_partial(const T* p, int64_t n) {
  T tmp[kW];
  std::memset(static_cast<void*>(tmp), 0, sizeof(tmp));
  std::memcpy(static_cast<void*>(tmp), p, n * sizeof(T));
  return load_f(tmp);
}
template <typename O>
inline void store_partial(O* p, const float* src, int64_t n) {
  alignas(64) float f[kW] = {};
  std::memcpy(f, src, n * sizeof(float));
  O tmp[kW];
  store_f(tmp, fVec::loadu(f));
  std::memcpy(static_cast<void*>(p), tmp, n * sizeof(O));
}

inline fVec vmadd(const fVec& a, const fVec& b, const fVec& c) {
  if constexpr (kFma) return at::vec::fmadd(a, b, c);
  else return a * b + c;  // torch's DEFAULT build: two roundings
}
inline float smadd(float a, float b, float c) {
  if constexpr (kFma) return std::fma(a, b, c);
  else return a * b + c;
}

// One element of the scalar tail; `vector_sq`: exp_avg_sq as torch's vector loop computes it.
inline void scalar_update(float& p, float& m, float& v, float g, const Hyper& h, bool vector_sq) {
  if (h.use_scale) g = g * h.scale;
  if (h.maximize) g = -g;
  if (h.has_wd) {
    if (h.decoupled) p = p * h.decay;
    else g = smadd(p, h.wd, g);
  }
  m = h.lerp_small ? smadd(h.coeff, g - m, m) : smadd(h.coeff, g - m, g);
  if (vector_sq && kFma) v = std::fma(h.c2 * g, g, v * h.b2);
  else v = smadd(v, h.b2, (h.c2 * g) * g);
  const float denom = std::sqrt(v) / h.bc2_sqrt + h.eps;
  p = p - (h.step_size * m) / denom;
}

// `denom`: the update's own sqrt(v) / bc2 + eps where its constants are the terms' (t.same_denom).
inline void lookahead_terms(const fVec& x, const fVec& m, const fVec& v, const fVec* denom, const Terms& t,
                            fVec& base, fVec& rate) {
  const fVec r = fVec(1.0f) / (denom ? *denom : v.sqrt() / fVec(t.bc2) + fVec(t.eps));
  rate = r * fVec(t.rate);
  if (t.decoupled) base = x * fVec(t.a) - (r * m) * fVec(t.b);
  else base = x - (r * (m * fVec(t.b1) + x * fVec(t.a))) * fVec(t.b);
}

// Base and Rate: the lookahead's outputs (model dtype, as Out), written when t.on (Out given).
template <typename G, typename O>
void update_range(float* P, float* M, float* V, const G* Gr, O* Out, O* Base, O* Rate, int64_t size,
                  const Hyper& h, const Terms& t) {
  int64_t d = 0;
  const fVec scale(h.scale), minus_one(-1.0f), wd(h.wd), decay(h.decay), coeff(h.coeff), c2(h.c2),
      b2(h.b2), bc2_sqrt(h.bc2_sqrt), eps(h.eps), neg_step_size(h.neg_step_size);
  for (; d < size - (size % kW); d += kW) {
    fVec p = fVec::loadu(P + d);
    fVec g = load_f(Gr + d);
    if (h.use_scale) g = g * scale;
    if (h.maximize) g = g * minus_one;
    if (h.has_wd) {
      if (h.decoupled) p = p * decay;
      else g = vmadd(p, wd, g);
    }
    fVec m = fVec::loadu(M + d);
    m = h.lerp_small ? vmadd(coeff, g - m, m) : vmadd(coeff, g - m, g);
    fVec v = fVec::loadu(V + d);
    v = kFma ? at::vec::fmadd(c2 * g, g, v * b2) : v * b2 + c2 * g * g;
    m.store(M + d);
    v.store(V + d);
    const fVec denom = v.sqrt() / bc2_sqrt + eps;
    p = p + neg_step_size * m / denom;
    p.store(P + d);
    if constexpr (!std::is_same_v<O, NoOut>) {
      store_f(Out + d, p);
      if (t.on) {
        fVec base, rate;
        lookahead_terms(p, m, v, t.same_denom ? &denom : nullptr, t, base, rate);
        store_f(Base + d, base);
        store_f(Rate + d, rate);
      }
    }
  }
  const int64_t rest = size - d;
  if (rest == 0) return;
  alignas(64) float g[kW];
  load_partial(Gr + d, rest).store(g);
  const int64_t vector_like = (kTailBlock > 0 && rest >= kTailBlock) ? kTailBlock : 0;
  for (int64_t i = 0; i < rest; i++) {
    scalar_update(P[d + i], M[d + i], V[d + i], g[i], h, i < vector_like);
  }
  if constexpr (!std::is_same_v<O, NoOut>) {
    store_partial(Out + d, P + d, rest);
    if (t.on) {  // through padded vectors: the vector loop's operations (each one IEEE rounding)
      alignas(64) float p[kW] = {}, m[kW] = {}, v[kW] = {}, base[kW], rate[kW];
      std::memcpy(p, P + d, rest * sizeof(float));
      std::memcpy(m, M + d, rest * sizeof(float));
      std::memcpy(v, V + d, rest * sizeof(float));
      fVec vb, vr;
      lookahead_terms(fVec::loadu(p), fVec::loadu(m), fVec::loadu(v), nullptr, t, vb, vr);
      vb.store(base);
      vr.store(rate);
      store_partial(Base + d, base, rest);
      store_partial(Rate + d, rate, rest);
    }
  }
}

template <typename G, typename O>
void run(const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
         const at::Tensor& grad, O* out, O* base, O* rate, const Hyper& h, const Terms& t) {
  float* P = master.data_ptr<float>();
  float* M = exp_avg.data_ptr<float>();
  float* V = exp_avg_sq.data_ptr<float>();
  const G* Gr = grad.data_ptr<G>();
  const int64_t n = master.numel();
  // torch's partition: tasks of one 64-byte line of fp32, grain 0, so only the last task has a tail.
  constexpr int64_t unit = 64 / sizeof(float);
  const int64_t units = (n + unit - 1) / unit;
  at::parallel_for(0, units, 0, [&](int64_t begin, int64_t end) {
    begin *= unit;
    end = std::min(end * unit, n);
    O *o = nullptr, *b = nullptr, *r = nullptr;
    if constexpr (!std::is_same_v<O, NoOut>) {
      o = out + begin;
      if (t.on) b = base + begin, r = rate + begin;
    }
    update_range<G, O>(P + begin, M + begin, V + begin, Gr + begin, o, b, r, end - begin, h, t);
  });
}

template <typename G, typename O>
void run_typed(const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
               const at::Tensor& grad, const at::Tensor& out, const std::optional<at::Tensor>& base,
               const std::optional<at::Tensor>& rate, const Hyper& h, const Terms& t) {
  O* b = t.on ? base->data_ptr<O>() : nullptr;
  O* r = t.on ? rate->data_ptr<O>() : nullptr;
  run<G, O>(master, exp_avg, exp_avg_sq, grad, out.data_ptr<O>(), b, r, h, t);
}

template <typename G>
void run_out(const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
             const at::Tensor& grad, const std::optional<at::Tensor>& out, const std::optional<at::Tensor>& base,
             const std::optional<at::Tensor>& rate, const Hyper& h, const Terms& t) {
  if (!out.has_value()) return run<G, NoOut>(master, exp_avg, exp_avg_sq, grad, nullptr, nullptr, nullptr, h, t);
  switch (out->scalar_type()) {
    case at::kFloat: return run_typed<G, float>(master, exp_avg, exp_avg_sq, grad, *out, base, rate, h, t);
    case at::kBFloat16: return run_typed<G, c10::BFloat16>(master, exp_avg, exp_avg_sq, grad, *out, base, rate, h, t);
    case at::kHalf: return run_typed<G, c10::Half>(master, exp_avg, exp_avg_sq, grad, *out, base, rate, h, t);
    default: TORCH_CHECK(false, "fused_adam_step: out must be float32, bfloat16 or float16");
  }
}

void fused_adam_step(const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                     const at::Tensor& grad, const std::optional<at::Tensor>& out, double scale, double lr,
                     double beta1, double beta2, double eps, double weight_decay, double step,
                     bool decoupled, bool maximize, int64_t threads, const std::optional<at::Tensor>& base,
                     const std::optional<at::Tensor>& rate, at::ArrayRef<double> terms) {
  const int64_t n = master.numel();
  for (const at::Tensor* t : {&master, &exp_avg, &exp_avg_sq}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "fused_adam_step: master, exp_avg and exp_avg_sq must be contiguous float32 CPU tensors");
    TORCH_CHECK(t->numel() == n, "fused_adam_step: sizes differ");
  }
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous() && grad.numel() == n,
              "fused_adam_step: grad must be a contiguous CPU tensor of the master's size");
  if (out.has_value()) {
    TORCH_CHECK(out->device().is_cpu() && out->is_contiguous() && out->numel() == n,
                "fused_adam_step: out must be a contiguous CPU tensor of the master's size");
  }
  Terms t{};
  t.on = base.has_value();
  TORCH_CHECK(base.has_value() == rate.has_value(), "fused_adam_step: base and rate come together");
  if (t.on) {
    TORCH_CHECK(out.has_value(), "fused_adam_step: the lookahead's base and rate need out");
    for (const at::Tensor* x : {&*base, &*rate}) {
      TORCH_CHECK(x->device().is_cpu() && x->is_contiguous() && x->numel() == n &&
                      x->scalar_type() == out->scalar_type(),
                  "fused_adam_step: base and rate must be contiguous CPU tensors like out");
    }
    TORCH_CHECK(terms.size() == 6, "fused_adam_step: terms are (bc2, eps, rate, a, b, b1)");
    t.decoupled = decoupled;
    t.bc2 = float(terms[0]), t.eps = float(terms[1]), t.rate = float(terms[2]);
    t.a = float(terms[3]), t.b = float(terms[4]), t.b1 = float(terms[5]);
  }
  // As torch's kernel: bias corrections and coefficients in double, each rounded to float once.
  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2 = 1 - std::pow(beta2, step);
  const double step_size = lr / bias_correction1;
  const double exp_avg_grad_coefficient = 1 - beta1;
  Hyper h;
  h.scale = float(scale);  // buf.mul_(scale): the Python float is cast to float32 first
  h.use_scale = scale != 1.0;
  h.maximize = maximize;
  h.has_wd = weight_decay != 0.f;
  h.decoupled = decoupled;
  h.wd = float(weight_decay);
  h.decay = float(1 - lr * weight_decay);
  const float lerp_weight = float(exp_avg_grad_coefficient);
  h.lerp_small = std::abs(lerp_weight) < 0.5f;
  h.coeff = h.lerp_small ? lerp_weight : lerp_weight - 1.0f;
  h.c2 = float(1 - beta2);
  h.b2 = float(beta2);
  h.bc2_sqrt = float(std::sqrt(bias_correction2));
  h.eps = float(eps);
  h.step_size = float(step_size);
  h.neg_step_size = float(-step_size);
  t.same_denom = t.on && t.bc2 == h.bc2_sqrt && t.eps == h.eps;  // then the same bits: reuse the update's
#if AT_PARALLEL_OPENMP
  // omp_set_num_threads sets this thread's own setting, which at::parallel_for reads: restored below.
  // Torch's per-thread initialisation first, or at::parallel_for's would undo the setting here.
  at::internal::lazy_init_num_threads();
  const int previous = omp_get_max_threads();
  if (threads > 0) omp_set_num_threads(static_cast<int>(threads));
#endif
  try {
    switch (grad.scalar_type()) {
      case at::kFloat: run_out<float>(master, exp_avg, exp_avg_sq, grad, out, base, rate, h, t); break;
      case at::kBFloat16: run_out<c10::BFloat16>(master, exp_avg, exp_avg_sq, grad, out, base, rate, h, t); break;
      case at::kHalf: run_out<c10::Half>(master, exp_avg, exp_avg_sq, grad, out, base, rate, h, t); break;
      default: TORCH_CHECK(false, "fused_adam_step: grad must be float32, bfloat16 or float16");
    }
  } catch (...) {
#if AT_PARALLEL_OPENMP
    if (threads > 0) omp_set_num_threads(previous);
#endif
    throw;
  }
#if AT_PARALLEL_OPENMP
  if (threads > 0) omp_set_num_threads(previous);
#endif
}

}  // namespace

RAYDEEP_LIBRARY(RAYDEEP_OPS_NS, m) {
  m.def("fused_adam_step(Tensor(a!) master, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor grad, "
        "Tensor(d!)? out, float scale, float lr, float beta1, float beta2, float eps, float weight_decay, "
        "float step, bool decoupled, bool maximize, int threads, Tensor(e!)? base, Tensor(f!)? rate, "
        "float[] terms) -> ()");
}

RAYDEEP_LIBRARY_IMPL(RAYDEEP_OPS_NS, CPU, m) {
  m.impl("fused_adam_step", &fused_adam_step);
}
