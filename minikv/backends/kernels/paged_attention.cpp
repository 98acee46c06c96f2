// minikv's paged decode attention for the CPU: one query token per sequence, reading its keys
// and values *in place* from the KV pool's blocks, the way vLLM's PagedAttention kernels do.
//
// Why a kernel: the fused backend in pure PyTorch must first copy every sequence's blocks into
// a padded [S, kv_heads, c_max, D] tensor (one index_select per layer) and then hand that copy to
// SDPA, which reads it again.  A decode step of a small model is memory-bound, so that copy and
// the second read were a large share of a decode step (docs/BENCHMARKS.md, "CPU kernels").
// Here each (sequence, KV head) task walks its own block table and streams every key and value
// exactly once, with no padding: a short sequence batched with a long one costs only its length.
//
// The arithmetic is the textbook one (softmax(q.K^T * scale) V) computed *online*, 32 keys at a
// time, as FlashAttention does: keep the running maximum m, the running denominator l and the
// running weighted sum acc; when a chunk raises the maximum, rescale l and acc by exp(m_old -
// m_new).  Accumulation is in fp32 whatever the pool's dtype (fp32 or bf16), like SDPA's CPU
// kernel.  The `rep` query heads that share one KV head (grouped-query attention) share one task,
// so each key and value is read from the pool once for all of them.
//
// Layout contract (checked below; see minikv/engine/kv_pool.py):
//   q       [S, q_heads, D]     any strides but the last (a view of the qkv matmul's output)
//   blocks  [num_blocks, block_size, 2, kv_heads, D], contiguous: one layer of the pool, each slot
//           holding its token's K heads then its V heads
//   tables  [S, W] int64        pool block of each of a sequence's key blocks (rows padded)
//   ctx     [S] int64           context length of each sequence (keys 0..ctx-1 are visible)
// Returns [S, q_heads * D] in q's dtype, the layout o_proj takes.
#include "cpu_vec.h"

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using minikv_cpu::HeadDims;
using minikv_cpu::to_fp32;
using minikv_cpu::Vec;

// exp of n floats in place, a vector at a time (the tail as a partial vector).
inline void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) Vec::loadu(x + i).exp().store(x + i);
  if (i < n) Vec::loadu(x + i, n - i).exp().store(x + i, n - i);
}

constexpr int64_t kChunk = 32;  // positions per online-softmax update

// D, the head dim, is a compile-time constant so that one query row and its running output
// (D / Vec::size() vectors each: 4 + 4 for SmolLM2 with AVX-512) stay in registers.
template <typename T, int64_t D>
void decode(const at::Tensor& q, const at::Tensor& blocks, const at::Tensor& tables,
            const at::Tensor& ctx, float scale, at::Tensor& out) {
  static_assert(D % Vec::size() == 0, "head_dim must be a whole number of vectors");
  constexpr int64_t NV = D / Vec::size();
  const int64_t S = q.size(0), Hq = q.size(1);
  const int64_t bs = blocks.size(1), Hkv = blocks.size(3), W = tables.size(1);
  const int64_t rep = Hq / Hkv, qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t slot_stride = 2 * Hkv * D, block_stride = bs * slot_stride;
  const T* qp = q.data_ptr<T>();
  const T* kv = blocks.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* cp = ctx.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  // One task per (sequence, KV head): 48 for SmolLM2 at batch 16, plenty for a few cores.  Tasks
  // are dealt round-robin to the threads, not in contiguous ranges: the engine orders decodes by
  // context length, so contiguous ranges would hand the last thread all the longest sequences.
  const int64_t tasks = S * Hkv, lanes = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, lanes, 1, [&](int64_t lane_begin, int64_t lane_end) {
    std::vector<float> keys, values;            // bf16 only: this task's keys and values widened
    std::vector<const float*> key_at, value_at;  // fp32 row of each position's key and value
    float sc[kChunk];
    for (int64_t lane = lane_begin; lane < lane_end; ++lane)
    for (int64_t task = lane; task < tasks; task += lanes) {
      const int64_t s = task / Hkv, h = task % Hkv, n = cp[s];
      // 1. Follow the block table: where this head's n keys and values are, in order, as fp32.
      //    An fp32 pool is read in place.  A bf16 one is widened once per task into a small copy
      //    (n * D * 8 bytes: it stays in cache) that the rep query heads then share; neither is a
      //    padded [S, c_max] tensor in memory as in the pure-PyTorch path.
      key_at.resize(n);
      value_at.resize(n);
      if constexpr (!std::is_same_v<T, float>) {
        keys.resize(n * D);
        values.resize(n * D);
      }
      for (int64_t b = 0; b * bs < n; ++b) {
        const T* base = kv + tp[s * W + b] * block_stride + h * D;
        for (int64_t j = 0; j < std::min(bs, n - b * bs); ++j) {  // the last block may be partly filled
          const int64_t i = b * bs + j;
          const T* k = base + j * slot_stride;
          if constexpr (std::is_same_v<T, float>) {
            key_at[i] = k;
            value_at[i] = k + Hkv * D;
          } else {
            to_fp32(k, keys.data() + i * D, D);
            to_fp32(k + Hkv * D, values.data() + i * D, D);
            key_at[i] = keys.data() + i * D;
            value_at[i] = values.data() + i * D;
          }
        }
      }
      // 2. Each of the rep query heads sharing this KV head, over those keys and values.
      for (int64_t r = 0; r < rep; ++r) {
        const T* src = qp + s * qs0 + (h * rep + r) * qs1;
        float qrow[D];
        for (int64_t d = 0; d < D; ++d) qrow[d] = static_cast<float>(src[d]) * scale;  // scale folded in once
        Vec qv[NV], acc[NV];
        for (int64_t i = 0; i < NV; ++i) {
          qv[i] = Vec::loadu(qrow + i * Vec::size());
          acc[i] = Vec(0.f);
        }
        float m = -std::numeric_limits<float>::infinity(), l = 0.f;
        for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
          const int64_t count = std::min(kChunk, n - c0);
          float mx = m;
          for (int64_t j = 0; j < count; ++j) {  // scores q . k_j
            const float* k = key_at[c0 + j];
            Vec dot = qv[0] * Vec::loadu(k);
            for (int64_t i = 1; i < NV; ++i) dot = at::vec::fmadd(qv[i], Vec::loadu(k + i * Vec::size()), dot);
            sc[j] = dot.reduce_add();
            mx = std::max(mx, sc[j]);
          }
          // Online softmax: the chunk's numerators relative to the new maximum, and a rescale of
          // everything summed so far (exp(-inf) = 0 on the first chunk).
          for (int64_t j = 0; j < count; ++j) sc[j] -= mx;
          exp_inplace(sc, count);
          const float corr = std::exp(m - mx);
          float sum = 0.f;
          for (int64_t j = 0; j < count; ++j) sum += sc[j];
          l = l * corr + sum;
          m = mx;
          for (int64_t i = 0; i < NV; ++i) acc[i] = acc[i] * Vec(corr);
          for (int64_t j = 0; j < count; ++j) {  // acc += p_j * v_j
            const float* v = value_at[c0 + j];
            const Vec p(sc[j]);
            for (int64_t i = 0; i < NV; ++i) acc[i] = at::vec::fmadd(p, Vec::loadu(v + i * Vec::size()), acc[i]);
          }
        }
        float orow[D];
        for (int64_t i = 0; i < NV; ++i) (acc[i] / Vec(l)).store(orow + i * Vec::size());
        T* o = op + s * Hq * D + (h * rep + r) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(orow[d]);
      }
    }
  });
}

