// minikv's matmul for few rows (a "skinny" GEMM): y = x @ W^T for x of 1-48 rows, fp32, AVX-512.
//
// Why: a decode step multiplies 16 rows by every weight matrix of the model; a prefix hit, the
// 28 uncached rows of a prompt.  Matmul libraries are tuned for large products, and at these
// sizes leave most of the CPU idle.  The floor of any such product is reading every weight from
// memory once; this kernel aims at it.  The engine uses it up to a row bound (matmuls.py) set
// where the libraries catch up (docs/BENCHMARKS.md, "CPU kernels", has the comparison).
//
// How, in three ideas (the classic "register-blocked GEMM microkernel", which BLIS popularised):
//
// 1. The weights are packed once, at start-up, into panels of NR = 32 output columns:
//    panel p holds W[p*32 .. p*32+31][k] for k = 0..K-1, 32 floats per k, contiguous.  One k of a
//    panel is then two AVX-512 registers, read with two aligned-size loads, and a whole panel is
//    one sequential stream of K * 128 bytes.  (The checkpoint's [N, K] rows would need 32 strided
//    reads per k.)  Columns past N in the last panel are zeros.
// 2. The microkernel keeps an MR x NR block of y in registers, MR = 14 rows: 14 x 2 = 28 of the
//    32 vector registers, leaving room for the two panel vectors and one broadcast row value.
//    For each k it loads the panel's two vectors once and does 28 fused multiply-adds with
//    them: one broadcast of x[r][k] per row.  So every weight loaded from memory is used 14 times
//    before it leaves a register.  The x rows are packed k-major first ([K][MR]), so the
//    broadcasts read one stream instead of 14 rows (14 row pointers do not fit the 16 general
//    registers: the compiler spilled them, and the kernel ran at a third of this speed).
// 3. The weights stream from memory, so they are prefetched: PF k-steps (8 KB) ahead.  Without
//    it the loads stall on memory and the arithmetic waits on them: the hardware prefetcher
//    alone does not run that far ahead.
//
// Panels are split across threads; a thread computes every row block of its panels, so a panel
// is read from memory once and re-read from cache for the second row block.
//
// Arithmetic: each y[r][n] is a sum over k in order 0..K-1 with fused multiply-adds, in fp32.
// That differs from MKL's order (last-bit differences, like oneDNN's packed kernel), so minikv
// uses it only on steps not held to transformers' exact rounding (decodes, prefix hits).  A row's
// result depends on nothing but its own x row: not on how many rows share the call or which
// thread ran it (tests/test_skinny_linear.py checks that batch invariance).
//
// bf16 (where the CPU has AVX512-BF16): the same blocking around `vdpbf16ps`, which multiplies
// pairs of bf16 and adds both products to an fp32 lane.  So the panels hold k in pairs: panel p,
// pair kp is 64 bf16, W[p*32 + j][2kp] and W[p*32 + j][2kp + 1] side by side for j = 0..31 (two
// registers, 128 bytes, as one fp32 k-step), and each row's pair (x[2kp], x[2kp + 1]) is
// broadcast as one 32-bit value.  Half the k-steps over half the bytes of fp32: a decode step
// streams 212 MB of SmolLM2 weights instead of 424.  Sums stay fp32; each output is rounded to
// bf16 once, after the residual add when there is one (as oneDNN's "add" epilogue does).
#include "cpu_vec.h"

#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define MINIKV_SKINNY 1
#else
#define MINIKV_SKINNY 0
#endif
#if MINIKV_SKINNY && defined(__AVX512BF16__)
#define MINIKV_SKINNY_BF16 1
#else
#define MINIKV_SKINNY_BF16 0
#endif

namespace {

constexpr int64_t NR = 32;     // output columns per panel: two 16-float AVX-512 registers
constexpr int MR = 14;         // rows per microkernel call (see 2. above)
constexpr int64_t PF = 64;     // prefetch distance, in k-steps of one panel (64 x 128 B = 8 KB)
constexpr int64_t kMaxRows = 4096;  // a sanity bound: past ~48 rows minikv calls the libraries

// fp32 weights pack as [panels, K, 32] floats; bf16 as [panels, ceil(K / 2), 64]: pairs of k.
void check_packed(const at::Tensor& packed) {
  const bool f32 = packed.scalar_type() == at::kFloat, bf16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && ((f32 && packed.size(2) == NR) || (bf16 && packed.size(2) == 2 * NR)),
              "skinny_linear: packed weights must be skinny_pack's contiguous fp32 [panels, K, ", NR, "] or bf16 [panels, K/2, ",
              2 * NR, "], got ", packed.sizes(), " ", packed.scalar_type());
}

