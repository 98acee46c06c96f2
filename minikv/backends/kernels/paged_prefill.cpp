// minikv's paged prefill attention for the CPU: the new tokens of prefix hits (and of decodes
// batched with them) attend over their whole context, reading every key and value *in place*
// from the KV pool through each sequence's block table.  No gathered copy, no mask tensor.
//
// Why a kernel: the pure-PyTorch path serves a prefix hit by copying the sequence's blocks out of
// the pool into a contiguous [kv_heads, context, D] tensor, one index_select per layer, then
// building an additive causal mask and reshaping the queries so that grouped-query heads fold
// into rows: about a dozen ops per layer around one SDPA call, enough to make a hit dispatch more
// ops than a miss.  A hit's work is small (a few dozen new tokens), so those ops, not arithmetic,
// were its cost; on a GPU each is a kernel launch.  vLLM's
// PagedAttention and FlashInfer's paged prefill read the blocks where they lie; so does this.
//
// The arithmetic is the tiled causal attention of attention_tiles.h, the same code the fresh
// prefill kernel runs, with two differences: keys come from the pool (key j of a sequence lives in
// block table[j / block_size], slot j % block_size), and queries sit at the *end* of the context
// (query p of a sequence with n new tokens and context c is at position c - n + p and sees keys
// 0 .. c - n + p).  The step's new K/V must already be in the pool (rope_store_ puts them there).
// Small steps are cut into more tasks (fewer query positions per task) so that two cores both
// work on a one-sequence hit: 20 new tokens x 3 KV heads would otherwise be 3 tasks for 2 threads.
//
// Layout contract (checked below; see minikv/engine/kv_pool.py):
//   out     [T, q_heads * D]  contiguous, the pool's dtype: the rows of these sequences are written,
//                             every other row is left alone
//   qkv     [T, >= q_heads * D] contiguous last dim: row t's first q_heads * D values are its
//                             (roped) query heads, the qkv matmul's own output
//   blocks  [num_blocks, block_size, 2, kv_heads, D], contiguous: one layer of the pool
//   seqs    [S, 3] int64      (first row, new tokens, context length) of each sequence; flat [3 * S]
//                             is taken too (what the engine sends: no view op per step)
//   tables  [S, W] int64      pool block of each of a sequence's key blocks (rows padded); or flat
#include "attention_tiles.h"

