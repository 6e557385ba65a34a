// Paged attention on CPU: every query row attends its own sequence's context straight from the paged
// KV cache (no gather into contiguous buffers, no mask tensor), as vLLM's CPU attention does.
// Built at first use by shiftlm/model/cpu_kernels.py (torch.utils.cpp_extension); see docs/serving.md.
// Also: RMSNorm and SwiGLU's silu(gate) * up for the no-grad forward (fp32/bf16, contiguous rows).
//
//   q       [N, Hq, D]        query rows of the step (RoPE applied)
//   k, v    [slots, Hkv, D]   one layer's cache; slot = block * block_size + offset
//   tables  [S, B] int64      physical blocks of each sequence of the group
//   rows    [S, Q] int64      row of q for query j of sequence s (-1: padding, skipped)
//   pos     [S, Q] int64      its position: it reads keys [max(0, pos + 1 - window), pos]
//   out     [N, Hq, D]        written at the rows named (others untouched)
// Query heads h * G .. h * G + G - 1 read KV head h (G = Hq / Hkv). Scores, softmax and the weighted
// sum run in fp32 one block of keys at a time with a running max (the online softmax).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr float kLowest = -1e30f;
std::atomic<uint64_t> g_touched{0};  // written by touch_blocks, read by nobody

// One block of the online softmax: the block's n scores become exp(score - new max) in place, and the
// running max m and sum l absorb them; returns the factor the row's accumulator is rescaled by (0 on
// the first block, where m is still kLowest).
inline float softmax_block(float* scores, int64_t n, float& m, float& l) {
  float best = m;
  for (int64_t j = 0; j < n; ++j) best = std::max(best, scores[j]);
  const float rescale = std::exp(m - best);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = std::exp(scores[j] - best);
    sum += scores[j];
  }
  m = best;
  l = l * rescale + sum;
  return rescale;
}

template <typename T, int64_t kDim>
void attend(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* rows,
            const int64_t* pos, T* out, int64_t S, int64_t Q, int64_t B, int64_t Hq, int64_t Hkv,
            int64_t dim, int64_t block_size, int64_t window, float scale) {
  const int64_t D = kDim > 0 ? kDim : dim;  // a compile-time head size unrolls the inner loops
  const int64_t G = Hq / Hkv;
  at::parallel_for(0, S * Q * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), score(G * block_size), m(G), l(G);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % Hkv, sq = item / Hkv, s = sq / Q;
      const int64_t row = rows[sq];
      if (row < 0) continue;
      const int64_t last = pos[sq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, last + 1 - window) : 0;
      for (int64_t g = 0; g < G; ++g) {
        const T* qr = q + (row * Hq + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(qr[d]) * scale;
        m[g] = kLowest;  // finite: the file is built with -ffast-math (no infinities)
        l[g] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t* table = tables + s * B;
      for (int64_t start = first - first % block_size; start <= last; start += block_size) {
        const int64_t lo = std::max(start, first), hi = std::min(start + block_size - 1, last);
        const int64_t n = hi - lo + 1, base = table[start / block_size] * block_size + (lo - start);
        for (int64_t j = 0; j < n; ++j) {  // each key row read once for the G query heads
          const T* kr = k + ((base + j) * Hkv + h) * D;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * static_cast<float>(kr[d]);
            score[g * block_size + j] = dot;
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          const float rescale = softmax_block(score.data() + g * block_size, n, m[g], l[g]);
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] *= rescale;
        }
        for (int64_t j = 0; j < n; ++j) {  // each value row read once for the G query heads
          const T* vr = v + ((base + j) * Hkv + h) * D;
          for (int64_t g = 0; g < G; ++g) {
            const float w = score[g * block_size + j];
            float* ag = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += w * static_cast<float>(vr[d]);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* o = out + (row * Hq + h * G + g) * D;
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[g * D + d] * inv);
      }
    }
  });
}


