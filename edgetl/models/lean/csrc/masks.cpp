// edgetl's fused mask kernels (LeanOptions.mask_kernels "fused"; loaded by edgetl/models/lean/fused.py).
//
// The lean layers keep a ReLU / ReLU6 output's 1-bit mask (0 < y < upper), 8 elements a byte,
// bit i of byte j for element 8j + i in the tensor's memory order (edgetl/models/lean/masks.py).
// With torch's own ops that takes ten kernels a layer forward (clamp, casts, integer adds,
// the fold and its copy) and six backward (the unpack table, the gather, the multiply). Here:
//
//   clamp_pack_(y, upper)            y clamped to [0, upper] in place (a NaN and -0.0 kept, as
//                                    torch's CPU clamp_ keeps them), its mask's packed bytes returned
//   mask_mul(g, packed, channels_last)
//                                    a new tensor laid out as the masked output (channels-last
//                                    or contiguous), g times the unpacked mask (0 or 1)
//
// Same values, bit for bit, as edgetl's aten path (tests/test_fused_masks.py), a NaN's payload
// aside (torch's clamp may return another NaN; a value left in range is not written), and on
// an Arm CPU a zero's sign (torch 2.5's fp32 clamp there makes -0.0 +0.0 in its vectorised body,
// not in its scalar tail; this one keeps it, as torch's x86 kernels do). Meta
// kernels give the accounting the results' layouts. On x86-64 float32, bf16 and fp16 run AVX2
// (+ F16C) where the CPU has them (checked at run time); anything else runs the portable loop,
// which the compiler vectorises as it can. The CUDA kernels are in masks_cuda.cu.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
// EDGETL_PORTABLE builds the portable loop alone (what an Arm CPU runs), under the op namespace
// EDGETL_OPS (default edgetl): tests/test_fused_masks.py checks that build on x86-64 too
#if defined(__x86_64__) && !defined(EDGETL_PORTABLE)
#define EDGETL_AVX2 1
#include <immintrin.h>
#endif
#ifndef EDGETL_OPS
#define EDGETL_OPS edgetl
#endif

// the activation dtypes of the lean runtime (fp32, bf16, fp16): each value is computed in fp32,
// exact for them; anything else (float64) is refused (edgetl/models/lean/fused.py sends it to
// torch's ops)
#define EDGETL_DISPATCH(TYPE, NAME, ...)                                                           \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                         \
                                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)                      \
                                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace {

constexpr int64_t kGrain = 4096;  // bytes of mask (32768 elements) a parallel task at least

template <typename T>
void clamp_pack_loop(T* y, uint8_t* out, int64_t n, int64_t b0, int64_t b1, float upper, bool has_upper) {
  for (int64_t j = b0; j < b1; ++j) {
    uint8_t bits = 0;
    const int64_t e = std::min<int64_t>(8, n - 8 * j);
    for (int64_t i = 0; i < e; ++i) {
      float v = static_cast<float>(y[8 * j + i]);
      if (v < 0.f) {
        y[8 * j + i] = static_cast<T>(v = 0.f);
      } else if (has_upper && v > upper) {
        y[8 * j + i] = static_cast<T>(v = upper);  // exact in y's dtype (checked by the caller)
      }
      bits |= static_cast<uint8_t>(v != 0.f && !(has_upper && v == upper)) << i;
    }
    out[j] = bits;
  }
}

template <typename T>
void mask_mul_loop(const T* g, const uint8_t* p, T* o, int64_t n, int64_t b0, int64_t b1) {
  for (int64_t j = b0; j < b1; ++j) {
    const int64_t e = std::min<int64_t>(8, n - 8 * j);
    for (int64_t i = 0; i < e; ++i) {
      o[8 * j + i] = static_cast<T>(static_cast<float>((p[j] >> i) & 1) * static_cast<float>(g[8 * j + i]));
    }
  }
}

#if defined(EDGETL_AVX2)
__attribute__((target("avx2"))) void clamp_pack_avx2(float* y, uint8_t* out, int64_t b0, int64_t b1, float upper,
                                                     bool has_upper) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 up = _mm256_set1_ps(has_upper ? upper : INFINITY);
  for (int64_t j = b0; j < b1; ++j) {
    __m256 v = _mm256_loadu_ps(y + 8 * j);
    // ordered compares are false for NaN: a NaN stays, as -0.0 does (not below 0)
    v = _mm256_blendv_ps(v, zero, _mm256_cmp_ps(v, zero, _CMP_LT_OQ));
    v = _mm256_blendv_ps(v, up, _mm256_cmp_ps(v, up, _CMP_GT_OQ));
    _mm256_storeu_ps(y + 8 * j, v);
    __m256 keep = _mm256_cmp_ps(v, zero, _CMP_NEQ_UQ);
    if (has_upper) {  // (ReLU: +inf is inside)
      keep = _mm256_and_ps(keep, _mm256_cmp_ps(v, up, _CMP_NEQ_UQ));
    }
    out[j] = static_cast<uint8_t>(_mm256_movemask_ps(keep));  // lane i -> bit i
  }
}

