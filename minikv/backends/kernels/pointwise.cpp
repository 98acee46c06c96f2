// minikv's row-wise kernels for the CPU: RMSNorm, SwiGLU's silu(gate) * up and rotary position
// embedding (RoPE), each one pass.
//
// Why: both are a few arithmetic operations per element, so their cost is how often the data
// crosses memory and how many ops are dispatched.  PyTorch runs `F.rms_norm` as five ops (pow,
// mean, add, rsqrt, mul, each writing a temporary) and SwiGLU as two (silu, then mul) on a
// strided half of the gate_up matmul's output: on a small step an rms_norm call costs many times
// its arithmetic.  Here each row is read once and written once, by one op (an fp32 row is read in
// place; only bf16 rows are widened into scratch).  docs/BENCHMARKS.md ("CPU kernels") has what
// that bought.
//
// Arithmetic, and why it is the same as PyTorch's:
//   rms_norm(x, w, eps) = w * to_dtype(x * rsqrt(mean(x^2) + eps)), the mean and the product
//     in fp32 whatever the dtype (transformers' LlamaRMSNorm).  The sum of squares is taken in
//     another order than ATen's reduction, so results differ from F.rms_norm in the last bits:
//     minikv uses this kernel only where a step is not held to transformers' exact rounding
//     (attention_fused._norm), like its packed matmuls.
//   silu_mul(gate_up) = silu(gate) * up for gate_up = [gate | up] along the last dim, silu(g)
//     = g / (1 + exp(-g)) with ATen's own vectorized exp (Sleef), which is how ATen's silu
//     kernel computes it: fp32 results are bit for bit those of F.silu(gate) * up
//     (tests/test_pointwise_kernels.py checks it), so it runs on exact steps too: every step
//     whose matmuls are dense (packed ones apply SwiGLU inside the matmul, matmuls.py).
//   rope_(qkv, cos, sin, heads) rotates the first `heads` heads of qkv [T, heads_total, D] in
//     place: x * cos + rotate_half(x) * sin, rotate_half's sign folded into the sine table (so
//     rotate_half(x) is x rolled by D/2), two products then one sum, each rounded to fp32, the
//     order of transformers' `q * cos + rotate_half(q) * sin`.  ATen needs four ops for it (the
//     roll is a copy, then mul, mul, add), each a pass over the step's q and k; this is one.  No
//     fused multiply-add: GCC contracts `a * b + c` into one FMA even under -std=c++20, so the
//     library is built with -ffp-contract=off (cpu_kernels.CXX_FLAGS); the products then round as
//     ATen's do and fp32 results are bit for bit ATen's (tests/test_pointwise_kernels.py), which
//     lets exact (fresh-prefill) steps use it too.  In bf16 each ATen op rounds its fp32 result to
//     bf16; the kernel rounds at the same three places, so bf16 results are ATen's bits as well.
//
// Layout contract (checked below): inputs are 2-D [rows, n] with a contiguous last dim (any row
// stride: gate_up's halves and qkv views qualify); outputs are new contiguous tensors.
#include "cpu_vec.h"

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using minikv_cpu::Vec;
// Rows per task: enough that a small batch (a decode step's 16 rows) stays on one thread, where
// waking the other would cost more than the work.
constexpr int64_t kGrainElements = 16384;

inline int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(n, 1)); }

// Row r of an fp32 tensor as fp32: the row itself, read in place.  Of a bf16 one: widened into
// `scratch` (the kernels compute in fp32 either way), so only bf16 pays a copy.
inline const float* fp32_row(const float* src, std::vector<float>&, int64_t) { return src; }
inline const float* fp32_row(const at::BFloat16* src, std::vector<float>& scratch, int64_t n) {
  minikv_cpu::to_fp32(src, scratch.data(), n);
  return scratch.data();
}