// Read one word of every cache line of the K and V rows of the blocks from `start` on (at most
// `keys` keys, ending at `last`); returns the first key not touched. Independent loads, one per line,
// bring the rows in at about the memory's streaming rate, which the attention's own loads, spread
// between dependent arithmetic, did not reach (about 8 vs 30 GB/s on this host's scattered 8 KiB
// blocks, an ad hoc measurement); the arithmetic then reads them from L2.
template <typename T>
int64_t touch_blocks(const T* k, const T* v, const int64_t* table, int64_t start, int64_t first,
                     int64_t last, int64_t block_size, int64_t row_len, int64_t keys) {
  uint64_t x0 = 0, x1 = 0;
  const int64_t end = std::min(last + 1, start + keys);
  for (; start < end; start += block_size) {
    const int64_t lo = std::max(start, first), hi = std::min(start + block_size - 1, last);
    const int64_t base = table[start / block_size] * block_size + (lo - start);
    const char* kp = reinterpret_cast<const char*>(k + base * row_len);
    const char* vp = reinterpret_cast<const char*>(v + base * row_len);
    const int64_t bytes = (hi - lo + 1) * row_len * static_cast<int64_t>(sizeof(T));
    for (int64_t offset = 0; offset < bytes; offset += 64) {
      uint64_t word_k, word_v;
      std::memcpy(&word_k, kp + offset, sizeof(word_k));
      std::memcpy(&word_v, vp + offset, sizeof(word_v));
      x0 ^= word_k;
      x1 ^= word_v;
    }
  }
  g_touched.fetch_xor(x0 ^ x1, std::memory_order_relaxed);  // a side effect: the loads stay
  return start;
}

// The same decode rows one sequence at a time, for a compile-time head size: each key and value row is
// read once for all heads (the rows of a block are contiguous across heads), and per query head the
// scores of a block are independent dot products and its values are summed in registers (two chains),
// and the rows are touched first (`touch_blocks`). The cache is cold when a layer reads it (a step's
// GEMM weights stream through L3 between two reads); `python bench/serve_kernels.py --stages 7` times
// one layer hot and cold (docs/serving.md, "Decode attention that streams its rows"). Parallel over
// sequences: `attend` splits by KV head too and stays for fewer sequences than threads.
template <typename T, int64_t kDim>
void attend_rows(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* rows,
                 const int64_t* pos, T* out, int64_t S, int64_t Q, int64_t B, int64_t Hq, int64_t Hkv,
                 int64_t dim, int64_t block_size, int64_t window, float scale) {
  static_assert(kDim > 0, "attend_rows needs a compile-time head size");
  const int64_t G = Hq / Hkv, row_len = Hkv * kDim;
  // keys touched at a time: their K and V rows, at most 512 KiB, stay in L2 until the arithmetic
  const int64_t touch_keys = std::max<int64_t>(
      block_size, (512 * 1024) / (2 * row_len * static_cast<int64_t>(sizeof(T))) / block_size * block_size);
  at::parallel_for(0, S * Q, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(Hq * kDim), acc(Hq * kDim), score(Hq * block_size), m(Hq), l(Hq);
    for (int64_t sq = begin; sq < end; ++sq) {
      const int64_t s = sq / Q, row = rows[sq];
      if (row < 0) continue;
      const int64_t last = pos[sq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, last + 1 - window) : 0;
      for (int64_t hq = 0; hq < Hq; ++hq) {
        const T* qr = q + (row * Hq + hq) * kDim;
        for (int64_t d = 0; d < kDim; ++d) qf[hq * kDim + d] = static_cast<float>(qr[d]) * scale;
        m[hq] = kLowest;  // finite: the file is built with -ffast-math (no infinities)
        l[hq] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t* table = tables + s * B;
      int64_t touched_to = 0;  // keys before this one have been touched
      for (int64_t start = first - first % block_size; start <= last; start += block_size) {
        const int64_t lo = std::max(start, first), hi = std::min(start + block_size - 1, last);
        const int64_t n = hi - lo + 1, base = table[start / block_size] * block_size + (lo - start);
        if (start >= touched_to) {
          touched_to = touch_blocks(k, v, table, start, first, last, block_size, row_len, touch_keys);
        }
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const int64_t h = hq / G;
          const float* __restrict__ qh = qf.data() + hq * kDim;
          float* __restrict__ sh = score.data() + hq * block_size;
          for (int64_t j = 0; j < n; ++j) {
            const T* __restrict__ kr = k + (base + j) * row_len + h * kDim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < kDim; ++d) dot += qh[d] * static_cast<float>(kr[d]);
            sh[j] = dot;
          }
          const float rescale = softmax_block(sh, n, m[hq], l[hq]);
          float* __restrict__ ah = acc.data() + hq * kDim;
          float a0[kDim], a1[kDim];  // even and odd keys: two chains of sums
#pragma omp simd
          for (int64_t d = 0; d < kDim; ++d) {
            a0[d] = ah[d] * rescale;
            a1[d] = 0.f;
          }
          int64_t j = 0;
          for (; j + 1 < n; j += 2) {
            const float w0 = sh[j], w1 = sh[j + 1];
            const T* __restrict__ v0 = v + (base + j) * row_len + h * kDim;
            const T* __restrict__ v1 = v0 + row_len;
#pragma omp simd
            for (int64_t d = 0; d < kDim; ++d) {
              a0[d] += w0 * static_cast<float>(v0[d]);
              a1[d] += w1 * static_cast<float>(v1[d]);
            }
          }
          if (j < n) {
            const float w0 = sh[j];
            const T* __restrict__ v0 = v + (base + j) * row_len + h * kDim;
#pragma omp simd
            for (int64_t d = 0; d < kDim; ++d) a0[d] += w0 * static_cast<float>(v0[d]);
          }
#pragma omp simd
          for (int64_t d = 0; d < kDim; ++d) ah[d] = a0[d] + a1[d];
        }
      }
      for (int64_t hq = 0; hq < Hq; ++hq) {
        T* o = out + (row * Hq + hq) * kDim;
        const float inv = 1.f / l[hq];
        for (int64_t d = 0; d < kDim; ++d) o[d] = static_cast<T>(acc[hq * kDim + d] * inv);
      }
    }
  });
}