__attribute__((target("avx2"))) void mask_mul_avx2(const float* g, const uint8_t* p, float* o, int64_t b0,
                                                   int64_t b1) {
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t j = b0; j < b1; ++j) {
    const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(p[j]), lane_bit), lane_bit);
    const __m256 m = _mm256_and_ps(_mm256_castsi256_ps(set), one);  // 1.0 where the bit is set, else 0.0
    _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(m, _mm256_loadu_ps(g + 8 * j)));
  }
}

// bf16 and fp16: 8 values widened to fp32 (bf16: its bits shifted up; fp16: F16C), clamped and
// tested there; a clamped lane's 16 bits written back (0 and upper are exact in both), every other
// lane's left as it was
__attribute__((target("avx2,f16c"))) inline __m256 widen(const uint16_t* x, bool bf16) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
}

__attribute__((target("avx2,f16c"))) inline __m128i narrow(__m256 v, bool bf16) {
  if (!bf16) {
    return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // exact: v is an fp16 value
  }
  const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(v), 16);  // exact: v is a bf16 value
  return _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
}

__attribute__((target("avx2,f16c"))) void clamp_pack_avx2_half(uint16_t* y, uint8_t* out, int64_t b0, int64_t b1,
                                                              float upper, bool has_upper, bool bf16) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 up = _mm256_set1_ps(has_upper ? upper : INFINITY);
  for (int64_t j = b0; j < b1; ++j) {
    const __m256 v0 = widen(y + 8 * j, bf16);
    const __m256 below = _mm256_cmp_ps(v0, zero, _CMP_LT_OQ);
    const __m256 above = _mm256_cmp_ps(v0, up, _CMP_GT_OQ);
    const __m256 v = _mm256_blendv_ps(_mm256_blendv_ps(v0, zero, below), up, above);
    const __m256i changed = _mm256_castps_si256(_mm256_or_ps(below, above));
    const __m128i changed16 = _mm_packs_epi32(_mm256_castsi256_si128(changed), _mm256_extracti128_si256(changed, 1));
    __m128i* at = reinterpret_cast<__m128i*>(y + 8 * j);
    _mm_storeu_si128(at, _mm_blendv_epi8(_mm_loadu_si128(at), narrow(v, bf16), changed16));
    __m256 keep = _mm256_cmp_ps(v, zero, _CMP_NEQ_UQ);
    if (has_upper) {
      keep = _mm256_and_ps(keep, _mm256_cmp_ps(v, up, _CMP_NEQ_UQ));
    }
    out[j] = static_cast<uint8_t>(_mm256_movemask_ps(keep));
  }
}

__attribute__((target("avx2,f16c"))) void mask_mul_avx2_half(const uint16_t* g, const uint8_t* p, uint16_t* o,
                                                            int64_t b0, int64_t b1, bool bf16) {
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t j = b0; j < b1; ++j) {
    const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(p[j]), lane_bit), lane_bit);
    const __m256 m = _mm256_and_ps(_mm256_castsi256_ps(set), one);
    // m * g is g, +-0 or NaN: exact in g's dtype
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 8 * j), narrow(_mm256_mul_ps(m, widen(g + 8 * j, bf16)), bf16));
  }
}

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
}

template <typename T>
constexpr bool is_half() {
  return std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>;
}
#endif