// The K a packed tensor was made for, as far as it can tell (bf16 pairs: K or K - 1).
inline bool fits_k(const at::Tensor& packed, int64_t K) {
  return packed.scalar_type() == at::kFloat ? packed.size(1) == K : packed.size(1) == (K + 1) / 2;
}

#if MINIKV_SKINNY
// y[r][0..ncols) (+)= sum_k x[k*ROWS + r] * b[k][0..ncols) for r < ROWS.  x: ROWS packed rows,
// k-major; b: one panel; y: row stride ldy.  `add`: accumulate onto y (the residual stream).
template <int ROWS>
void microkernel(const float* x, const float* b, int64_t K, float* y, int64_t ldy, int64_t ncols, bool add) {
  __m512 lo[ROWS], hi[ROWS];  // the ROWS x 32 block of y, in registers for the whole k loop
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* bk = b + k * NR;
    _mm_prefetch(reinterpret_cast<const char*>(bk + PF * NR), _MM_HINT_T0);  // never faults, even past the end
    _mm_prefetch(reinterpret_cast<const char*>(bk + PF * NR + 16), _MM_HINT_T0);
    const __m512 b0 = _mm512_loadu_ps(bk), b1 = _mm512_loadu_ps(bk + 16);
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) {
      const __m512 a = _mm512_set1_ps(x[k * ROWS + r]);
      lo[r] = _mm512_fmadd_ps(a, b0, lo[r]);
      hi[r] = _mm512_fmadd_ps(a, b1, hi[r]);
    }
  }
  // Write back: whole panels with two stores per row, the last (narrower) panel through a buffer.
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) {
    float* yr = y + r * ldy;
    if (ncols == NR) {
      if (add) {
        lo[r] = _mm512_add_ps(lo[r], _mm512_loadu_ps(yr));
        hi[r] = _mm512_add_ps(hi[r], _mm512_loadu_ps(yr + 16));
      }
      _mm512_storeu_ps(yr, lo[r]);
      _mm512_storeu_ps(yr + 16, hi[r]);
    } else {
      alignas(64) float tmp[NR];
      _mm512_store_ps(tmp, lo[r]);
      _mm512_store_ps(tmp + 16, hi[r]);
      for (int64_t j = 0; j < ncols; ++j) yr[j] = add ? yr[j] + tmp[j] : tmp[j];
    }
  }
}

using Microkernel = void (*)(const float*, const float*, int64_t, float*, int64_t, int64_t, bool);
// One instantiation per row count, so the last, shorter row block is unrolled too.
const Microkernel kMicrokernels[MR + 1] = {
    nullptr, microkernel<1>, microkernel<2>, microkernel<3>, microkernel<4>, microkernel<5>, microkernel<6>,
    microkernel<7>, microkernel<8>, microkernel<9>, microkernel<10>, microkernel<11>, microkernel<12>,
    microkernel<13>, microkernel<14>};
#endif

#if MINIKV_SKINNY_BF16
// 16 bf16 at p as 16 fp32 (bf16 is an fp32's top half: widen, shift left 16).
inline __m512 load_bf16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The bf16 microkernel: x holds each row's k-pairs as 32-bit values, [K2][ROWS]; b one panel of
// pairs, [K2][64] bf16.  The ROWS x 32 fp32 sums stay in registers; rounded to bf16 on the way out.
template <int ROWS>
void microkernel_bf16(const uint32_t* x, const at::BFloat16* b, int64_t K2, at::BFloat16* y, int64_t ldy, int64_t ncols,
                      bool add) {
  __m512 lo[ROWS], hi[ROWS];
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K2; ++kp) {
    const at::BFloat16* bk = b + kp * 2 * NR;
    _mm_prefetch(reinterpret_cast<const char*>(bk + PF * 2 * NR), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(bk + PF * 2 * NR + 32), _MM_HINT_T0);
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bk), b1 = (__m512bh)_mm512_loadu_si512(bk + 32);
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[kp * ROWS + r]));
      lo[r] = _mm512_dpbf16_ps(lo[r], a, b0);
      hi[r] = _mm512_dpbf16_ps(hi[r], a, b1);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) {
    at::BFloat16* yr = y + r * ldy;
    if (ncols == NR) {
      if (add) {
        lo[r] = _mm512_add_ps(lo[r], load_bf16(yr));
        hi[r] = _mm512_add_ps(hi[r], load_bf16(yr + 16));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(yr), (__m256i)_mm512_cvtneps_pbh(lo[r]));  // round to nearest even
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(yr + 16), (__m256i)_mm512_cvtneps_pbh(hi[r]));
    } else {
      alignas(64) float tmp[NR];
      _mm512_store_ps(tmp, lo[r]);
      _mm512_store_ps(tmp + 16, hi[r]);
      for (int64_t j = 0; j < ncols; ++j) yr[j] = static_cast<at::BFloat16>(add ? static_cast<float>(yr[j]) + tmp[j] : tmp[j]);
    }
  }
}