// The rows of a prefill chunk (several queries of one sequence): query rows in tiles of kTile, each
// key block read once per tile and transposed, so a query's scores over the block are one vector
// (no horizontal sums), and each value row is added to every query of the tile from L1. Same online
// softmax and masking (position, window) as `attend`.
constexpr int64_t kTile = 16;

template <typename T, int64_t kDim>
void attend_tiled(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* rows,
                  const int64_t* pos, T* out, int64_t S, int64_t Q, int64_t B, int64_t Hq, int64_t Hkv,
                  int64_t dim, int64_t block_size, int64_t window, float scale) {
  const int64_t D = kDim > 0 ? kDim : dim;
  const int64_t G = Hq / Hkv, bs = block_size;
  const int64_t tiles = (Q + kTile - 1) / kTile;
  at::parallel_for(0, S * Hkv * tiles, 1, [&](int64_t begin, int64_t end) {
    const int64_t vecs_max = kTile * G;
    std::vector<float> qf(vecs_max * D), acc(vecs_max * D), kt(D * bs), sc(bs), m(vecs_max), l(vecs_max);
    std::vector<int64_t> vrow(vecs_max), vpos(vecs_max), vfirst(vecs_max);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t tile = item % tiles, h = (item / tiles) % Hkv, s = item / (tiles * Hkv);
      int64_t n_vec = 0, lo = std::numeric_limits<int64_t>::max(), hi = -1;
      for (int64_t j = tile * kTile; j < std::min(Q, (tile + 1) * kTile); ++j) {
        const int64_t row = rows[s * Q + j];
        if (row < 0) continue;
        const int64_t p = pos[s * Q + j];
        const int64_t f = window > 0 ? std::max<int64_t>(0, p + 1 - window) : 0;
        lo = std::min(lo, f);
        hi = std::max(hi, p);
        for (int64_t g = 0; g < G; ++g, ++n_vec) {
          const T* qr = q + (row * Hq + h * G + g) * D;
          for (int64_t d = 0; d < D; ++d) qf[n_vec * D + d] = static_cast<float>(qr[d]) * scale;
          vrow[n_vec] = row * Hq + h * G + g;
          vpos[n_vec] = p;
          vfirst[n_vec] = f;
          m[n_vec] = kLowest;
          l[n_vec] = 0.f;
        }
      }
      if (n_vec == 0) continue;
      std::fill(acc.begin(), acc.begin() + n_vec * D, 0.f);
      const int64_t* table = tables + s * B;
      for (int64_t start = lo - lo % bs; start <= hi; start += bs) {
        const int64_t n = std::min(bs, hi - start + 1);
        const int64_t base = table[start / bs] * bs;
        for (int64_t j = 0; j < bs; ++j) {  // K block transposed: kt[d][j]
          if (j < n) {
            const T* kr = k + ((base + j) * Hkv + h) * D;
            for (int64_t d = 0; d < D; ++d) kt[d * bs + j] = static_cast<float>(kr[d]);
          } else {
            for (int64_t d = 0; d < D; ++d) kt[d * bs + j] = 0.f;
          }
        }
        for (int64_t i = 0; i < n_vec; ++i) {
          const int64_t p = vpos[i], f = vfirst[i];
          if (start > p || start + n - 1 < f) continue;  // no key of this block for this query
          float* __restrict__ sg = sc.data();
          const float* __restrict__ qi = qf.data() + i * D;
          const float* __restrict__ ktp = kt.data();
          if (bs == 16 && D % 4 == 0) {  // four independent sums (an FMA's latency, not its rate, bounds one)
            float s0[16] = {0.f}, s1[16] = {0.f}, s2[16] = {0.f}, s3[16] = {0.f};
            for (int64_t d = 0; d < D; d += 4) {
              const float q0 = qi[d], q1 = qi[d + 1], q2 = qi[d + 2], q3 = qi[d + 3];
              const float* kd = ktp + d * 16;
#pragma omp simd
              for (int64_t j = 0; j < 16; ++j) {
                s0[j] += q0 * kd[j];
                s1[j] += q1 * kd[16 + j];
                s2[j] += q2 * kd[32 + j];
                s3[j] += q3 * kd[48 + j];
              }
            }
#pragma omp simd
            for (int64_t j = 0; j < 16; ++j) sg[j] = (s0[j] + s1[j]) + (s2[j] + s3[j]);
          } else {
            std::fill(sg, sg + bs, 0.f);
            for (int64_t d = 0; d < D; ++d) {
              const float qd = qi[d];
#pragma omp simd
              for (int64_t j = 0; j < bs; ++j) sg[j] += qd * ktp[d * bs + j];
            }
          }
          const int64_t j_lo = std::max<int64_t>(0, f - start), j_hi = std::min(n - 1, p - start);
          float best = m[i];
#pragma omp simd reduction(max : best)
          for (int64_t j = 0; j < bs; ++j) {
            sg[j] = (j >= j_lo && j <= j_hi) ? sg[j] : kLowest;
            best = std::max(best, sg[j]);
          }
          const float rescale = std::exp(m[i] - best);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < bs; ++j) {
            sg[j] = std::exp(sg[j] - best);
            sum += sg[j];
          }
          float* __restrict__ ai = acc.data() + i * D;
          m[i] = best;
          l[i] = l[i] * rescale + sum;
          if constexpr (kDim > 0) {  // the row's accumulator in registers over the block's keys
            float a[kDim];
#pragma omp simd
            for (int64_t d = 0; d < kDim; ++d) a[d] = ai[d] * rescale;
            float b[kDim] = {0.f};  // odd keys: a second chain of sums
            int64_t j = j_lo;
            for (; j + 1 <= j_hi; j += 2) {
              const float w0 = sg[j], w1 = sg[j + 1];
              const T* __restrict__ v0 = v + ((base + j) * Hkv + h) * kDim;
              const T* __restrict__ v1 = v + ((base + j + 1) * Hkv + h) * kDim;
#pragma omp simd
              for (int64_t d = 0; d < kDim; ++d) {
                a[d] += w0 * static_cast<float>(v0[d]);
                b[d] += w1 * static_cast<float>(v1[d]);
              }
            }
            if (j == j_hi) {
              const float w0 = sg[j];
              const T* __restrict__ v0 = v + ((base + j) * Hkv + h) * kDim;
#pragma omp simd
              for (int64_t d = 0; d < kDim; ++d) a[d] += w0 * static_cast<float>(v0[d]);
            }
#pragma omp simd
            for (int64_t d = 0; d < kDim; ++d) ai[d] = a[d] + b[d];
          } else {
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ai[d] *= rescale;
            for (int64_t j = j_lo; j <= j_hi; ++j) {
              const float w = sg[j];
              const T* vr = v + ((base + j) * Hkv + h) * D;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) ai[d] += w * static_cast<float>(vr[d]);
            }
          }
        }
      }
      for (int64_t i = 0; i < n_vec; ++i) {
        T* o = out + vrow[i] * D;
        const float inv = 1.f / l[i];
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[i * D + d] * inv);
      }
    }
  });
}

}  // namespace