at::Tensor clamp_pack_cpu(at::Tensor& y, std::optional<double> upper) {
  TORCH_CHECK(y.is_non_overlapping_and_dense(), "clamp_pack_: y must be dense (a layer's fresh output)");
  const int64_t n = y.numel();
  const int64_t nbytes = (n + 7) / 8;
  at::Tensor out = at::empty({nbytes}, y.options().dtype(at::kByte));
  uint8_t* o = out.data_ptr<uint8_t>();
  const float u = upper.has_value() ? static_cast<float>(*upper) : 0.f;
  const bool has_upper = upper.has_value();
  EDGETL_DISPATCH(y.scalar_type(), "clamp_pack_", [&] {
    scalar_t* d = y.data_ptr<scalar_t>();
    at::parallel_for(0, nbytes, kGrain, [&](int64_t b0, int64_t b1) {
#if defined(EDGETL_AVX2)
      if ((std::is_same_v<scalar_t, float> || is_half<scalar_t>()) && cpu_has_avx2()) {
        const int64_t whole = std::max(b0, std::min(b1, n / 8));  // bytes of 8 elements
        if constexpr (std::is_same_v<scalar_t, float>) {
          clamp_pack_avx2(reinterpret_cast<float*>(d), o, b0, whole, u, has_upper);
        } else {
          clamp_pack_avx2_half(reinterpret_cast<uint16_t*>(d), o, b0, whole, u, has_upper,
                               std::is_same_v<scalar_t, at::BFloat16>);
        }
        b0 = whole;
      }
#endif
      clamp_pack_loop(d, o, n, b0, b1, u, has_upper);
    });
  });
  return out;
}

at::Tensor empty_as_masked(const at::Tensor& g, bool channels_last) {
  const auto format = channels_last && g.dim() == 4 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  return at::empty(g.sizes(), g.options().memory_format(format));
}

at::Tensor mask_mul_cpu(const at::Tensor& g, const at::Tensor& packed, bool channels_last) {
  at::Tensor out = empty_as_masked(g, channels_last);
  const int64_t n = out.numel();
  TORCH_CHECK(packed.device() == g.device(), "mask_mul: packed bytes on ", packed.device(), ", values on ", g.device());
  TORCH_CHECK(packed.dtype() == at::kByte && packed.is_contiguous() && packed.numel() == (n + 7) / 8,
              "mask_mul: ", packed.numel(), " packed bytes for ", n, " values");
  // g read in the output's memory order: as it is where it is laid out so, else copied in first
  const bool same = g.strides() == out.strides();
  if (!same) {
    out.copy_(g);
  }
  const uint8_t* p = packed.data_ptr<uint8_t>();
  EDGETL_DISPATCH(out.scalar_type(), "mask_mul", [&] {
    const scalar_t* gd = same ? g.const_data_ptr<scalar_t>() : out.const_data_ptr<scalar_t>();
    scalar_t* od = out.data_ptr<scalar_t>();
    at::parallel_for(0, (n + 7) / 8, kGrain, [&](int64_t b0, int64_t b1) {
#if defined(EDGETL_AVX2)
      if ((std::is_same_v<scalar_t, float> || is_half<scalar_t>()) && cpu_has_avx2()) {
        const int64_t whole = std::max(b0, std::min(b1, n / 8));
        if constexpr (std::is_same_v<scalar_t, float>) {
          mask_mul_avx2(reinterpret_cast<const float*>(gd), p, reinterpret_cast<float*>(od), b0, whole);
        } else {
          mask_mul_avx2_half(reinterpret_cast<const uint16_t*>(gd), p, reinterpret_cast<uint16_t*>(od), b0, whole,
                             std::is_same_v<scalar_t, at::BFloat16>);
        }
        b0 = whole;
      }
#endif
      mask_mul_loop(gd, p, od, n, b0, b1);
    });
  });
  return out;
}

at::Tensor clamp_pack_meta(at::Tensor& y, std::optional<double> upper) {
  return at::empty({(y.numel() + 7) / 8}, y.options().dtype(at::kByte));
}

at::Tensor mask_mul_meta(const at::Tensor& g, const at::Tensor& packed, bool channels_last) {
  return empty_as_masked(g, channels_last);
}

}  // namespace

// TORCH_LIBRARY through a macro of edgetl's own, so that EDGETL_OPS is expanded before it is
// named: torch 2.5's TORCH_LIBRARY (the Jetson's) stringizes its argument as written, which
// registered the ops under "EDGETL_OPS" (found by the emulated Jetson check); later torch
// expands it first
#define EDGETL_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

EDGETL_LIBRARY(EDGETL_OPS, m) {
  m.def("clamp_pack_(Tensor(a!) y, float? upper) -> Tensor");
  m.def("mask_mul(Tensor g, Tensor packed, bool channels_last) -> Tensor");
}

TORCH_LIBRARY_IMPL(EDGETL_OPS, CPU, m) {
  m.impl("clamp_pack_", clamp_pack_cpu);
  m.impl("mask_mul", mask_mul_cpu);
}

TORCH_LIBRARY_IMPL(EDGETL_OPS, Meta, m) {
  m.impl("clamp_pack_", clamp_pack_meta);
  m.impl("mask_mul", mask_mul_meta);
}
