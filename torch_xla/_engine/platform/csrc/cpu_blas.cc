// float32 matrix products of XLA:CPU programs computed by the BLAS that PyTorch's CPU
// kernels call (an XLA FFI handler; platform/cpu_blas.py registers it and gives it the
// BLAS entry points).
//
// One call computes C = op(A) op(B) for row-major operands, batched over the leading
// dimensions when there are any: op(X) is X or its transpose (`trans_a`, `trans_b`), so
// a product of a transposed view reads the view's source as it is. The work is split into
// chunks (batch items, or row or column blocks of a single product) that the calling thread and the
// program's intra-op threads take in turn, each computing its chunks with a single-threaded
// BLAS call: a chunk's result does not depend on which thread computes it, so results
// are the same from run to run.

#include <Python.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Fortran-convention sgemm (column-major) and the per-thread BLAS thread count setter.
using SgemmFn = void (*)(const char*, const char*, const int*, const int*, const int*,
                         const float*, const float*, const int*, const float*, const int*,
                         const float*, float*, const int*);
using SetThreadsFn = int (*)(int);

SgemmFn g_sgemm = nullptr;
SetThreadsFn g_set_threads_local = nullptr;

// Chunks smaller than this many multiply-adds are not worth a thread hand-off.
constexpr int64_t kMinChunkWork = int64_t{1} << 18;

struct Product {
  const float* a;
  const float* b;
  float* c;
  int64_t batch, m, n, k;
  bool ta, tb;
  // A single product is cut along the larger of C's dimensions (each piece packs all of
  // the other operand, so few pieces); a batched one into runs of whole products.
  int64_t rows_per_chunk;  // single product cut along its rows: rows of C per chunk, else 0
  int64_t cols_per_chunk;  // single product cut along its columns: columns of C per chunk, else 0
  int64_t items_per_chunk;  // batched: batch items per chunk
  int64_t chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;

  // The block C[r0..r1, c0..c1) of batch item i: row-major C = op(A) op(B) is
  // column-major C^T = op(B)^T op(A)^T.
  void Block(int64_t i, int64_t r0, int64_t r1, int64_t c0, int64_t c1) const {
    const char opa = ta ? 'T' : 'N', opb = tb ? 'T' : 'N';
    const int rows = static_cast<int>(r1 - r0), cols = static_cast<int>(c1 - c0), K = static_cast<int>(k);
    const int lda = static_cast<int>(ta ? m : k), ldb = static_cast<int>(tb ? k : n), ldc = static_cast<int>(n);
    const float one = 1.f, zero = 0.f;
    const float* ai = a + i * m * k + (ta ? r0 : r0 * k);
    const float* bi = b + i * k * n + (tb ? c0 * k : c0);
    float* ci = c + i * m * n + r0 * n + c0;
    g_sgemm(&opb, &opa, &cols, &rows, &K, &one, bi, &ldb, ai, &lda, &zero, ci, &ldc);
  }

  void Work() {
    if (g_set_threads_local) g_set_threads_local(1);
    for (;;) {
      const int64_t ch = next.fetch_add(1);
      if (ch >= chunks) break;
      if (rows_per_chunk) {
        const int64_t lo = ch * rows_per_chunk;
        Block(0, lo, lo + rows_per_chunk < m ? lo + rows_per_chunk : m, 0, n);
      } else if (cols_per_chunk) {
        const int64_t lo = ch * cols_per_chunk;
        Block(0, 0, m, lo, lo + cols_per_chunk < n ? lo + cols_per_chunk : n);
      } else {
        const int64_t lo = ch * items_per_chunk;
        const int64_t hi = lo + items_per_chunk < batch ? lo + items_per_chunk : batch;
        for (int64_t i = lo; i < hi; ++i) Block(i, 0, m, 0, n);
      }
      if (done.fetch_add(1) + 1 == chunks) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
    if (g_set_threads_local) g_set_threads_local(0);
  }
};

ffi::Error MatMulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                      ffi::ResultBuffer<ffi::F32> c, bool trans_a, bool trans_b) {
  if (g_sgemm == nullptr) return ffi::Error::Internal("torch_xla cpu_blas: no BLAS was given");
  const auto ad = a.dimensions(), bd = b.dimensions();
  const int64_t r = static_cast<int64_t>(ad.size());
  if (r < 2 || static_cast<int64_t>(bd.size()) != r)
    return ffi::Error::InvalidArgument("torch_xla cpu_blas: operands of equal rank >= 2 expected");
  auto p = std::make_shared<Product>();
  p->a = a.typed_data();
  p->b = b.typed_data();
  p->c = c->typed_data();
  p->batch = 1;
  for (int64_t i = 0; i < r - 2; ++i) p->batch *= ad[i];
  p->m = trans_a ? ad[r - 1] : ad[r - 2];
  p->k = trans_a ? ad[r - 2] : ad[r - 1];
  p->n = trans_b ? bd[r - 2] : bd[r - 1];
  p->ta = trans_a;
  p->tb = trans_b;
  if (p->m == 0 || p->n == 0 || p->batch == 0) return ffi::Error::Success();
  if (p->k == 0) {
    for (int64_t i = 0, e = p->batch * p->m * p->n; i < e; ++i) p->c[i] = 0.f;
    return ffi::Error::Success();
  }
  int64_t threads = pool.num_threads();
  if (threads < 1) threads = 1;
  const int64_t work = p->batch * p->m * p->n * p->k;
  int64_t want = p->batch > 1 ? threads * 4 : threads;
  if (work / want < kMinChunkWork) want = work / kMinChunkWork > 1 ? work / kMinChunkWork : 1;
  p->rows_per_chunk = p->cols_per_chunk = p->items_per_chunk = 0;
  if (p->batch > 1) {
    if (want > p->batch) want = p->batch;
    p->items_per_chunk = (p->batch + want - 1) / want;
    p->chunks = (p->batch + p->items_per_chunk - 1) / p->items_per_chunk;
  } else {
    // pieces of whole 16-float runs of C; the BLAS blocks within them
    const int64_t extent = p->m >= p->n ? p->m : p->n;
    int64_t per = (extent + want - 1) / want;
    per = (per + 15) / 16 * 16;
    if (per > extent) per = extent;
    (p->m >= p->n ? p->rows_per_chunk : p->cols_per_chunk) = per;
    p->chunks = (extent + per - 1) / per;
  }
  for (int64_t t = 1; t < threads && t < p->chunks; ++t) pool.Schedule([p] { p->Work(); });
  p->Work();
  // The chunks others took are being computed (none is queued behind this thread).
  std::unique_lock<std::mutex> lock(p->mu);
  p->cv.wait(lock, [&] { return p->done.load() == p->chunks; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TorchXlaCpuMatMulF32, MatMulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b"));

extern "C" {

// Gives the handler its BLAS: `sgemm` (Fortran convention) and a per-thread thread-count
// setter (may be null).
void torch_xla_cpu_blas_set(void* sgemm, void* set_threads_local) {
  g_sgemm = reinterpret_cast<SgemmFn>(sgemm);
  g_set_threads_local = reinterpret_cast<SetThreadsFn>(set_threads_local);
}

// An importable module, so that the build and the package find this library.
PyMODINIT_FUNC PyInit__cpu_blas(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_cpu_blas", nullptr, -1, nullptr};
  return PyModule_Create(&def);
}

}  // extern "C"