using MicrokernelBf16 = void (*)(const uint32_t*, const at::BFloat16*, int64_t, at::BFloat16*, int64_t, int64_t, bool);
const MicrokernelBf16 kMicrokernelsBf16[MR + 1] = {
    nullptr, microkernel_bf16<1>, microkernel_bf16<2>, microkernel_bf16<3>, microkernel_bf16<4>, microkernel_bf16<5>,
    microkernel_bf16<6>, microkernel_bf16<7>, microkernel_bf16<8>, microkernel_bf16<9>, microkernel_bf16<10>,
    microkernel_bf16<11>, microkernel_bf16<12>, microkernel_bf16<13>, microkernel_bf16<14>};
#endif

#if MINIKV_SKINNY
// y (+)= x @ W^T with W packed; y is [M, n] contiguous, x's dtype.  T: float or at::BFloat16.
template <typename T>
void skinny_into(const at::Tensor& x_in, const at::Tensor& packed, int64_t n, at::Tensor& y, bool add) {
  constexpr bool kFloat = std::is_same_v<T, float>;
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0), steps = packed.size(1);  // steps: k (fp32) or k-pairs
  const int64_t blocks = (M + MR - 1) / MR;
  // x's rows, packed k-major per block of MR rows: block i is [steps][rows of block i], a k-step
  // being one float (fp32) or one pair of bf16 in a 32-bit word (the pair past an odd K: x, 0).
  using Word = std::conditional_t<kFloat, float, uint32_t>;
  std::vector<Word> xk(blocks * MR * steps);
  const T* xs = x.data_ptr<T>();
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t r0 = i * MR, rows = std::min<int64_t>(MR, M - r0);
    Word* d = xk.data() + i * MR * steps;
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = xs + (r0 + r) * K;
      if constexpr (kFloat) {
        for (int64_t k = 0; k < K; ++k) d[k * rows + r] = row[k];
      } else {
        const uint16_t* bits = reinterpret_cast<const uint16_t*>(row);
        for (int64_t kp = 0; kp < steps; ++kp) {
          const uint32_t hi = 2 * kp + 1 < K ? bits[2 * kp + 1] : 0;
          d[kp * rows + r] = static_cast<uint32_t>(bits[2 * kp]) | (hi << 16);
        }
      }
    }
  }
  const T* w = packed.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t panel_stride = steps * (kFloat ? NR : 2 * NR);
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t ncols = std::min<int64_t>(NR, n - p * NR);
      for (int64_t i = 0; i < blocks; ++i) {
        const int64_t r0 = i * MR, rows = std::min<int64_t>(MR, M - r0);
        const Word* xb = xk.data() + i * MR * steps;
        if constexpr (kFloat) {
          kMicrokernels[rows](xb, w + p * panel_stride, steps, yp + r0 * n + p * NR, n, ncols, add);
        } else {
#if MINIKV_SKINNY_BF16
          kMicrokernelsBf16[rows](xb, w + p * panel_stride, steps, yp + r0 * n + p * NR, n, ncols, add);
#endif
        }
      }
    }
  });
}
#endif

void dispatch(const at::Tensor& x, const at::Tensor& packed, int64_t n, at::Tensor& y, bool add) {
#if MINIKV_SKINNY
  if (x.scalar_type() == at::kFloat) return skinny_into<float>(x, packed, n, y, add);
#endif
#if MINIKV_SKINNY_BF16
  if (x.scalar_type() == at::kBFloat16) return skinny_into<at::BFloat16>(x, packed, n, y, add);
#endif
  TORCH_CHECK(false, "skinny_linear: this build has no few-row matmul for ", x.scalar_type(),
              " (fp32 needs AVX-512, bf16 AVX512-BF16: see skinny_linear_supported(), skinny_linear_bf16_supported())");
}

