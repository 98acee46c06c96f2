// The tiled causal attention of minikv's CPU prefill kernels, shared by the two entry points:
// prefill_attention.cpp (fresh prefills: keys are the step's own new rows) and paged_prefill.cpp
// (prefix hits and decodes: keys read in place from the pool through each block table).  Read
// prefill_attention.cpp's header first: it says why tiles, why GQA rows share a key block, and how
// the online softmax goes.
#pragma once
#include "cpu_vec.h"

#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace minikv_tiles {

using minikv_cpu::to_fp32;
using minikv_cpu::Vec;

constexpr int64_t V = Vec::size();       // floats per vector: 16 with AVX-512, 8 with AVX2
constexpr int64_t BK = 4 * V;            // keys per block: one row of scores is 4 vectors
constexpr int64_t RS = V == 16 ? 4 : 2;  // rows per micro-tile of scores (RS * 4 accumulators)
constexpr int64_t BQ = 32;               // query positions per task (times rep rows)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A loaded vector, kept in a register.  Without this GCC folds the load into every FMA that uses
// it (one memory operand per row of the micro-tile), and the loop runs at the CPU's load rate,
// not its FMA rate (16 loads per 16 FMAs); with the loads pinned it runs at the FMA rate.
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

// One sequence's queries: rows base .. base + n - 1 of the flat batch, at absolute positions
// off .. off + n - 1 (off = 0 for a fresh prefill; for a prefix hit or a decode, off is the number
// of keys already in the pool before this step's).  Query p sees keys 0 .. off + p.
struct Seq {
  int64_t base, n, off;
};

// The tiled causal attention both entry points run.  key_at(s, h, j) returns the pointers to key j
// and value j of KV head h of sequence s (the flat batch's rows, or the pool's slots through the
// block table), so the tiles never see where the keys live.  bq: query positions per task.
template <typename T, int64_t D, typename KeyAt>
void tiles(const T* qp, int64_t qs0, int64_t qs1, int64_t Hq, int64_t Hkv, const std::vector<Seq>& seqs,
           int64_t bq_max, float scale, T* op, KeyAt key_at) {
  static_assert(D % V == 0, "head_dim must be a whole number of vectors");
  const int64_t S = seqs.size(), rep = Hq / Hkv;
  const int64_t R = BQ * rep, Rpad = (R + 3) / 4 * 4;  // rows of a full tile; padded for the micro-tiles
  // Tasks: (sequence, KV head, tile of bq_max positions), most keys first so that the last tasks to
  // finish are short ones; dealt round-robin to the threads.
  std::vector<int64_t> tasks, cost;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t p0 = 0; p0 < seqs[s].n; p0 += bq_max)
      for (int64_t h = 0; h < Hkv; ++h) tasks.push_back((s * Hkv + h) << 32 | p0);
  auto keys_of = [&](int64_t t) { const Seq& q = seqs[(t >> 32) / Hkv]; return q.off + std::min(q.n, (t & 0xffffffff) + bq_max); };
  std::stable_sort(tasks.begin(), tasks.end(), [&](int64_t a, int64_t b) { return keys_of(a) > keys_of(b); });
  const int64_t n_tasks = tasks.size(), lanes = std::min<int64_t>(at::get_num_threads(), n_tasks);
  at::parallel_for(0, lanes, 1, [&](int64_t lane_begin, int64_t lane_end) {
    std::vector<float> qt(Rpad * D), kt(D * BK), vb(BK * D), sc(Rpad * BK), acc(Rpad * D), m(Rpad), l(Rpad);
    for (int64_t lane = lane_begin; lane < lane_end; ++lane)
    for (int64_t t = lane; t < n_tasks; t += lanes) {
      const int64_t sh = tasks[t] >> 32, p0 = tasks[t] & 0xffffffff, s = sh / Hkv, h = sh % Hkv;
      const int64_t base = seqs[s].base, off = seqs[s].off, bq = std::min(bq_max, seqs[s].n - p0), rows = bq * rep;
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
      const int64_t rows_pad = (rows + 3) / 4 * 4, last = off + p0 + bq;  // keys 0 .. last-1 are visible to someone
      for (int64_t k0 = 0; k0 < last; k0 += BK) {
        const int64_t keys = std::min(BK, last - k0);
        // 2. Pack the block: K transposed (zeros past `keys`), V as rows, both fp32.
        float row[D];
        for (int64_t j = 0; j < BK; ++j) {
          if (j < keys) {
            const auto [kj, vj] = key_at(s, h, k0 + j);
            to_fp32(kj, row, D);
            to_fp32(vj, vb.data() + j * D, D);
          }
          for (int64_t d = 0; d < D; ++d) kt[d * BK + j] = j < keys ? row[d] : 0.f;
        }
        // 3. Scores, then the causal mask and the online softmax, row by row.
        scores<D>(qt.data(), kt.data(), sc.data(), rows_pad);
        for (int64_t r = 0; r < rows_pad; ++r) {
          float* sr = sc.data() + r * BK;
          const int64_t visible = r < rows ? std::min(keys, off + p0 + r / rep + 1 - k0) : keys;
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

}  // namespace minikv_tiles
