// minikv's row-wise kernels for the CPU: RMSNorm, and SwiGLU's silu(gate) * up, each one pass.
//
// Why: both are a few arithmetic operations per element, so their cost is how often the data
// crosses memory and how many ops are dispatched.  PyTorch runs `F.rms_norm` as five ops (pow,
// mean, add, rsqrt, mul, each writing a temporary) and SwiGLU as two (silu, then mul) on a
// strided half of the gate_up matmul's output.  Profiled on the 2-core CPU (issue 11), those
// were about 14% of an fp32 prefill of the benchmark's prompts and ~110 us per rms_norm call on
// a 28-row prefix hit, where the arithmetic itself takes a few microseconds.  Here each row is
// read once and written once, by one op.
//
// Arithmetic, and why it is the same as PyTorch's:
//   rms_norm(x, w, eps) = w * to_dtype(x * rsqrt(mean(x^2) + eps)), the mean and the product
//     in fp32 whatever the dtype (transformers' LlamaRMSNorm).  The sum of squares is taken in
//     another order than ATen's reduction, so results differ from F.rms_norm in the last bits:
//     minikv uses this kernel only where a step is not held to transformers' exact rounding
//     (see matmuls.py), like its packed matmuls.
//   silu_mul(gate_up) = silu(gate) * up for gate_up = [gate | up] along the last dim, silu(g)
//     = g / (1 + exp(-g)) with ATen's own vectorized exp (Sleef), which is how ATen's silu
//     kernel computes it: fp32 results are bit for bit those of F.silu(gate) * up
//     (tests/test_pointwise_kernels.py checks it), so this one is used on every step.
//
// Layout contract (checked below): inputs are 2-D [rows, n] with a contiguous last dim (any row
// stride: gate_up's halves and qkv views qualify); outputs are new contiguous tensors.
#include "cpu_vec.h"

#include <cmath>
#include <type_traits>
#include <vector>

namespace {

using minikv_cpu::Vec;
// Rows per task: enough that a small batch (a decode step's 16 rows) stays on one thread, where
// waking the other would cost more than the work.
constexpr int64_t kGrainElements = 16384;

inline int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(n, 1)); }

template <typename T>
void rms_norm_kernel(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& y) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<float> row(n), weight(n);
    minikv_cpu::to_fp32(wp, weight.data(), n);
    for (int64_t r = begin; r < end; ++r) {
      minikv_cpu::to_fp32(xp + r * xs, row.data(), n);
      // 1. mean of squares, in fp32, a vector of partial sums at a time
      Vec acc(0.f);
      int64_t i = 0;
      for (; i + Vec::size() <= n; i += Vec::size()) {
        Vec v = Vec::loadu(row.data() + i);
        acc = at::vec::fmadd(v, v, acc);
      }
      float ss = acc.reduce_add();
      for (; i < n; ++i) ss += row[i] * row[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
      // 2. normalise, round to the dtype (as transformers does before the weight), then scale
      T* out = yp + r * n;
      for (int64_t j = 0; j < n; ++j) {
        const T normed = static_cast<T>(row[j] * inv);
        out[j] = static_cast<T>(weight[j] * static_cast<float>(normed));
      }
    }
  });
}

template <typename T>
void silu_mul_kernel(const at::Tensor& gu, at::Tensor& out) {
  const int64_t rows = gu.size(0), n = gu.size(1) / 2, s = gu.stride(0);
  const T* gp = gu.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const Vec one(1.f);
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    std::vector<float> g(n), u(n);
    for (int64_t r = begin; r < end; ++r) {
      minikv_cpu::to_fp32(gp + r * s, g.data(), n);
      minikv_cpu::to_fp32(gp + r * s + n, u.data(), n);
      for (int64_t i = 0; i < n; i += Vec::size()) {  // ATen's silu: x / (1 + exp(-x)), then * up
        const int64_t c = std::min<int64_t>(Vec::size(), n - i);  // the tail as a partial vector, as ATen does
        Vec x = Vec::loadu(g.data() + i, c);
        ((x / (one + x.neg().exp())) * Vec::loadu(u.data() + i, c)).store(g.data() + i, c);
      }
      T* o = op + r * n;
      if constexpr (std::is_same_v<T, float>) {
        std::copy(g.begin(), g.end(), o);
      } else {
        for (int64_t j = 0; j < n; ++j) o[j] = static_cast<T>(g[j]);
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, op, ": ", name, " must be 2-D [rows, n] with a contiguous last dim, got sizes ",
              t.sizes(), " strides ", t.strides());
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, op, ": ", name, " has dtype ",
              t.scalar_type(), "; float32 or bfloat16 only");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm", "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be a contiguous [", x.size(1), "] of x's dtype ", x.scalar_type(), ", got ", weight.sizes(), " ",
              weight.scalar_type());
  TORCH_CHECK(eps > 0 && std::isfinite(eps), "rms_norm: eps must be a positive number, got ", eps);
  at::Tensor y = at::empty({x.size(0), x.size(1)}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.scalar_type() == at::kFloat) rms_norm_kernel<float>(x, weight, eps, y);
  else rms_norm_kernel<at::BFloat16>(x, weight, eps, y);
  return y;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul", "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up's last dim must be [gate | up], an even size, got ", gate_up.size(1));
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options().memory_format(at::MemoryFormat::Contiguous));
  if (gate_up.scalar_type() == at::kFloat) silu_mul_kernel<float>(gate_up, out);
  else silu_mul_kernel<at::BFloat16>(gate_up, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minikv, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(minikv, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
}
