// boosttune_native: the compiled forward's matrix products called without Python (serving/native.py builds
// and loads this file; serving/compiled.py uses it).
//
// A compiled forward calls each product of the LLM through one op that finds its weight by an integer
// key, so that the weights never enter the graph. Registered from Python, that op cost ~9 us per call on
// an AVX512-BF16 EPYC (211 calls per step of the default LLM); here it is a table lookup and a call
// through the dispatcher.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Entry {
  at::Tensor weight;  // oneDNN's packed weight (packed) or the (O, I) weight itself
  bool packed = false;
  bool set = false;
};

std::vector<Entry>& table() {
  static std::vector<Entry> entries;
  return entries;
}
std::mutex& table_lock() {
  static std::mutex m;
  return m;
}

void put(const at::Tensor& weight, int64_t key, bool packed) {
  std::lock_guard<std::mutex> guard(table_lock());
  TORCH_CHECK(key >= 0, "boosttune_native::put: key must be >= 0, got ", key);
  auto& entries = table();
  if (static_cast<int64_t>(entries.size()) <= key) entries.resize(key + 1);
  entries[key] = Entry{weight, packed, true};
}

void drop(int64_t key) {
  std::lock_guard<std::mutex> guard(table_lock());
  auto& entries = table();
  if (key >= 0 && key < static_cast<int64_t>(entries.size())) entries[key] = Entry{};
}

at::Tensor linear(const at::Tensor& x, int64_t key, int64_t out_features) {
  at::Tensor weight;
  bool packed;
  {
    std::lock_guard<std::mutex> guard(table_lock());
    auto& entries = table();
    TORCH_CHECK(key >= 0 && key < static_cast<int64_t>(entries.size()) && entries[key].set,
                "boosttune_native::linear: no weight under key ", key);
    weight = entries[key].weight;
    packed = entries[key].packed;
  }
  at::Tensor out;
  if (packed) {
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack{x, weight, c10::IValue(), std::string("none"),
                            c10::List<std::optional<at::Scalar>>(), std::string("")};
    op.callBoxed(&stack);
    out = stack[0].toTensor();
  } else {
    out = at::linear(x, weight);
  }
  TORCH_CHECK(out.size(-1) == out_features, "boosttune_native::linear: key ", key, " gives ", out.size(-1),
              " outputs, the graph expects ", out_features);
  return out;
}


// int8_mm: (R, I) inputs (fp32 or bf16) times (O, I) int8 weights with one scale per output, as
// aten::_weight_int8pack_mm computes them, but blocked over outputs and rows: each weight is loaded and
// converted to fp32 once per RB rows (8 with AVX512), a block of OB outputs' weights (a few KB) stays in L1
// for the next rows, and the weights AHEAD outputs on are prefetched (a row of 576 or 1536 bytes is too
// short for the hardware prefetcher to ramp up: without it one row ran at torch's speed). Rows of RB or
// more in bf16 are converted to fp32 once, so that the products read them from memory and the vector
// ports convert only weights. torch's kernel reads the weights again every few rows, so its cost grew
// about linearly with the rows a tree verification feeds (serving/quantize.py has the figures).
//
// Every output is the sum of its lanes' partial sums (lane l holds the inputs i = l mod LANES), each
// accumulated in input order, then reduced in a fixed order: the same operations for a row whatever R is
// and wherever it falls in a block, so a row's output does not depend on the other rows fed with it
// (a tree's row rounds as a plain step's would; tests/test_native.py checks it bit for bit).
#if defined(__AVX512F__)
constexpr int64_t LANES = 16;
constexpr int64_t RB = 8;
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const c10::BFloat16* p) {  // 16 bf16 inputs as fp32 (exact: bf16 is fp32's top half)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline Vec vint8(const int8_t* p) {  // 16 int8 weights as fp32 (exact)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
constexpr bool VECTORISED = true;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t LANES = 8;
constexpr int64_t RB = 2;  // 16 vector registers: fewer accumulators
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline Vec vint8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) {
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}
constexpr bool VECTORISED = true;
#else
constexpr int64_t LANES = 1;  // plain C++: correct, slow (serving/quantize.py keeps torch's kernel then)
constexpr int64_t RB = 1;
using Vec = float;
inline Vec vzero() { return 0.f; }
inline Vec vload(const float* p) { return *p; }
inline Vec vload(const c10::BFloat16* p) { return static_cast<float>(*p); }
inline Vec vint8(const int8_t* p) { return static_cast<float>(*p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return a * b + c; }
inline float vsum(Vec v) { return v; }
constexpr bool VECTORISED = false;
#endif
constexpr int64_t OB = 2;     // outputs per block (AVX512: 2 x 8 accumulators, each row's input from memory)
constexpr int64_t AHEAD = 8;  // prefetch distance in output rows

template <int64_t ROWS, typename T>
void int8_block(const T* x, int64_t in, const int8_t* w, int64_t outs, float* sums) {
  // sums[r * OB + o] = dot(x row r, w row o) for r < ROWS, o < outs (w holds OB rows)
  Vec acc[ROWS][OB];
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t o = 0; o < OB; ++o) acc[r][o] = vzero();
  for (int64_t i = 0; i < in; i += LANES) {
    Vec xv[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) xv[r] = vload(x + r * in + i);
    if (i % 64 == 0)  // the weights 8 outputs on, a cache line per row per 64 inputs: the short rows of a
      for (int64_t o = 0; o < OB; ++o)  // block are too short for the hardware prefetcher to ramp up
        __builtin_prefetch(w + (AHEAD + o) * in + i, 0, 3);
    for (int64_t o = 0; o < OB; ++o) {
      const Vec wf = vint8(w + o * in + i);
      for (int64_t r = 0; r < ROWS; ++r) acc[r][o] = vfma(xv[r], wf, acc[r][o]);
    }
  }
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t o = 0; o < outs; ++o) sums[r * OB + o] = vsum(acc[r][o]);
}