void check_input(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  check_packed(packed);
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "skinny_linear: x must be 2-D fp32 or bf16 [rows, K], got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "skinny_linear: x is ", x.scalar_type(), " but the weights were packed as ",
              packed.scalar_type());
  TORCH_CHECK(fits_k(packed, x.size(1)), "skinny_linear: x has K=", x.size(1), " columns but the weights have ",
              packed.scalar_type() == at::kFloat ? "K=" : "K/2=", packed.size(1));
  TORCH_CHECK(n > (packed.size(0) - 1) * NR && n <= packed.size(0) * NR, "skinny_linear: n=", n,
              " output columns do not fit ", packed.size(0), " panels of ", NR);
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "skinny_linear: rows=", x.size(0), " outside [1, ", kMaxRows, "]");
}

}  // namespace

bool skinny_linear_supported() { return MINIKV_SKINNY; }
bool skinny_linear_bf16_supported() { return MINIKV_SKINNY_BF16; }

// Element (p, s, j, e) of the panels is W[p*32 + j][s*pair + e] (pair: 1 for fp32, 2 for bf16).
template <typename T>
void pack_panels(const T* src, T* dst, int64_t N, int64_t K, int64_t pair) {
  const int64_t panels = (N + NR - 1) / NR, steps = (K + pair - 1) / pair;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < std::min<int64_t>(NR, N - p * NR); ++j)
        for (int64_t k = 0; k < K; ++k) dst[((p * steps + k / pair) * NR + j) * pair + k % pair] = src[(p * NR + j) * K + k];
  });
}

// [N, K] weights (nn.Linear's layout) -> fp32 [ceil(N / 32), K, 32] or bf16 [ceil(N / 32), ceil(K / 2), 64]
// panels (bf16: k in pairs, see the header), zero-padded past N and past an odd K.
at::Tensor skinny_pack(const at::Tensor& w_in) {
  const bool bf16 = w_in.scalar_type() == at::kBFloat16;
  TORCH_CHECK(w_in.dim() == 2 && (w_in.scalar_type() == at::kFloat || bf16) && w_in.size(0) >= 1 && w_in.size(1) >= 1,
              "skinny_pack: weights must be non-empty 2-D fp32 or bf16 [N, K], got ", w_in.sizes(), " ", w_in.scalar_type());
  const at::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + NR - 1) / NR;
  const int64_t pair = bf16 ? 2 : 1, steps = (K + pair - 1) / pair;  // k-steps of a panel
  at::Tensor out = at::zeros({panels, steps, pair * NR}, w.options());
  if (bf16) pack_panels(w.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), N, K, 2);
  else pack_panels(w.data_ptr<float>(), out.data_ptr<float>(), N, K, 1);
  return out;
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  check_input(x, packed, n);
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  dispatch(x, packed, n, y, /*add=*/false);
  return y;
}

// out += x @ W^T, in place (a residual add inside the matmul); returns out.
at::Tensor skinny_linear_add_(at::Tensor out, const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == x.scalar_type() && out.is_contiguous(),
              "skinny_linear_add_: out must be contiguous 2-D [rows, n] of x's dtype ", x.scalar_type(), ", got ", out.sizes(), " ",
              out.scalar_type());
  check_input(x, packed, out.size(1));
  TORCH_CHECK(out.size(0) == x.size(0), "skinny_linear_add_: out has ", out.size(0), " rows but x has ", x.size(0));
  dispatch(x, packed, out.size(1), out, /*add=*/true);
  return out;
}

TORCH_LIBRARY_FRAGMENT(minikv, m) {
  m.def("skinny_linear_supported() -> bool", &skinny_linear_supported);  // no tensors: a catch-all kernel
  m.def("skinny_linear_bf16_supported() -> bool", &skinny_linear_bf16_supported);
  m.def("skinny_pack(Tensor w) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("skinny_linear_add_(Tensor(a!) out, Tensor x, Tensor packed) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(minikv, CPU, m) {
  m.impl("skinny_pack", &skinny_pack);
  m.impl("skinny_linear", &skinny_linear);
  m.impl("skinny_linear_add_", &skinny_linear_add_);
}
