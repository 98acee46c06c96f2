// minikv's matmul for few rows (a "skinny" GEMM): y = x @ W^T for x of 1-48 rows, fp32, AVX-512.
//
// Why: a decode step multiplies 16 rows by every weight matrix of the model; a prefix hit, the
// 28 uncached rows of a prompt.  Matmul libraries are tuned for large products, and at these
// sizes leave most of the CPU idle.  Measured on the 2-core CPU (SmolLM2's 120 layer matmuls in
// fp32, one pass over all of them; the three ways interleaved, medians of 7, two runs):
//   rows   this kernel    oneDNN prepacked   F.linear
//     16   34.4 / 33.2    44.5 / 46.9        59.0 / 59.6 ms
//     28   47.2 / 40.8    61.5 / 53.1        72.8 / 61.8 ms
//     48   67.9 / 64.7    89.2 / 79.3        88.1 / 83.1 ms
//     64   85.9 / 78.7    98.6 / 91.6        93.3 / 90.4 ms
// One row through every weight (the floor: SmolLM2 is 424 MB of fp32 layer weights, read from
// memory once) takes 21-22 ms here.  The engine uses this kernel up to 48 rows (matmuls.py), a
// bound set where an earlier, noisier measurement had the libraries level at 64 rows.
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
//    it the loads stalled on memory and the arithmetic waited on them (28 rows: 57 ms against
//    33 ms with it).  The hardware prefetcher alone does not run that far ahead.
//
// Panels are split across threads; a thread computes every row block of its panels, so a panel
// is read from memory once and re-read from cache for the second row block.
//
// Arithmetic: each y[r][n] is a sum over k in order 0..K-1 with fused multiply-adds, in fp32.
// That differs from MKL's order (last-bit differences, like oneDNN's packed kernel), so minikv
// uses it only on steps not held to transformers' exact rounding (decodes, prefix hits).  A row's
// result depends on nothing but its own x row: not on how many rows share the call or which
// thread ran it (tests/test_skinny_linear.py checks that batch invariance).
#include "cpu_vec.h"

#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define MINIKV_SKINNY 1
#else
#define MINIKV_SKINNY 0
#endif

namespace {

constexpr int64_t NR = 32;     // output columns per panel: two 16-float AVX-512 registers
constexpr int MR = 14;         // rows per microkernel call (see 2. above)
constexpr int64_t PF = 64;     // prefetch distance, in k-steps of one panel (64 x 128 B = 8 KB)
constexpr int64_t kMaxRows = 4096;  // a sanity bound: past ~48 rows minikv calls the libraries

void check_packed(const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NR && packed.scalar_type() == at::kFloat && packed.is_contiguous(),
              "skinny_linear: packed weights must be skinny_pack's contiguous fp32 [panels, K, ", NR, "], got ",
              packed.sizes(), " ", packed.scalar_type());
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

// y (+)= x @ W^T with W packed; y is [M, n] contiguous fp32.
void skinny_into(const at::Tensor& x_in, const at::Tensor& packed, int64_t n, at::Tensor& y, bool add) {
#if MINIKV_SKINNY
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  const int64_t blocks = (M + MR - 1) / MR;
  // x's rows, packed k-major per block of MR rows: block i is [K][rows of block i].
  std::vector<float> xk(blocks * MR * K);
  const float* xs = x.data_ptr<float>();
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t r0 = i * MR, rows = std::min<int64_t>(MR, M - r0);
    float* d = xk.data() + i * MR * K;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < K; ++k) d[k * rows + r] = xs[(r0 + r) * K + k];
  }
  const float* w = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t ncols = std::min<int64_t>(NR, n - p * NR);
      for (int64_t i = 0; i < blocks; ++i) {
        const int64_t r0 = i * MR, rows = std::min<int64_t>(MR, M - r0);
        kMicrokernels[rows](xk.data() + i * MR * K, w + p * K * NR, K, yp + r0 * n + p * NR, n, ncols, add);
      }
    }
  });
#else
  TORCH_CHECK(false, "skinny_linear: this build has no AVX-512 (skinny_linear_supported() is false)");
#endif
}

void check_input(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  check_packed(packed);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "skinny_linear: x must be 2-D fp32 [rows, K], got ",
              x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.size(1) == packed.size(1), "skinny_linear: x has K=", x.size(1), " columns but the weights have K=",
              packed.size(1));
  TORCH_CHECK(n > (packed.size(0) - 1) * NR && n <= packed.size(0) * NR, "skinny_linear: n=", n,
              " output columns do not fit ", packed.size(0), " panels of ", NR);
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "skinny_linear: rows=", x.size(0), " outside [1, ", kMaxRows, "]");
}

}  // namespace

bool skinny_linear_supported() { return MINIKV_SKINNY; }

// [N, K] fp32 weights (nn.Linear's layout) -> [ceil(N / 32), K, 32] panels, zero-padded.
at::Tensor skinny_pack(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == at::kFloat && w_in.size(0) >= 1 && w_in.size(1) >= 1,
              "skinny_pack: weights must be non-empty 2-D fp32 [N, K], got ", w_in.sizes(), " ", w_in.scalar_type());
  const at::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + NR - 1) / NR;
  at::Tensor out = at::zeros({panels, K, NR}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < std::min<int64_t>(NR, N - p * NR); ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * NR + j] = src[(p * NR + j) * K + k];
  });
  return out;
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  check_input(x, packed, n);
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  skinny_into(x, packed, n, y, /*add=*/false);
  return y;
}

// out += x @ W^T, in place (a residual add inside the matmul); returns out.
at::Tensor skinny_linear_add_(at::Tensor out, const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "skinny_linear_add_: out must be contiguous 2-D fp32 [rows, n], got ", out.sizes(), " ", out.scalar_type());
  check_input(x, packed, out.size(1));
  TORCH_CHECK(out.size(0) == x.size(0), "skinny_linear_add_: out has ", out.size(0), " rows but x has ", x.size(0));
  skinny_into(x, packed, out.size(1), out, /*add=*/true);
  return out;
}

TORCH_LIBRARY_FRAGMENT(minikv, m) {
  m.def("skinny_linear_supported() -> bool", &skinny_linear_supported);  // no tensors: a catch-all kernel
  m.def("skinny_pack(Tensor w) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("skinny_linear_add_(Tensor(a!) out, Tensor x, Tensor packed) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(minikv, CPU, m) {
  m.impl("skinny_pack", &skinny_pack);
  m.impl("skinny_linear", &skinny_linear);
  m.impl("skinny_linear_add_", &skinny_linear_add_);
}
