// minikv's causal prefill attention for the CPU: every fresh prefill of a step in one call.
//
// Why a kernel: a fresh prefill attends over its own new keys, causally.  SDPA's CPU flash kernel
// does that one sequence at a time (one call per sequence per layer), at well under the useful
// FLOP rate the layers' matmuls reach, so attention's share of a prefill's time is several times
// its share of the FLOPs (docs/BENCHMARKS.md, "CPU kernels").  Two things it leaves on the table,
// both taken here:
//
// * Grouped-query attention shares keys: the `rep` query heads of one KV head (3 in SmolLM2)
//   become `rep` rows of one tile, so a block of keys, packed once, serves all of them.
// * A register-blocked inner product: a tile of query rows times a block of keys is a small
//   matrix product, computed as one (see `scores` and `accumulate` below) rather than a dot product
//   per (row, key) with a horizontal sum each.
//
// The softmax is FlashAttention's online one, as in paged_attention.cpp: a task walks its key
// blocks in order keeping each row's running maximum m, denominator l and weighted sum O, and
// rescales l and O by exp(m_old - m_new) when a block raises the maximum.  Blocks wholly in the
// future of a tile are never visited (causal skipping); the one on the diagonal is masked.
// Accumulation is fp32 whatever the inputs' dtype, like SDPA's CPU kernel; the result is not bit
// for bit SDPA's (another reduction order), which the engine accepts only where it accepts the
// decode tolerance (attention_fused.py).
//
// Layout contract (checked below):
//   q    [T, q_heads, D]   the step's flat queries, last dim contiguous
//   k, v [T, kv_heads, D]  their keys and values, last dim contiguous (views of one qkv buffer)
//   seqs [S, 2] int64      (first row, length) of each fresh prefill among the T rows
//   out  [T, q_heads * D]  contiguous, q's dtype (the layout o_proj takes): the kernel writes
//                          the rows of these sequences and leaves every other row alone
#include "attention_tiles.h"

namespace {

using minikv_cpu::HeadDims;
using minikv_tiles::BQ;
using minikv_tiles::Seq;
using minikv_tiles::tiles;

// Fresh prefills: keys are the sequence's own new rows of k and v.
template <typename T, int64_t D>
void prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seqs,
             float scale, at::Tensor& out) {
  const T *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  const int64_t* sp = seqs.data_ptr<int64_t>();  // sequence s: rows sp[2s] .. sp[2s] + sp[2s+1] - 1
  std::vector<Seq> list;
  for (int64_t s = 0; s < seqs.size(0); ++s) list.push_back({sp[2 * s], sp[2 * s + 1], 0});
  tiles<T, D>(q.data_ptr<T>(), q.stride(0), q.stride(1), q.size(1), k.size(1), list, BQ, scale, out.data_ptr<T>(),
              [&](int64_t s, int64_t h, int64_t j) {
                const int64_t row = list[s].base + j;
                return std::pair<const T*, const T*>(kp + row * ks0 + h * ks1, vp + row * vs0 + h * vs1);
              });
}

at::Tensor& prefill_attention_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& seqs, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "prefill_attention: q, k, v must be [T, heads, D] with a contiguous last dim, got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == T && k.size(2) == D,
              "prefill_attention: k and v must be [", T, ", kv_heads, ", D, "], got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.size(1) > 0 && Hq % k.size(1) == 0, "prefill_attention: ", Hq, " query heads do not fit ", k.size(1), " KV heads");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
              (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "prefill_attention: q, k, v must all be float32 or all bfloat16, got ", q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(HeadDims::has(D), "prefill_attention: head_dim ", D, " is not one of ", at::IntArrayRef(HeadDims::list()));
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == Hq * D && out.is_contiguous() && out.scalar_type() == q.scalar_type(),
              "prefill_attention: out must be a contiguous ", q.scalar_type(), " [", T, ", ", Hq * D, "], got ", out.sizes(), " ", out.scalar_type());
  TORCH_CHECK(seqs.dim() == 2 && seqs.size(1) == 2 && seqs.scalar_type() == at::kLong && seqs.is_contiguous(),
              "prefill_attention: seqs must be a contiguous int64 [S, 2] of (first row, length), got ", seqs.sizes(), " ", seqs.scalar_type());
  const int64_t* sp = seqs.data_ptr<int64_t>();
  for (int64_t s = 0; s < seqs.size(0); ++s)  // the kernel trusts these with raw pointers
    TORCH_CHECK(sp[2 * s] >= 0 && sp[2 * s + 1] >= 1 && sp[2 * s] + sp[2 * s + 1] <= T && sp[2 * s + 1] < (int64_t(1) << 31),
                "prefill_attention: sequence ", s, " (first row ", sp[2 * s], ", length ", sp[2 * s + 1], ") does not lie in the ", T, " rows");
  const float sc = static_cast<float>(scale);
  HeadDims::dispatch(D, [&](auto d) {
    if (q.scalar_type() == at::kFloat)
      prefill<float, decltype(d)::value>(q, k, v, seqs, sc, out);
    else
      prefill<at::BFloat16, decltype(d)::value>(q, k, v, seqs, sc, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minikv, m) {
  m.def("prefill_attention_(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor seqs, float scale) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(minikv, CPU, m) { m.impl("prefill_attention_", &prefill_attention_); }
