// What minikv's CPU kernels share: ATen's vector types at this build's width, and fp32 rows.
//
// ATen's vector types pick their width from CPU_CAPABILITY_*; set it from what this build's
// -march allows, so Vec below is 16 (AVX-512) or 8 (AVX2) floats and exp() runs that many lanes at
// once through Sleef, the same code ATen's own kernels of that capability run.
#pragma once
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#endif
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace minikv_cpu {

using Vec = at::vec::Vectorized<float>;

// n values as fp32 in dst: fp32 is copied; bf16 is widened (bf16 is the top half of an fp32, so
// widening is a 16-bit shift, which the compiler vectorizes).  Kernels compute in fp32 either way.
// The shifted bits become a float through memcpy, not through a uint32_t* into dst: a float read
// after a uint32_t write may be reordered before it (strict aliasing), and was, into a stack
// array of 16 floats in prefill_attention.cpp.
inline void to_fp32(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }
inline void to_fp32(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    dst[i] = f;
  }
}

// The head dims the attention kernels are instantiated for, written once: both kernels check and
// dispatch through this list, and paged_decode_head_dims() reports it (Python's
// registry.KERNEL_HEAD_DIMS is tested against that), so the "cpu_kernels" backend's decode and
// prefill kernels take exactly the same models.
template <int64_t... Ds>
struct HeadDimList {
  static bool has(int64_t d) { return ((d == Ds) || ...); }
  static std::vector<int64_t> list() { return {Ds...}; }
  // f(std::integral_constant<int64_t, D>{}) for the D equal to d (check has(d) first: then exactly
  // one case runs), so a kernel gets its head dim as a compile-time constant.
  template <typename F>
  static void dispatch(int64_t d, F&& f) {
    ((d == Ds ? (f(std::integral_constant<int64_t, Ds>{}), true) : false) || ...);
  }
};
using HeadDims = HeadDimList<16, 32, 64, 128, 256>;

}  // namespace minikv_cpu
