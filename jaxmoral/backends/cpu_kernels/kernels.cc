// The CPU kernels of a decoding step, as XLA FFI handlers (see __init__.py).
//
// JaxmoralPackedMatmul: y[M, P*J] = x[M, K] @ W, with W stored as P contiguous column panels
// w[P, K, J] (J = 64). A decoding step multiplies a few rows by every weight matrix once: the
// product is bound by how fast the weights stream from memory. Row-major (K, N) weights are
// read as K strided pieces per column block: XLA:CPU's dot streamed T5 1.1-small's cold
// kernels at 9-17 GB/s at 8 rows on a 2-core Zen 4 VM, the same bytes read as contiguous
// panels up to 28 GB/s.
//
// JaxmoralDecodeAttention: out[r, h] = softmax_l(q[r, h] . k[s, h, l] + bias[s, h, l])
// v[s, h, l] with s = r / G, one query per (row, head). G = query rows / key rows: the G
// samples (or beams) of one input share its cross-attention keys and values. XLA:CPU ran a
// step's attention as batched dots of one row each, ~50-60 us per cross-attention dot at
// batch 8 (an XLA profile of the step).
//
// Both split their work over XLA's intra-op thread pool.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 64;    // J: columns per panel, four 16-float vectors.
// Rows per register block: 6 x 4 accumulators + 4 weights + 1 broadcast fit AVX-512's 32
// vector registers (blocks of 4 or 8 rows measured no faster).
constexpr int kMaxRows = 6;

// 16 floats; aligned(4) makes every load and store an unaligned one, so no alignment is assumed.
typedef float Vec __attribute__((vector_size(64), aligned(4)));

// y[r, 0:64] = sum_k x[r, k] * w[k, 0:64] for R rows.
template <int R>
void PanelRows(const float* x, int64_t ldx, const float* w, int64_t k_size, float* y,
               int64_t ldy) {
  Vec acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) acc[r][j] = Vec{};
  }
  for (int64_t k = 0; k < k_size; ++k) {
    const Vec* wk = reinterpret_cast<const Vec*>(w + k * kPanel);
    const Vec w0 = wk[0], w1 = wk[1], w2 = wk[2], w3 = wk[3];
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
      acc[r][0] += xv * w0;
      acc[r][1] += xv * w1;
      acc[r][2] += xv * w2;
      acc[r][3] += xv * w3;
    }
  }
  for (int r = 0; r < R; ++r) {
    Vec* out = reinterpret_cast<Vec*>(y + r * ldy);
    for (int j = 0; j < 4; ++j) out[j] = acc[r][j];
  }
}

using PanelFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t);
constexpr PanelFn kPanelRows[kMaxRows + 1] = {nullptr,      PanelRows<1>, PanelRows<2>,
                                              PanelRows<3>, PanelRows<4>, PanelRows<5>,
                                              PanelRows<6>};

// Panels [begin, end) of the product, every row.
void Panels(const float* x, const float* w, float* y, int64_t m_size, int64_t k_size,
            int64_t n_size, int64_t begin, int64_t end) {
  for (int64_t p = begin; p < end; ++p) {
    const float* panel = w + p * k_size * kPanel;
    for (int64_t m = 0; m < m_size; m += kMaxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m_size - m));
      kPanelRows[rows](x + m * k_size, k_size, panel, k_size, y + m * n_size + p * kPanel,
                       n_size);
    }
  }
}