std::vector<int64_t> paged_decode_head_dims() { return HeadDims::list(); }

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& blocks, const at::Tensor& tables,
                        const at::Tensor& ctx, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_decode: q must be [S, q_heads, D] with a contiguous last dim, got sizes ", q.sizes(), " strides ", q.strides());
  TORCH_CHECK(blocks.dim() == 5 && blocks.size(2) == 2 && blocks.is_contiguous(),
              "paged_decode: blocks must be a contiguous [num_blocks, block_size, 2, kv_heads, D], got ", blocks.sizes());
  TORCH_CHECK(q.scalar_type() == blocks.scalar_type(), "paged_decode: q is ", q.scalar_type(), " but the pool is ", blocks.scalar_type());
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "paged_decode: dtype ", q.scalar_type(), " is not float32 or bfloat16");
  const int64_t S = q.size(0), Hkv = blocks.size(3), D = q.size(2), bs = blocks.size(1);
  TORCH_CHECK(blocks.size(4) == D && Hkv > 0 && q.size(1) % Hkv == 0,
              "paged_decode: ", q.size(1), " query heads of dim ", D, " do not fit ", Hkv, " KV heads of dim ", blocks.size(4));
  TORCH_CHECK(HeadDims::has(D), "paged_decode: head_dim ", D, " is not one of ", at::IntArrayRef(HeadDims::list()));
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == S && tables.scalar_type() == at::kLong && tables.is_contiguous(),
              "paged_decode: tables must be a contiguous int64 [S, W] with S = ", S, ", got ", tables.sizes(), " ", tables.scalar_type());
  TORCH_CHECK(ctx.dim() == 1 && ctx.size(0) == S && ctx.scalar_type() == at::kLong && ctx.is_contiguous(),
              "paged_decode: ctx must be int64 [S] with S = ", S, ", got ", ctx.sizes(), " ", ctx.scalar_type());
  // The kernel trusts these indices with raw pointers, so check every one it will follow.
  const int64_t W = tables.size(1), nb = blocks.size(0);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* cp = ctx.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(cp[s] >= 1 && cp[s] <= W * bs, "paged_decode: sequence ", s, " has context ", cp[s], "; its table holds 1..", W * bs);
    for (int64_t b = 0; b * bs < cp[s]; ++b)
      TORCH_CHECK(tp[s * W + b] >= 0 && tp[s * W + b] < nb, "paged_decode: sequence ", s, " names block ", tp[s * W + b], " of a pool of ", nb);
  }
  at::Tensor out = at::empty({S, q.size(1) * D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const float sc = static_cast<float>(scale);
  HeadDims::dispatch(D, [&](auto d) {
    if (q.scalar_type() == at::kFloat)
      decode<float, decltype(d)::value>(q, blocks, tables, ctx, sc, out);
    else
      decode<at::BFloat16, decltype(d)::value>(q, blocks, tables, ctx, sc, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(minikv, m) {
  m.def("paged_decode(Tensor q, Tensor blocks, Tensor tables, Tensor ctx, float scale) -> Tensor");
  m.def("paged_decode_head_dims() -> int[]", &paged_decode_head_dims);  // no tensors: a catch-all kernel
}

TORCH_LIBRARY_IMPL(minikv, CPU, m) { m.impl("paged_decode", &paged_decode); }
