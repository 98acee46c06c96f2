// minikv's causal prefill attention for the CPU: every fresh prefill of a step in one call.
//
// Why a kernel: a fresh prefill attends over its own new keys, causally.  SDPA's CPU flash kernel
// does that one sequence at a time (one call per sequence per layer) at 40-63 GFLOP/s of useful
// work on the 2-core CPU, fp32, from run to run, where the layers' matmuls reach 140-170: attention
// was 4.5% of the benchmark prefill's FLOPs and 16% of its time (torch.profiler, SmolLM2, 16 prompts of
// 32-512 tokens).  Two things it leaves on the table, both taken here:
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
#include "cpu_vec.h"

#include <cmath>
#include <limits>
#include <vector>

namespace {

using minikv_cpu::HeadDims;
using minikv_cpu::to_fp32;
using minikv_cpu::Vec;

constexpr int64_t V = Vec::size();       // floats per vector: 16 with AVX-512, 8 with AVX2
constexpr int64_t BK = 4 * V;            // keys per block: one row of scores is 4 vectors
constexpr int64_t RS = V == 16 ? 4 : 2;  // rows per micro-tile of scores (RS * 4 accumulators)
constexpr int64_t BQ = 32;               // query positions per task (times rep rows)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A loaded vector, kept in a register.  Without this GCC folds the load into every FMA that uses
// it (one memory operand per row of the micro-tile), and the loop runs at the CPU's load rate,
// not its FMA rate: on the 2-core AMD EPYC, with 16 zmm loads per 16 FMAs this kernel ran one
// 512-token sequence in fp32 at 73 GFLOP/s on both cores; with the loads pinned, at 107.
inline Vec pinned(const float* p) {
  Vec x = Vec::loadu(p);
#if defined(CPU_CAPABILITY_AVX512)
  __m512 raw = x;
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 raw = x;
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  asm("" : "+v"(raw));  // an empty asm that "changes" the register: the compiler cannot re-load it
  x = Vec(raw);
#endif
  return x;
}

// S[r][0..BK) = Q[r] . K^T for RS rows at a time: kt is the key block transposed ([D][BK]), so
// each step of d broadcasts one query value and multiplies it into 4 vectors of keys.
template <int64_t D>
inline void scores(const float* q, const float* kt, float* s, int64_t rows) {
  for (int64_t r0 = 0; r0 < rows; r0 += RS) {
    Vec acc[RS][4];
    for (int64_t i = 0; i < RS; ++i)
      for (int64_t c = 0; c < 4; ++c) acc[i][c] = Vec(0.f);
    for (int64_t d = 0; d < D; ++d) {
      Vec kd[4];
      for (int64_t c = 0; c < 4; ++c) kd[c] = pinned(kt + d * BK + c * V);
      for (int64_t i = 0; i < RS; ++i) {
        const Vec b(q[(r0 + i) * D + d]);
        for (int64_t c = 0; c < 4; ++c) acc[i][c] = at::vec::fmadd(b, kd[c], acc[i][c]);
      }
    }
    for (int64_t i = 0; i < RS; ++i)
      for (int64_t c = 0; c < 4; ++c) acc[i][c].store(s + (r0 + i) * BK + c * V);
  }
}

// O[r] += P[r] . V_block for RP rows at a time (RP * D / V accumulators stay in registers).
template <int64_t D>
inline void accumulate(const float* p, const float* vb, float* o, int64_t rows, int64_t keys) {
  constexpr int64_t NV = D / V, RP = NV <= 4 ? 4 : (NV <= 8 ? 2 : 1);
  for (int64_t r0 = 0; r0 < rows; r0 += RP) {
    Vec acc[RP][NV];
    for (int64_t i = 0; i < RP; ++i)
      for (int64_t c = 0; c < NV; ++c) acc[i][c] = Vec::loadu(o + (r0 + i) * D + c * V);
    for (int64_t j = 0; j < keys; ++j) {
      Vec vj[NV];
      for (int64_t c = 0; c < NV; ++c) vj[c] = pinned(vb + j * D + c * V);
      for (int64_t i = 0; i < RP; ++i) {
        const Vec b(p[(r0 + i) * BK + j]);
        for (int64_t c = 0; c < NV; ++c) acc[i][c] = at::vec::fmadd(b, vj[c], acc[i][c]);
      }
    }
    for (int64_t i = 0; i < RP; ++i)
      for (int64_t c = 0; c < NV; ++c) acc[i][c].store(o + (r0 + i) * D + c * V);
  }
}

template <typename T, int64_t D>
void prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seqs,
             float scale, at::Tensor& out) {
  static_assert(D % V == 0, "head_dim must be a whole number of vectors");
  const int64_t S = seqs.size(0), Hq = q.size(1), Hkv = k.size(1), rep = Hq / Hkv;
  const int64_t R = BQ * rep, Rpad = (R + 3) / 4 * 4;  // rows of a full tile; padded for the micro-tiles
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1);
  const int64_t* sp = seqs.data_ptr<int64_t>();  // sequence s: rows sp[2s] .. sp[2s] + sp[2s+1] - 1
  T* op = out.data_ptr<T>();
  // Tasks: (sequence, KV head, tile of BQ positions), longest first so that the last tasks to
  // finish are short ones; dealt round-robin to the threads.
  std::vector<int64_t> tasks;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t p0 = 0; p0 < sp[2 * s + 1]; p0 += BQ)
      for (int64_t h = 0; h < Hkv; ++h) tasks.push_back((s * Hkv + h) << 32 | p0);
  std::stable_sort(tasks.begin(), tasks.end(), [](int64_t a, int64_t b) { return (a & 0xffffffff) > (b & 0xffffffff); });
  const int64_t n_tasks = tasks.size(), lanes = std::min<int64_t>(at::get_num_threads(), n_tasks);
  at::parallel_for(0, lanes, 1, [&](int64_t lane_begin, int64_t lane_end) {
    std::vector<float> qt(Rpad * D), kt(D * BK), vb(BK * D), sc(Rpad * BK), acc(Rpad * D), m(Rpad), l(Rpad);
    for (int64_t lane = lane_begin; lane < lane_end; ++lane)
    for (int64_t t = lane; t < n_tasks; t += lanes) {
      const int64_t sh = tasks[t] >> 32, p0 = tasks[t] & 0xffffffff, s = sh / Hkv, h = sh % Hkv;
      const int64_t base = sp[2 * s], n = sp[2 * s + 1], bq = std::min(BQ, n - p0), rows = bq * rep;
      // 1. The tile's queries, row r = (position p0 + r / rep, head h * rep + r % rep), scaled once;
      //    pad rows are zero (their results are computed and dropped).
      std::fill(qt.begin() + rows * D, qt.end(), 0.f);
      for (int64_t r = 0; r < rows; ++r) {
        to_fp32(qp + (base + p0 + r / rep) * qs0 + (h * rep + r % rep) * qs1, qt.data() + r * D, D);
        for (int64_t d = 0; d < D; ++d) qt[r * D + d] *= scale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), kNegInf);
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t rows_pad = (rows + 3) / 4 * 4, last = p0 + bq;  // keys 0 .. last-1 are visible to someone
      for (int64_t k0 = 0; k0 < last; k0 += BK) {
        const int64_t keys = std::min(BK, last - k0);
        // 2. Pack the block: K transposed (zeros past `keys`), V as rows, both fp32.
        float row[D];
        for (int64_t j = 0; j < BK; ++j) {
          if (j < keys) to_fp32(kp + (base + k0 + j) * ks0 + h * ks1, row, D);
          for (int64_t d = 0; d < D; ++d) kt[d * BK + j] = j < keys ? row[d] : 0.f;
        }
        for (int64_t j = 0; j < keys; ++j) to_fp32(vp + (base + k0 + j) * vs0 + h * vs1, vb.data() + j * D, D);
        // 3. Scores, then the causal mask and the online softmax, row by row.
        scores<D>(qt.data(), kt.data(), sc.data(), rows_pad);
        for (int64_t r = 0; r < rows_pad; ++r) {
          float* sr = sc.data() + r * BK;
          const int64_t visible = r < rows ? std::min(keys, p0 + r / rep + 1 - k0) : keys;
          if (visible <= 0) {  // the whole block is in this row's future
            std::fill(sr, sr + BK, 0.f);
            continue;
          }
          if (visible < BK) std::fill(sr + visible, sr + BK, kNegInf);  // exp(-inf) = 0: masked keys weigh nothing
          Vec top = at::vec::maximum(at::vec::maximum(Vec::loadu(sr), Vec::loadu(sr + V)),
                                     at::vec::maximum(Vec::loadu(sr + 2 * V), Vec::loadu(sr + 3 * V)));
          const float mx = std::max(m[r], top.reduce_max());
          Vec sum(0.f);
          for (int64_t c = 0; c < 4; ++c) {
            const Vec e = (Vec::loadu(sr + c * V) - Vec(mx)).exp();
            e.store(sr + c * V);
            sum = sum + e;
          }
          const float corr = std::exp(m[r] - mx);  // 0 on a row's first block (m = -inf)
          l[r] = l[r] * corr + sum.reduce_add();
          m[r] = mx;
          if (corr != 1.f)
            for (int64_t c = 0; c < D / V; ++c) (Vec::loadu(acc.data() + r * D + c * V) * Vec(corr)).store(acc.data() + r * D + c * V);
        }
        // 4. O += P V over the block's keys.
        accumulate<D>(sc.data(), vb.data(), acc.data(), rows_pad, keys);
      }
      // 5. Normalize and write each row to its place in the flat output.
      for (int64_t r = 0; r < rows; ++r) {
        T* o = op + (base + p0 + r / rep) * Hq * D + (h * rep + r % rep) * D;
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[r * D + d] * inv);
      }
    }
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