template <typename T>
void rms_norm_kernel(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& y) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<float> row_scratch(std::is_same_v<T, float> ? 0 : n), weight_scratch(std::is_same_v<T, float> ? 0 : n);
    const float* weight = fp32_row(wp, weight_scratch, n);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = fp32_row(xp + r * xs, row_scratch, n);
      // 1. mean of squares, in fp32, a vector of partial sums at a time
      Vec acc(0.f);
      int64_t i = 0;
      for (; i + Vec::size() <= n; i += Vec::size()) {
        Vec v = Vec::loadu(row + i);
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
  constexpr bool kFloat = std::is_same_v<T, float>;
  const int64_t rows = gu.size(0), n = gu.size(1) / 2, s = gu.stride(0);
  const T* gp = gu.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const Vec one(1.f);
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(kFloat ? 0 : 2 * n);  // bf16: the row's [gate | up] as fp32, then the result
    for (int64_t r = begin; r < end; ++r) {
      const float* g = fp32_row(gp + r * s, scratch, 2 * n);  // gate and up lie side by side in the row
      const float* u = g + n;
      // fp32 is written straight into the output; bf16 into the scratch, then rounded
      float* res = kFloat ? reinterpret_cast<float*>(op + r * n) : scratch.data();
      for (int64_t i = 0; i < n; i += Vec::size()) {  // ATen's silu: x / (1 + exp(-x)), then * up
        const int64_t c = std::min<int64_t>(Vec::size(), n - i);  // the tail as a partial vector, as ATen does
        Vec x = Vec::loadu(g + i, c);
        ((x / (one + x.neg().exp())) * Vec::loadu(u + i, c)).store(res + i, c);
      }
      if constexpr (!kFloat) {
        T* o = op + r * n;
        for (int64_t j = 0; j < n; ++j) o[j] = static_cast<T>(res[j]);
      }
    }
  });
}

void rope_kernel_fp32(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  const int64_t T = qkv.size(0), D = qkv.size(2), half = D / 2, ts = qkv.stride(0), hs = qkv.stride(1);
  float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const bool vec = half % Vec::size() == 0;  // a vector never straddles the two halves
  at::parallel_for(0, T, grain_rows(heads * D), [&](int64_t begin, int64_t end) {
    std::vector<float> x(D);  // one head's values before rotation: its partner half is read from here
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * D;
      const float* sn = sp + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        float* y = xp + t * ts + h * hs;
        std::copy(y, y + D, x.data());
        int64_t d = 0;
        if (vec)
          for (; d < D; d += Vec::size()) {
            const int64_t partner = d < half ? d + half : d - half;
            const Vec a = Vec::loadu(x.data() + d) * Vec::loadu(c + d);
            const Vec b = Vec::loadu(x.data() + partner) * Vec::loadu(sn + d);
            (a + b).store(y + d);
          }
        for (; d < D; ++d) {
          const float a = x[d] * c[d], b = x[d < half ? d + half : d - half] * sn[d];
          y[d] = a + b;
        }
      }
    }
  });
}

