// CUDA kernels of edgetl's fused mask ops (masks.cpp has the ops' schema, their CPU and meta
// kernels, and what they compute). Built with masks.cpp into the op namespace EDGETL_OPS
// (edgetl_cuda) where a CUDA toolkit is found (edgetl/models/lean/fused.py). Launched on the
// current stream, their results allocated by the caching allocator: a CUDA graph captures them.
//
// Not yet run on a GPU (no GPU where they were written): tests/test_fused_masks.py checks them
// against torch's path on CUDA where there is one, and skips that check elsewhere.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#ifndef EDGETL_OPS
#define EDGETL_OPS edgetl_cuda
#endif

// fp32, bf16 and fp16, computed in fp32 (as masks.cpp)
#define EDGETL_DISPATCH(TYPE, NAME, ...)                                                           \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                         \
                                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)                      \
                                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace {

constexpr int kThreads = 256;

// one thread per packed byte: its 8 values clamped in place as torch's CUDA clamp_ clamps them,
// bit i set where value i is strictly inside (0, upper) (or above 0 with no upper)
template <typename T>
__global__ void clamp_pack_kernel(T* y, uint8_t* out, int64_t n, int64_t nbytes, float upper, bool has_upper) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= nbytes) {
    return;
  }
  uint8_t bits = 0;
  const int64_t e = n - 8 * j < 8 ? n - 8 * j : 8;
  for (int64_t i = 0; i < e; ++i) {
    float v = static_cast<float>(y[8 * j + i]);
    if (!isnan(v)) {  // as torch's CUDA clamp_: a NaN kept, else min(max(v, 0), upper), fmaxf
      v = has_upper ? fminf(fmaxf(v, 0.f), upper) : fmaxf(v, 0.f);  // (which makes -0.0 +0.0)
      y[8 * j + i] = static_cast<T>(v);  // exact: v is y's value or 0 or upper
    }
    bits |= static_cast<uint8_t>(v != 0.f && !(has_upper && v == upper)) << i;
  }
  out[j] = bits;
}

// one thread per value: g times its bit (0 or 1, multiplied as torch's path multiplies)
template <typename T>
__global__ void mask_mul_kernel(const T* g, const uint8_t* p, T* o, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) {
    return;
  }
  const float bit = static_cast<float>((p[i >> 3] >> (i & 7)) & 1);
  o[i] = static_cast<T>(bit * static_cast<float>(g[i]));
}

unsigned blocks(int64_t work) {
  return static_cast<unsigned>((work + kThreads - 1) / kThreads);
}

at::Tensor clamp_pack_cuda(at::Tensor& y, std::optional<double> upper) {
  TORCH_CHECK(y.is_non_overlapping_and_dense(), "clamp_pack_: y must be dense (a layer's fresh output)");
  const c10::cuda::CUDAGuard guard(y.device());
  const int64_t n = y.numel();
  const int64_t nbytes = (n + 7) / 8;
  at::Tensor out = at::empty({nbytes}, y.options().dtype(at::kByte));
  if (nbytes == 0) {
    return out;
  }
  const float u = upper.has_value() ? static_cast<float>(*upper) : 0.f;
  const auto stream = at::cuda::getCurrentCUDAStream();
  EDGETL_DISPATCH(y.scalar_type(), "clamp_pack_", [&] {
    clamp_pack_kernel<scalar_t><<<blocks(nbytes), kThreads, 0, stream>>>(
        y.data_ptr<scalar_t>(), out.data_ptr<uint8_t>(), n, nbytes, u, upper.has_value());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor mask_mul_cuda(const at::Tensor& g, const at::Tensor& packed, bool channels_last) {
  const c10::cuda::CUDAGuard guard(g.device());
  const auto format = channels_last && g.dim() == 4 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  at::Tensor out = at::empty(g.sizes(), g.options().memory_format(format));
  const int64_t n = out.numel();
  TORCH_CHECK(packed.device() == g.device(), "mask_mul: packed bytes on ", packed.device(), ", values on ", g.device());
  TORCH_CHECK(packed.dtype() == at::kByte && packed.is_contiguous() && packed.numel() == (n + 7) / 8,
              "mask_mul: ", packed.numel(), " packed bytes for ", n, " values");
  if (n == 0) {
    return out;
  }
  const bool same = g.strides() == out.strides();  // else g is copied into out's layout first
  if (!same) {
    out.copy_(g);
  }
  const auto stream = at::cuda::getCurrentCUDAStream();
  EDGETL_DISPATCH(out.scalar_type(), "mask_mul", [&] {
    const scalar_t* gd = same ? g.const_data_ptr<scalar_t>() : out.const_data_ptr<scalar_t>();
    mask_mul_kernel<scalar_t><<<blocks(n), kThreads, 0, stream>>>(gd, packed.const_data_ptr<uint8_t>(),
                                                                 out.data_ptr<scalar_t>(), n);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(EDGETL_OPS, CUDA, m) {
  m.impl("clamp_pack_", clamp_pack_cuda);
  m.impl("mask_mul", mask_mul_cuda);
}