bool int8_vectorised() { return VECTORISED; }

template <int64_t ROWS, typename T>
void int8_rows(const T* x, int64_t in, const int8_t* w, int64_t outs, float* sums) {
  // a block of fewer than OB outputs (the last one) runs on a zero-padded copy of its weights
  if (outs == OB) return int8_block<ROWS>(x, in, w, OB, sums);
  std::vector<int8_t> padded(OB * in, 0);
  std::copy(w, w + outs * in, padded.begin());
  int8_block<ROWS>(x, in, padded.data(), outs, sums);
}

template <typename T, typename S>
void int8_kernel(const T* xp, const int8_t* wp, const S* sp, S* op, int64_t rows, int64_t in, int64_t outs) {
  const int64_t blocks = (outs + OB - 1) / OB;
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    float sums[RB * OB];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t o0 = b * OB, n = std::min(OB, outs - o0);
      const int8_t* wb = wp + o0 * in;
      for (int64_t r0 = 0; r0 < rows; r0 += RB) {
        const int64_t m = std::min(RB, rows - r0);
        const T* xr = xp + r0 * in;
        switch (m) {  // one instantiation per row count
          case 1: int8_rows<1>(xr, in, wb, n, sums); break;
          case 2: int8_rows<2>(xr, in, wb, n, sums); break;
#if defined(__AVX512F__)
          case 3: int8_rows<3>(xr, in, wb, n, sums); break;
          case 4: int8_rows<4>(xr, in, wb, n, sums); break;
          case 5: int8_rows<5>(xr, in, wb, n, sums); break;
          case 6: int8_rows<6>(xr, in, wb, n, sums); break;
          case 7: int8_rows<7>(xr, in, wb, n, sums); break;
          case 8: int8_rows<8>(xr, in, wb, n, sums); break;
#endif
        }
        for (int64_t r = 0; r < m; ++r)  // rounded once, to S (round to nearest even for bf16)
          for (int64_t o = 0; o < n; ++o)
            op[(r0 + r) * outs + o0 + o] = static_cast<S>(sums[r * OB + o] * static_cast<float>(sp[o0 + o]));
      }
    }
  });
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && scales.dim() == 1, "boosttune_native::int8_mm: x (R, I), "
              "weight (O, I) and scales (O,) expected");
  TORCH_CHECK(weight.scalar_type() == at::kChar, "boosttune_native::int8_mm: int8 weights expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "boosttune_native::int8_mm: fp32 or bf16 inputs expected");
  const int64_t rows = x.size(0), in = x.size(1), outs = weight.size(0);
  TORCH_CHECK(weight.size(1) == in && scales.size(0) == outs && in % LANES == 0,
              "boosttune_native::int8_mm: shapes (", rows, ", ", in, ") x (", outs, ", ", weight.size(1),
              ") with ", scales.size(0), " scales; in_features must be a multiple of ", LANES);
  TORCH_CHECK(scales.scalar_type() == x.scalar_type(), "boosttune_native::int8_mm: scales must be in the inputs' dtype");
  const at::Tensor xc = x.contiguous(), w = weight.contiguous(), sc = scales.contiguous();
  at::Tensor out = at::empty({rows, outs}, x.options());
  if (x.scalar_type() == at::kFloat)
    int8_kernel(xc.data_ptr<float>(), w.data_ptr<int8_t>(), sc.data_ptr<float>(), out.data_ptr<float>(), rows, in, outs);
  else if (rows < RB)  // bf16 rows converted in the loop (exactly, as below)
    int8_kernel(xc.data_ptr<c10::BFloat16>(), w.data_ptr<int8_t>(), sc.data_ptr<c10::BFloat16>(),
                out.data_ptr<c10::BFloat16>(), rows, in, outs);
  else {  // converted once: fp32 rows feed the products straight from memory, sparing the vector ports
    const at::Tensor xf = xc.to(at::kFloat);
    int8_kernel(xf.data_ptr<float>(), w.data_ptr<int8_t>(), sc.data_ptr<c10::BFloat16>(),
                out.data_ptr<c10::BFloat16>(), rows, in, outs);
  }
  return out;
}

}  // namespace

// put and drop are called from Python only (composite: any tensor, oneDNN's packed ones included); linear
// is a CPU kernel, so that a compiled graph can trace it through the fake kernel serving/native.py gives
TORCH_LIBRARY(boosttune_native, m) {
  m.def("put(Tensor weight, int key, bool packed) -> ()", &put);
  m.def("drop(int key) -> ()", &drop);
  m.def("linear(Tensor x, int key, int out_features) -> Tensor");
  m.def("int8_mm(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  m.def("int8_vectorised() -> bool", &int8_vectorised);
}

TORCH_LIBRARY_IMPL(boosttune_native, CPU, m) {
  m.impl("linear", &linear);
  m.impl("int8_mm", &int8_mm);
}