// f rounded to the nearest bf16 (ties to even), kept as an fp32: what a bf16 ATen op stores
// after computing in fp32 (c10's round_to_nearest_even; a NaN becomes the quiet NaN).  Integer
// arithmetic on the bits, so the loops below vectorize.
inline float round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u = std::isnan(f) ? 0x7FC00000u : (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

// bf16: the same formula with ATen's three roundings, one after each op (the roll is a copy, the
// two products and the sum each stored as bf16), so results are bit for bit those of the exact
// branch's ops in bf16 too.  Each head is widened into fp32 scratch, computed, then narrowed by
// taking the top 16 bits of values already rounded.
void rope_kernel_bf16(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  const int64_t T = qkv.size(0), D = qkv.size(2), half = D / 2, ts = qkv.stride(0), hs = qkv.stride(1);
  auto* xp = qkv.data_ptr<at::BFloat16>();
  const auto* cp = cos.data_ptr<at::BFloat16>();
  const auto* sp = sin.data_ptr<at::BFloat16>();
  at::parallel_for(0, T, grain_rows(heads * D), [&](int64_t begin, int64_t end) {
    std::vector<float> c(D), sn(D), x(D), o(D);
    for (int64_t t = begin; t < end; ++t) {
      minikv_cpu::to_fp32(cp + t * D, c.data(), D);
      minikv_cpu::to_fp32(sp + t * D, sn.data(), D);
      for (int64_t h = 0; h < heads; ++h) {
        at::BFloat16* y = xp + t * ts + h * hs;
        minikv_cpu::to_fp32(y, x.data(), D);
        for (int64_t d = 0; d < half; ++d)
          o[d] = round_bf16(round_bf16(x[d] * c[d]) + round_bf16(x[d + half] * sn[d]));
        for (int64_t d = half; d < D; ++d)
          o[d] = round_bf16(round_bf16(x[d] * c[d]) + round_bf16(x[d - half] * sn[d]));
        auto* y16 = reinterpret_cast<uint16_t*>(y);
        for (int64_t d = 0; d < D; ++d) {
          uint32_t u;
          std::memcpy(&u, &o[d], 4);
          y16[d] = static_cast<uint16_t>(u >> 16);
        }
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

at::Tensor rope_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  const auto dt = qkv.scalar_type();
  TORCH_CHECK(qkv.dim() == 3 && (dt == at::kFloat || dt == at::kBFloat16) && qkv.stride(2) == 1,
              "rope_: qkv must be fp32 or bf16 [tokens, heads, head_dim] with a contiguous last dim, got sizes ",
              qkv.sizes(), " strides ", qkv.strides(), " ", dt);
  const int64_t T = qkv.size(0), D = qkv.size(2);
  TORCH_CHECK(D % 2 == 0, "rope_: head_dim must be even, got ", D);
  TORCH_CHECK(heads >= 0 && heads <= qkv.size(1), "rope_: heads=", heads, " outside [0, ", qkv.size(1), "]");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == dt && t->is_contiguous() && t->numel() == T * D && t->size(0) == T &&
                    t->size(-1) == D,
                "rope_: cos and sin must be contiguous [", T, ", 1, ", D, "] tables (one row per token) of qkv's dtype ",
                dt, ", got ", t->sizes(), " ", t->scalar_type());
  if (dt == at::kFloat) rope_kernel_fp32(qkv, cos, sin, heads);
  else rope_kernel_bf16(qkv, cos, sin, heads);
  return qkv;
}

// rope_ on the qkv matmul's 2-D output, then K and V of every row stored into the pool slots
// `slots` of one layer (kv_slots: [slots, 2 * kv_heads, D], KVPool.kv_slots[layer]): the view,
// the RoPE, the split and the index_copy_ of a fused layer, as one op.  cos_table / sin_table are
// [max_position + 1, D] (fused_plan.rope_tables), looked up here at each row's position.  A row's
// K and V heads are its last 2 * kv_heads * D values, a pool slot's layout: one memcpy each.
at::Tensor rope_store_(at::Tensor qkv, const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& positions,
                       at::Tensor kv_slots, const at::Tensor& slots) {
  TORCH_CHECK(kv_slots.dim() == 3 && kv_slots.is_contiguous() && kv_slots.scalar_type() == qkv.scalar_type() && kv_slots.size(1) % 2 == 0,
              "rope_store_: kv_slots must be a contiguous [slots, 2 * kv_heads, D] of qkv's dtype, got ", kv_slots.sizes(), " ",
              kv_slots.scalar_type());
  const int64_t D = kv_slots.size(2), kv = kv_slots.size(1), T = qkv.dim() == 2 ? qkv.size(0) : -1;
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && D > 0 && qkv.size(1) % D == 0 && qkv.size(1) / D > kv,
              "rope_store_: qkv must be a contiguous [T, heads_total * ", D, "] with more than ", kv, " heads, got ", qkv.sizes());
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == T && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "rope_store_: slots must be a contiguous int64 [", T, "], got ", slots.sizes(), " ", slots.scalar_type());
  const int64_t n_slots = kv_slots.size(0), width = qkv.size(1), row = kv * D;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < n_slots, "rope_store_: row ", t, " names slot ", sp[t], " of a pool of ", n_slots);
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T && positions.scalar_type() == at::kLong,
              "rope_store_: positions must be int64 [", T, "], got ", positions.sizes(), " ", positions.scalar_type());
  for (const at::Tensor* t : {&cos_table, &sin_table})
    TORCH_CHECK(t->dim() == 2 && t->size(1) == D, "rope_store_: the cos and sin tables must be [positions, ", D, "], got ", t->sizes());
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cos_table.size(0) && pp[t] < sin_table.size(0), "rope_store_: row ", t, " is at position ",
                pp[t], ", past the tables' ", cos_table.size(0), " rows");
  at::Tensor heads = qkv.view({T, width / D, D});
  rope_(heads, cos_table.index_select(0, positions), sin_table.index_select(0, positions), width / D - kv / 2);  // q, k; not v
  const size_t bytes = row * qkv.element_size();
  const char* src = static_cast<const char*>(qkv.data_ptr()) + (width - row) * qkv.element_size();
  char* dst = static_cast<char*>(kv_slots.data_ptr());
  for (int64_t t = 0; t < T; ++t) std::memcpy(dst + sp[t] * bytes, src + t * width * qkv.element_size(), bytes);
  return qkv;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minikv, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads) -> Tensor(a!)");
  m.def("rope_store_(Tensor(a!) qkv, Tensor cos_table, Tensor sin_table, Tensor positions, Tensor(b!) kv_slots, Tensor slots) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(minikv, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_", &rope_);
  m.impl("rope_store_", &rope_store_);
}