// Work shared by the calling thread and helpers scheduled on XLA's pool. A helper that starts
// late finds no chunks left and returns without touching the buffers; the caller returns only
// once every claimed chunk is done, so the buffers outlive all work on them.
struct SharedWork {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Calls chunk(c) for c in [0, chunks), on the calling thread and on up to pool.num_threads()
// helpers.
template <typename Chunk>
void ParallelFor(ffi::ThreadPool& pool, int64_t chunks, Chunk chunk) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), chunks - 1);
  if (helpers <= 0) {
    for (int64_t c = 0; c < chunks; ++c) chunk(c);
    return;
  }
  auto work = std::make_shared<SharedWork>();
  auto run = [=]() {
    for (int64_t c; (c = work->next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      chunk(c);
      work->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(run)(run));
  run();
  while (work->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                        ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 3 || w_dims[2] != kPanel ||
      w_dims[1] != x_dims[1]) {
    return ffi::Error::InvalidArgument(
        "jaxmoral_packed_matmul: want x (M, K) and w (P, K, 64)");
  }
  const int64_t m_size = x_dims[0], k_size = x_dims[1], panels = w_dims[0];
  const int64_t n_size = panels * kPanel;
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();

  // Chunks of >= 32 KB of weights (one panel when K >= 128): small enough to balance the
  // threads, big enough that an atomic per chunk costs nothing.
  const int64_t grain = std::max<int64_t>(1, 8192 / (k_size * kPanel));
  ParallelFor(pool, (panels + grain - 1) / grain, [=](int64_t c) {
    Panels(xp, wp, yp, m_size, k_size, n_size, c * grain, std::min(panels, (c + 1) * grain));
  });
  return ffi::Error::Success();
}

float Dot(const float* a, const float* b, int64_t n) {
  Vec acc{};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc += *reinterpret_cast<const Vec*>(a + i) * *reinterpret_cast<const Vec*>(b + i);
  }
  float sum = 0.0f;
  for (int j = 0; j < 16; ++j) sum += acc[j];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// One (row, head): softmax over `keys` positions of q . k + bias, then the weighted values.
void AttendOne(const float* q, const float* k, const float* v, const float* bias, int64_t keys,
               int64_t depth, float* out, float* weights) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < keys; ++l) {
    weights[l] = Dot(q, k + l * depth, depth) + bias[l];
    top = std::max(top, weights[l]);
  }
  float total = 0.0f;
  for (int64_t l = 0; l < keys; ++l) {
    weights[l] = std::exp(weights[l] - top);
    total += weights[l];
  }
  for (int64_t d = 0; d < depth; ++d) out[d] = 0.0f;
  for (int64_t l = 0; l < keys; ++l) {
    const float p = weights[l] / total;
    const float* vl = v + l * depth;
    for (int64_t d = 0; d < depth; ++d) out[d] += p * vl[d];
  }
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                           ffi::Buffer<ffi::F32> bias, ffi::ResultBuffer<ffi::F32> out) {
  const auto q_dims = q.dimensions();
  const auto k_dims = k.dimensions();
  const auto v_dims = v.dimensions();
  const auto bias_dims = bias.dimensions();
  if (q_dims.size() != 3 || k_dims.size() != 4 || v_dims.size() != 4 ||
      bias_dims.size() != 3 || k_dims[0] == 0 || q_dims[0] % k_dims[0] != 0 ||
      k_dims[1] != q_dims[1] ||
      k_dims[3] != q_dims[2] || !std::equal(k_dims.begin(), k_dims.end(), v_dims.begin()) ||
      !std::equal(bias_dims.begin(), bias_dims.end(), k_dims.begin())) {
    return ffi::Error::InvalidArgument(
        "jaxmoral_decode_attention: want q (G*R, H, D), k and v (R, H, L, D), bias (R, H, L)");
  }
  const int64_t heads = q_dims[1], group = q_dims[0] / k_dims[0];
  const int64_t pairs = q_dims[0] * heads, keys = k_dims[2], depth = q_dims[2];
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const float* bp = bias.typed_data();
  float* op = out->typed_data();
  // >= 16 KB of keys and values per chunk.
  const int64_t grain = std::max<int64_t>(1, 2048 / std::max<int64_t>(1, keys * depth));
  ParallelFor(pool, (pairs + grain - 1) / grain, [=](int64_t c) {
    std::vector<float> weights(keys);
    for (int64_t i = c * grain; i < std::min(pairs, (c + 1) * grain); ++i) {
      const int64_t kv = (i / heads) / group * heads + i % heads;  // (key row, head)
      AttendOne(qp + i * depth, kp + kv * keys * depth, vp + kv * keys * depth, bp + kv * keys,
                keys, depth, op + i * depth, weights.data());
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmoralPackedMatmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmoralDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