void paged_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const torch::Tensor& tables, const torch::Tensor& rows, const torch::Tensor& pos,
                     torch::Tensor& out, int64_t block_size, int64_t window) {
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && out.is_contiguous(),
              "paged_attention: q, k, v and out must be contiguous");
  TORCH_CHECK(tables.is_contiguous() && rows.is_contiguous() && pos.is_contiguous(),
              "paged_attention: tables, rows and pos must be contiguous");
  TORCH_CHECK(tables.scalar_type() == at::kLong && rows.scalar_type() == at::kLong &&
                  pos.scalar_type() == at::kLong, "paged_attention: tables, rows, pos must be int64");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type() &&
                  out.scalar_type() == q.scalar_type(), "paged_attention: q, k, v, out dtypes differ");
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k.size(1);
  TORCH_CHECK(Hq % Hkv == 0 && k.size(2) == D, "paged_attention: head shapes do not match");
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
             tables.data_ptr<int64_t>(), rows.data_ptr<int64_t>(), pos.data_ptr<int64_t>(),
             out.data_ptr<scalar_t>(), rows.size(0), rows.size(1), tables.size(1), Hq, Hkv, D,
             block_size, window, scale);
    };
    if (rows.size(1) > 1) {  // prefill chunks: tiles of query rows
      if (D == 64) run(attend_tiled<scalar_t, 64>);
      else if (D == 128) run(attend_tiled<scalar_t, 128>);
      else run(attend_tiled<scalar_t, 0>);
    } else if (rows.size(0) < at::get_num_threads()) {  // few sequences: split by KV head too
      if (D == 64) run(attend<scalar_t, 64>);
      else if (D == 128) run(attend<scalar_t, 128>);
      else run(attend<scalar_t, 0>);
    } else if (D == 64) run(attend_rows<scalar_t, 64>);
    else if (D == 128) run(attend_rows<scalar_t, 128>);
    else run(attend<scalar_t, 0>);
  });
}