namespace {

using minikv_cpu::HeadDims;
using minikv_tiles::BQ;
using minikv_tiles::Seq;
using minikv_tiles::tiles;

template <typename T, int64_t D>
void paged_prefill(const at::Tensor& qkv, const at::Tensor& blocks, const std::vector<Seq>& list,
                   const at::Tensor& tables, int64_t q_heads, float scale, at::Tensor& out) {
  const int64_t bs = blocks.size(1), Hkv = blocks.size(3), W = tables.numel() / list.size();
  const int64_t slot_stride = 2 * Hkv * D, block_stride = bs * slot_stride;
  const T* kv = blocks.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  // Positions per task: enough tasks for every thread (4 per thread where the step allows), never
  // fewer than 4 positions (a tile repacks its keys; tiny tiles would repack them for nothing).
  int64_t units = 0, longest = 1;
  for (const Seq& s : list) units += Hkv, longest = std::max(longest, s.n);
  const int64_t want = 4 * at::get_num_threads(), splits = (want + units - 1) / units;
  const int64_t bq = std::clamp<int64_t>((longest + splits - 1) / splits, 4, BQ);
  tiles<T, D>(qkv.data_ptr<T>(), qkv.stride(0), D, q_heads, Hkv, list, bq, scale, out.data_ptr<T>(),
              [&](int64_t s, int64_t h, int64_t j) {
                const T* k = kv + tp[s * W + j / bs] * block_stride + (j % bs) * slot_stride + h * D;
                return std::pair<const T*, const T*>(k, k + Hkv * D);
              });
}

at::Tensor& paged_prefill_(at::Tensor& out, const at::Tensor& qkv, const at::Tensor& blocks, const at::Tensor& seqs,
                           const at::Tensor& tables, double scale, int64_t q_heads) {
  TORCH_CHECK(blocks.dim() == 5 && blocks.size(2) == 2 && blocks.is_contiguous(),
              "paged_prefill: blocks must be a contiguous [num_blocks, block_size, 2, kv_heads, D], got ", blocks.sizes());
  const int64_t bs = blocks.size(1), Hkv = blocks.size(3), D = blocks.size(4), nb = blocks.size(0);
  const auto dt = blocks.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "paged_prefill: dtype ", dt, " is not float32 or bfloat16");
  TORCH_CHECK(HeadDims::has(D), "paged_prefill: head_dim ", D, " is not one of ", at::IntArrayRef(HeadDims::list()));
  TORCH_CHECK(q_heads > 0 && q_heads % Hkv == 0, "paged_prefill: ", q_heads, " query heads do not fit ", Hkv, " KV heads");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= q_heads * D && qkv.scalar_type() == dt,
              "paged_prefill: qkv must be a ", dt, " [T, >= ", q_heads * D, "] with a contiguous last dim, got ", qkv.sizes(),
              " strides ", qkv.strides(), " ", qkv.scalar_type());
  const int64_t T = qkv.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == q_heads * D && out.is_contiguous() && out.scalar_type() == dt,
              "paged_prefill: out must be a contiguous ", dt, " [", T, ", ", q_heads * D, "], got ", out.sizes(), " ", out.scalar_type());
  TORCH_CHECK(seqs.dim() <= 2 && seqs.numel() % 3 == 0 && seqs.numel() > 0 && seqs.scalar_type() == at::kLong && seqs.is_contiguous(),
              "paged_prefill: seqs must be a contiguous int64 [S, 3] (or [3 * S]) of (first row, new tokens, context), got ",
              seqs.sizes(), " ", seqs.scalar_type());
  const int64_t S = seqs.numel() / 3, W = tables.numel() / S;
  TORCH_CHECK(tables.dim() <= 2 && tables.numel() == S * W && W > 0 && tables.scalar_type() == at::kLong && tables.is_contiguous(),
              "paged_prefill: tables must be a contiguous int64 [", S, ", W] (or [", S, " * W]), got ", tables.sizes(), " ",
              tables.scalar_type());
  // The kernel trusts these with raw pointers, so check every row and block it will follow.
  const int64_t* sp = seqs.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  std::vector<Seq> list;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t base = sp[3 * s], n = sp[3 * s + 1], c = sp[3 * s + 2];
    TORCH_CHECK(base >= 0 && n >= 1 && base + n <= T && n <= c && c <= W * bs && c < (int64_t(1) << 31),
                "paged_prefill: sequence ", s, " (first row ", base, ", ", n, " new tokens, context ", c,
                ") does not lie in the ", T, " rows and its ", W, " blocks of ", bs);
    for (int64_t b = 0; b * bs < c; ++b)
      TORCH_CHECK(tp[s * W + b] >= 0 && tp[s * W + b] < nb, "paged_prefill: sequence ", s, " names block ", tp[s * W + b],
                  " of a pool of ", nb);
    list.push_back({base, n, c - n});
  }
  const float sc = static_cast<float>(scale);
  HeadDims::dispatch(D, [&](auto d) {
    if (dt == at::kFloat)
      paged_prefill<float, decltype(d)::value>(qkv, blocks, list, tables, q_heads, sc, out);
    else
      paged_prefill<at::BFloat16, decltype(d)::value>(qkv, blocks, list, tables, q_heads, sc, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minikv, m) {
  m.def("paged_prefill_(Tensor(a!) out, Tensor qkv, Tensor blocks, Tensor seqs, Tensor tables, float scale, int q_heads) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(minikv, CPU, m) { m.impl("paged_prefill_", &paged_prefill_); }