namespace {

template <typename T>
void rms_rows(const T* x, const T* w, T* out, int64_t rows, int64_t H, float eps) {
  for (int64_t n = 0; n < rows; ++n) {
    const T* r = x + n * H;
    T* o = out + n * H;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < H; ++i) ss += static_cast<float>(r[i]) * static_cast<float>(r[i]);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) o[i] = static_cast<T>(static_cast<float>(r[i]) * inv * static_cast<float>(w[i]));
  }
}

template <typename T>
void silu_mul_rows(const T* gu, T* out, int64_t rows, int64_t F) {
  for (int64_t n = 0; n < rows; ++n) {
    const T* g = gu + n * 2 * F;
    const T* u = g + F;
    T* o = out + n * F;
#pragma omp simd
    for (int64_t i = 0; i < F; ++i) {
      const float a = static_cast<float>(g[i]);
      // -ffast-math assumes no infinities: exp's argument is kept below overflow (silu(-88) is -0 anyway)
      o[i] = static_cast<T>(a / (1.f + std::exp(std::min(-a, 80.f))) * static_cast<float>(u[i]));
    }
  }
}

}  // namespace

// x [..., H] contiguous, weight [H] -> x / sqrt(mean(x^2) + eps) * weight (fp32 accumulation)
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.scalar_type() == x.scalar_type() &&
                  weight.numel() == x.size(-1), "rms_norm: contiguous x [..., H] and weight [H] of its dtype");
  auto out = torch::empty_like(x);
  const int64_t H = x.size(-1), rows = H ? x.numel() / H : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, H,
                       static_cast<float>(eps));
  });
  return out;
}

// gate|up [..., 2F] contiguous (one GEMM's output) -> silu(gate) * up [..., F]
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0, "silu_mul: contiguous [..., 2F]");
  const int64_t F = gate_up.size(-1) / 2, rows = F ? gate_up.numel() / (2 * F) : 0;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = F;
  auto out = torch::empty(sizes, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, F);
  });
  return out;
}

namespace {

template <typename T>
void rope_rows(const T* xp, const T* cp, const T* sp, T* op, int64_t rows, int64_t H, int64_t D, int64_t row) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < rows; ++t) {
    const T* c = cp + t * D;
    const T* s = sp + t * D;
    for (int64_t h = 0; h < H; ++h) {
      const T* xi = xp + t * row + h * D;
      T* o = op + (t * H + h) * D;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = static_cast<float>(xi[i]) * static_cast<float>(c[i]);
        const float b = -static_cast<float>(xi[i + half]) * static_cast<float>(s[i]);
        o[i] = static_cast<T>(a + b);
      }
#pragma omp simd
      for (int64_t i = half; i < D; ++i) {
        const float a = static_cast<float>(xi[i]) * static_cast<float>(c[i]);
        const float b = static_cast<float>(xi[i - half]) * static_cast<float>(s[i]);
        o[i] = static_cast<T>(a + b);
      }
    }
  }
}

}  // namespace

// Rotary embedding of x [T, H, D] (rows of stride x.stride(0), heads contiguous): out [T, H, D] =
// x * cos + rotate_half(x) * sin, cos/sin [T, D] contiguous (model/rope.py's apply_rope, one pass
// instead of eager's slices, negation, concatenation, two products and a sum; bench/serve_kernels.py).
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rope: x [T, H, D], heads contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == x.size(0) &&
                  cos.size(1) == x.size(2) && sin.sizes() == cos.sizes(), "rope: cos/sin [T, D] contiguous");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "rope: dtypes differ");
  TORCH_CHECK(x.size(2) % 2 == 0, "rope: odd head size");
  auto out = torch::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope", [&] {
    rope_rows<scalar_t>(x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                        out.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2), x.stride(0));
  });
  return out;
}

void register_shm(pybind11::module& m);  // shm_exchange.cpp: collectives through shared memory

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released while a kernel runs (as PyTorch's own ops do): the server's HTTP thread can
  // run Python beside it
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("paged_attention", &paged_attention, "attention of query rows over their paged context (CPU)",
        release());
  m.def("rms_norm", &rms_norm, "RMSNorm of contiguous rows (CPU)", release());
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a contiguous gate|up (CPU)", release());
  m.def("rope", &rope, "rotary embedding x * cos + rotate_half(x) * sin of [T, H, D] rows (CPU)", release());
  register_shm(m);
}
