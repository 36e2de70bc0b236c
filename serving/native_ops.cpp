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
#include <cmath>
#include <cstdlib>
#include <limits>
#include <type_traits>
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

template <typename W, typename F>
void on_full_block(const W* w, int64_t outs, int64_t in, W zero, F&& f) {
  // f(weights of OB outputs): a block of fewer outputs (the last one) runs on a copy padded with code 0
  if (outs == OB) return f(w);
  std::vector<W> padded(OB * in, zero);
  std::copy(w, w + outs * in, padded.begin());
  f(padded.data());
}

template <typename F>
void with_rows(int64_t m, F&& f) {
  // f(std::integral_constant<int64_t, m>): one instantiation per row count of a row block
  switch (m) {
    case 1: f(std::integral_constant<int64_t, 1>{}); break;
    case 2: f(std::integral_constant<int64_t, 2>{}); break;
#if defined(__AVX512F__)
    case 3: f(std::integral_constant<int64_t, 3>{}); break;
    case 4: f(std::integral_constant<int64_t, 4>{}); break;
    case 5: f(std::integral_constant<int64_t, 5>{}); break;
    case 6: f(std::integral_constant<int64_t, 6>{}); break;
    case 7: f(std::integral_constant<int64_t, 7>{}); break;
    case 8: f(std::integral_constant<int64_t, 8>{}); break;
#endif
  }
}

template <int64_t ROWS, typename T>
void int8_rows(const T* x, int64_t in, const int8_t* w, int64_t outs, float* sums) {
  on_full_block<int8_t>(w, outs, in, 0, [&](const int8_t* b) { int8_block<ROWS>(x, in, b, outs, sums); });
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
        with_rows(m, [&](auto rows) { int8_rows<rows.value>(xr, in, wb, n, sums); });
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

// w8a8_mm: (R, I) inputs (fp32 or bf16) times (O, I) int8 weights, the inputs quantized to int8 too, on the
// fly, with one scale per block of `block` inputs of a row (absmax / 127, round to nearest even), so that
// the products are integer dot products: AVX512-VNNI's vpdpbusd does 64 multiply-adds an instruction where
// int8_mm's fp32 FMAs do 16, and a verification of 8-16 rows costs about what one row does (int8_mm's grows
// with the rows: it is bound by arithmetic on a CPU with one 512-bit FMA port). llama.cpp's Q8_0 products
// quantize their inputs likewise, in blocks of 32 (ggml's quantize_row_q8_0).
//
// vpdpbusd multiplies unsigned bytes by signed ones, so the weights are stored as code + 128 (uint8) and
// the inputs stay signed: sum (w + 128) x = sum w x + 128 sum x, and the second term, which depends on the
// row alone, is taken off once per row. A block's dot product is an exact int32; the blocks' sums are
// scaled by the block's input scale in fp32, lane by lane, in a fixed order, then the lanes reduced in a
// fixed order and the output scaled by its weight scale: a row's output does not depend on the other rows
// fed with it (tests/test_native.py checks it bit for bit). Without VNNI the bytes are widened to int16
// and multiplied in pairs (vpmaddwd), exactly too.
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t QCH = 64;  // bytes per integer vector
using IVec = __m512i;
inline IVec izero() { return _mm512_setzero_si512(); }
inline IVec iload(const void* p) { return _mm512_loadu_si512(p); }
inline Vec icvt(IVec v) { return _mm512_cvtepi32_ps(v); }
inline Vec vset(float a) { return _mm512_set1_ps(a); }
#if defined(__AVX512VNNI__)
inline IVec idot(IVec acc, IVec u, IVec s) { return _mm512_dpbusd_epi32(acc, u, s); }
#else
inline IVec idot(IVec acc, IVec u, IVec s) {
  const __m512i ul = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(u));
  const __m512i uh = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(u, 1));
  const __m512i sl = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(s));
  const __m512i sh = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(s, 1));
  return _mm512_add_epi32(acc, _mm512_add_epi32(_mm512_madd_epi16(ul, sl), _mm512_madd_epi16(uh, sh)));
}
#endif
constexpr bool W8A8_VECTORISED = true;
#define BOOSTTUNE_W8A8_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
constexpr int64_t QCH = 32;
using IVec = __m256i;
inline IVec izero() { return _mm256_setzero_si256(); }
inline IVec iload(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Vec icvt(IVec v) { return _mm256_cvtepi32_ps(v); }
inline Vec vset(float a) { return _mm256_set1_ps(a); }
#if defined(__AVXVNNI__)
inline IVec idot(IVec acc, IVec u, IVec s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
inline IVec idot(IVec acc, IVec u, IVec s) {
  const __m256i ul = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(u));
  const __m256i uh = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(u, 1));
  const __m256i sl = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(s));
  const __m256i sh = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(s, 1));
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(ul, sl), _mm256_madd_epi16(uh, sh)));
}
#endif
constexpr bool W8A8_VECTORISED = true;
#define BOOSTTUNE_W8A8_SIMD 1
#else
constexpr int64_t QCH = 64;
constexpr bool W8A8_VECTORISED = false;  // serving/quantize.py computes w8a8 in torch then
#endif


template <typename T>
float block_absmax(const T* x, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {  // the same maximum as the loop below, 16 at a time
    __m512 m = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(vload(x + i)));
    return _mm512_reduce_max_ps(m);
  }
#endif
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::abs(static_cast<float>(x[i])));
  return amax;
}

template <typename T>
int32_t block_codes(const T* x, int64_t n, float inv, int8_t* q) {
  // q = x * inv rounded half to even (|x * inv| <= 127 by the block's maximum); returns the codes' sum
#if defined(__AVX512F__)
  if (n % 16 == 0) {  // cvtps rounds to nearest even, as nearbyint does under the default rounding mode
    __m512i sum = _mm512_setzero_si512();
    const __m512 vinv = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < n; i += 16) {
      const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(vload(x + i), vinv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(c));
      sum = _mm512_add_epi32(sum, c);
    }
    return _mm512_reduce_add_epi32(sum);
  }
#endif
  int32_t sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::nearbyint(static_cast<float>(x[i]) * inv);
    const int32_t c = static_cast<int32_t>(std::min(127.f, std::max(-127.f, v)));
    q[i] = static_cast<int8_t>(c);
    sum += c;
  }
  return sum;
}

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t in, int64_t block, int8_t* q, float* scales, float* offsets) {
  // q: each row's int8 codes; scales (rows, in / block); offsets: 128 * sum over blocks of scale * sum codes
  const int64_t nb = in / block;
  for (int64_t r = 0; r < rows; ++r) {
    float offset = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t i0 = r * in + b * block;
      const float amax = block_absmax(x + i0, block);
      const float inv = amax > 0.f ? 127.f / amax : 0.f, a = amax / 127.f;
      const int32_t sum = block_codes(x + i0, block, inv, q + i0);
      scales[r * nb + b] = a;
      offset += a * (128.f * static_cast<float>(sum));
    }
    offsets[r] = offset;
  }
}

#if defined(BOOSTTUNE_W8A8_SIMD)
template <int64_t ROWS>
void w8a8_block(const int8_t* xq, const float* xs, int64_t in, int64_t block, const uint8_t* w, float* sums) {
  // sums[r * OB + o] = sum over blocks b of xs[r, b] * dot(w row o, x row r over block b), w + 128 included
  Vec acc[ROWS][OB];
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t o = 0; o < OB; ++o) acc[r][o] = vzero();
  const int64_t nb = in / block;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * block;
    IVec d[ROWS][OB];  // the block's integer dot products: every (row, output) pair advances a chunk at a
    for (int64_t r = 0; r < ROWS; ++r)  // time, so that vpdpbusd's latency overlaps across the pairs
      for (int64_t o = 0; o < OB; ++o) d[r][o] = izero();
    for (int64_t i = i0; i < i0 + block; i += QCH) {
      IVec wv[OB];
      for (int64_t o = 0; o < OB; ++o) {
        wv[o] = iload(w + o * in + i);
        if (i % 64 == 0) __builtin_prefetch(w + (AHEAD + o) * in + i, 0, 3);  // a line per output per chunk
      }
      for (int64_t r = 0; r < ROWS; ++r) {
        const IVec xv = iload(xq + r * in + i);
        for (int64_t o = 0; o < OB; ++o) d[r][o] = idot(d[r][o], wv[o], xv);
      }
    }
    for (int64_t r = 0; r < ROWS; ++r) {
      const Vec a = vset(xs[r * nb + b]);
      for (int64_t o = 0; o < OB; ++o) acc[r][o] = vfma(icvt(d[r][o]), a, acc[r][o]);
    }
  }
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t o = 0; o < OB; ++o) sums[r * OB + o] = vsum(acc[r][o]);
}

template <int64_t ROWS>
void w8a8_rows(const int8_t* xq, const float* xs, int64_t in, int64_t block, const uint8_t* w, int64_t outs,
               float* sums) {
  on_full_block<uint8_t>(w, outs, in, 128, [&](const uint8_t* b) { w8a8_block<ROWS>(xq, xs, in, block, b, sums); });
}

template <typename S>
void w8a8_kernel(const int8_t* xq, const float* xs, const float* offsets, const uint8_t* wp, const float* sp, S* op,
                 int64_t rows, int64_t in, int64_t outs, int64_t block) {
  const int64_t blocks = (outs + OB - 1) / OB, nb = in / block;
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    float sums[RB * OB];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t o0 = b * OB, n = std::min(OB, outs - o0);
      const uint8_t* wb = wp + o0 * in;
      for (int64_t r0 = 0; r0 < rows; r0 += RB) {
        const int64_t m = std::min(RB, rows - r0);
        const int8_t* xr = xq + r0 * in;
        const float* sr = xs + r0 * nb;
        with_rows(m, [&](auto rows) { w8a8_rows<rows.value>(xr, sr, in, block, wb, n, sums); });
        for (int64_t r = 0; r < m; ++r)
          for (int64_t o = 0; o < n; ++o)
            op[(r0 + r) * outs + o0 + o] = static_cast<S>((sums[r * OB + o] - offsets[r0 + r]) * sp[o0 + o]);
      }
    }
  });
}
#endif


#if defined(BOOSTTUNE_W8A8_SIMD) && defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512F__) && \
    defined(__linux__)
// With AMX (Intel Xeon 4th generation on), the products run on tiles: a tile multiply (tdpbusd) takes 16
// outputs' weights by 64 inputs (u8) and the 64 inputs of 16 rows (s8) into a 16 x 16 tile of int32 sums,
// 16,384 multiply-adds an instruction, so the products are bound by reading the weights for up to 16 rows.
// The weights tile is loaded straight from the (O, I) weight (a row stride of I); the inputs are laid out
// as the tile wants them (per 64 inputs, 16 groups of 4 inputs for each of the 16 rows). A block's sums are
// exact; they are scaled by the rows' block scales and added in block order, for every row alike: a row's
// output depends on that row alone, as on the vector path (but rounds otherwise: one path per process).
#define BOOSTTUNE_W8A8_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

constexpr int64_t AMX_ROWS = 16;  // rows per pass (a tile's columns)
constexpr int64_t AMX_OUTS = 32;  // outputs per group: two weight tiles, two sum tiles

bool amx_ready() {
  // Linux hands out the tiles' state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM for
  // XFEATURE_XTILEDATA); a VM that hides AMX says no and the vector path stays
  // (BOOSTTUNE_AMX=0 keeps the vector path, e.g. to test it on a CPU with AMX)
  static const bool ok = [] {
    const char* env = std::getenv("BOOSTTUNE_AMX");
    return !(env != nullptr && std::string(env) == "0") && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ok;
}

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void store16(float* dst, __m512 v) { _mm512_storeu_ps(dst, v); }
inline void store16(c10::BFloat16* dst, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
#else
  alignas(64) float t[16];
  _mm512_store_ps(t, v);
  for (int i = 0; i < 16; ++i) dst[i] = static_cast<c10::BFloat16>(t[i]);
#endif
}

template <typename S>
void write_rows(const float (*acc)[16], const float* offsets, const float* scales, S* out, int64_t m, int64_t n_out,
                int64_t outs) {
  // out[n, o] = (acc[o][n] - offsets[n]) * scales[o]: each row's outputs gathered 16 at a time
  const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(16));
  for (int64_t n = 0; n < m; ++n) {
    const __m512 off = _mm512_set1_ps(offsets[n]);
    int64_t o = 0;
    for (; o + 16 <= n_out; o += 16) {
      const __m512 v = _mm512_i32gather_ps(idx, &acc[o][n], 4);
      store16(out + n * outs + o, _mm512_mul_ps(_mm512_sub_ps(v, off), _mm512_loadu_ps(scales + o)));
    }
    for (; o < n_out; ++o) out[n * outs + o] = static_cast<S>((acc[o][n] - offsets[n]) * scales[o]);
  }
}

template <typename S>
void w8a8_amx(const int8_t* xq, const float* xs, const float* offsets, const uint8_t* wp, const float* sp, S* op,
              int64_t rows, int64_t in, int64_t outs, int64_t block) {
  const int64_t nb = in / block, chunks = in / 64, per_block = block / 64;
  const int64_t groups = (outs + AMX_OUTS - 1) / AMX_OUTS;
  for (int64_t r0 = 0; r0 < rows; r0 += AMX_ROWS) {
    const int64_t m = std::min(AMX_ROWS, rows - r0);
    // the inputs as tiles: per chunk of 64 inputs, 16 groups of 4 for each of 16 rows (rows past m are 0)
    std::vector<int32_t> xt(chunks * 16 * AMX_ROWS, 0);
    const int32_t* x4 = reinterpret_cast<const int32_t*>(xq);
    for (int64_t n = 0; n < m; ++n)
      for (int64_t k = 0; k < in / 4; ++k) xt[(k / 16) * 256 + (k % 16) * 16 + n] = x4[(r0 + n) * (in / 4) + k];
    std::vector<float> st(nb * AMX_ROWS, 0.f);  // block scales, rows along the vector
    for (int64_t n = 0; n < m; ++n)
      for (int64_t b = 0; b < nb; ++b) st[b * AMX_ROWS + n] = xs[(r0 + n) * nb + b];
    at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
      TileConfig cfg;
      for (int t = 0; t < 5; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
      _tile_loadconfig(&cfg);
      alignas(64) int32_t sums[AMX_OUTS][16];
      alignas(64) float acc[AMX_OUTS][16];
      std::vector<uint8_t> padded;
      for (int64_t g = begin; g < end; ++g) {
        const int64_t o0 = g * AMX_OUTS, n_out = std::min(AMX_OUTS, outs - o0);
        const uint8_t* w = wp + o0 * in;
        if (n_out < AMX_OUTS) {  // the last group: a copy padded with code 0
          padded.assign(AMX_OUTS * in, 128);
          std::copy(w, w + n_out * in, padded.begin());
          w = padded.data();
        }
        const uint8_t* ahead = g + 1 < end && o0 + 2 * AMX_OUTS <= outs ? wp + (o0 + AMX_OUTS) * in : nullptr;
        for (int64_t o = 0; o < AMX_OUTS; ++o) _mm512_store_ps(acc[o], _mm512_setzero_ps());
        for (int64_t b = 0; b < nb; ++b) {
          _tile_zero(0);
          _tile_zero(1);
          for (int64_t c = b * per_block; c < (b + 1) * per_block; ++c) {
            if (ahead != nullptr)  // the next group's weights, a line per output per chunk
              for (int64_t o = 0; o < AMX_OUTS; ++o) __builtin_prefetch(ahead + o * in + c * 64, 0, 2);
            _tile_loadd(2, w + c * 64, in);
            _tile_loadd(3, w + 16 * in + c * 64, in);
            _tile_loadd(4, xt.data() + c * 256, 64);
            _tile_dpbusd(0, 2, 4);
            _tile_dpbusd(1, 3, 4);
          }
          _tile_stored(0, sums[0], 64);
          _tile_stored(1, sums[16], 64);
          const __m512 a = _mm512_loadu_ps(st.data() + b * AMX_ROWS);
          for (int64_t o = 0; o < AMX_OUTS; ++o)
            _mm512_store_ps(acc[o], _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[o])), a,
                                                    _mm512_load_ps(acc[o])));
        }
        write_rows(acc, offsets + r0, sp + o0, op + r0 * outs + o0, m, n_out, outs);
      }
      _tile_release();
    });
  }
}
#endif

bool w8a8_vectorised() { return W8A8_VECTORISED; }

std::string w8a8_isa() {
  // the instructions w8a8_mm multiplies with in this process
#if defined(BOOSTTUNE_W8A8_AMX)
  if (amx_ready()) return "amx";
#endif
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
  return "vnni";
#elif defined(BOOSTTUNE_W8A8_SIMD)
  return "avx-int16";
#else
  return "none";
#endif
}

at::Tensor w8a8_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, int64_t block) {
  TORCH_CHECK(W8A8_VECTORISED, "boosttune_native::w8a8_mm: built without AVX2 or AVX512 (use the torch path)");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && scales.dim() == 1, "boosttune_native::w8a8_mm: x (R, I), "
              "weight (O, I) and scales (O,) expected");
  TORCH_CHECK(weight.scalar_type() == at::kByte, "boosttune_native::w8a8_mm: uint8 weights (code + 128) expected");
  TORCH_CHECK(scales.scalar_type() == at::kFloat, "boosttune_native::w8a8_mm: fp32 scales expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "boosttune_native::w8a8_mm: fp32 or bf16 inputs expected");
  const int64_t rows = x.size(0), in = x.size(1), outs = weight.size(0);
  TORCH_CHECK(weight.size(1) == in && scales.size(0) == outs && block > 0 && block % QCH == 0 && in % block == 0,
              "boosttune_native::w8a8_mm: shapes (", rows, ", ", in, ") x (", outs, ", ", weight.size(1), ") with ",
              scales.size(0), " scales and blocks of ", block, "; the block must divide in_features and be a "
              "multiple of ", QCH);
  const at::Tensor xc = x.contiguous(), w = weight.contiguous(), sc = scales.contiguous();
  at::Tensor out = at::empty({rows, outs}, x.options());
#if defined(BOOSTTUNE_W8A8_SIMD)
  std::vector<int8_t> q(rows * in);
  std::vector<float> xs(rows * (in / block)), offsets(rows);
  if (x.scalar_type() == at::kFloat)
    quantize_rows(xc.data_ptr<float>(), rows, in, block, q.data(), xs.data(), offsets.data());
  else
    quantize_rows(xc.data_ptr<c10::BFloat16>(), rows, in, block, q.data(), xs.data(), offsets.data());
#if defined(BOOSTTUNE_W8A8_AMX)
  if (amx_ready()) {
    if (x.scalar_type() == at::kFloat)
      w8a8_amx(q.data(), xs.data(), offsets.data(), w.data_ptr<uint8_t>(), sc.data_ptr<float>(),
               out.data_ptr<float>(), rows, in, outs, block);
    else
      w8a8_amx(q.data(), xs.data(), offsets.data(), w.data_ptr<uint8_t>(), sc.data_ptr<float>(),
               out.data_ptr<c10::BFloat16>(), rows, in, outs, block);
    return out;
  }
#endif
  if (x.scalar_type() == at::kFloat)
    w8a8_kernel(q.data(), xs.data(), offsets.data(), w.data_ptr<uint8_t>(), sc.data_ptr<float>(),
                out.data_ptr<float>(), rows, in, outs, block);
  else
    w8a8_kernel(q.data(), xs.data(), offsets.data(), w.data_ptr<uint8_t>(), sc.data_ptr<float>(),
                out.data_ptr<c10::BFloat16>(), rows, in, outs, block);
#endif
  return out;
}

// attend_rows: softmax(scale q k^T) v for every query row, each summed over its visible keys in the order
// of their positions, by the same operations whatever rows share the call and wherever the keys lie in the
// cache: a row's output depends on its query and the sequence of its visible keys and values alone. torch's
// attention sums in an order that depends on the query rows fed at once and on the masked positions between
// the visible ones (a tree's nodes sit at scattered slots), so its rows differ from a plain step's in the last
// bit, which w8a8's input quantizer can turn into other codes for a whole block (serving/pooled.py, sdpa).
// fp32 arithmetic for bf16 or fp32 inputs; a row that sees no key gives zeros.
#if defined(__AVX512F__)
inline __m512 vexp(__m512 x) {
  // e^x = 2^n e^r, n = round(x log2 e), r = x - n ln 2 (ln 2 in two parts), e^r by its Taylor polynomial
  // of degree 7 (|r| <= ln 2 / 2: relative error below 2e-7); 0 below -87 (e^-87 is near fp32's least normal)
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}
#endif

template <typename T>
void attend_row(const T* q, const T* k, const T* v, int64_t key_stride, const bool* visible, int64_t keys,
                int64_t c, float scale, T* out, std::vector<float>& qf, std::vector<float>& sc,
                std::vector<int64_t>& idx, std::vector<float>& acc) {
  qf.resize(c);
  for (int64_t i = 0; i < c; ++i) qf[i] = static_cast<float>(q[i]);
  sc.clear();
  idx.clear();
  for (int64_t l = 0; l < keys; ++l) {
    if (visible != nullptr && !visible[l]) continue;
    const T* kr = k + l * key_stride;
    float dot;
#if defined(__AVX512F__)
    if (c % 32 == 0) {  // two chains of products, added at the end: a fixed order, half the latency
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
      for (int64_t i = 0; i < c; i += 32) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qf.data() + i), vload(kr + i), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qf.data() + i + 16), vload(kr + i + 16), a1);
      }
      dot = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    } else if (c % 16 == 0) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t i = 0; i < c; i += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(qf.data() + i), vload(kr + i), a);
      dot = _mm512_reduce_add_ps(a);
    } else
#endif
    {
      dot = 0.f;
      for (int64_t i = 0; i < c; ++i) dot += qf[i] * static_cast<float>(kr[i]);
    }
    sc.push_back(dot * scale);
    idx.push_back(l);
  }
  const int64_t n = static_cast<int64_t>(sc.size());
  if (n == 0) {
    for (int64_t i = 0; i < c; ++i) out[i] = static_cast<T>(0.f);
    return;
  }
  const float mx = *std::max_element(sc.begin(), sc.end());
  float sum;
#if defined(__AVX512F__)
  {
    sc.resize((n + 15) / 16 * 16, -std::numeric_limits<float>::infinity());  // padding: e = 0
    __m512 s16 = _mm512_setzero_ps();
    const __m512 m = _mm512_set1_ps(mx);
    for (int64_t j = 0; j < n; j += 16) {
      const __m512 e = vexp(_mm512_sub_ps(_mm512_loadu_ps(sc.data() + j), m));
      _mm512_storeu_ps(sc.data() + j, e);
      s16 = _mm512_add_ps(s16, e);
    }
    sum = _mm512_reduce_add_ps(s16);
  }
#else
  sum = 0.f;
  for (int64_t j = 0; j < n; ++j) sum += (sc[j] = std::exp(sc[j] - mx));
#endif
#if defined(__AVX512F__)
  if (c == 64) {  // the usual head size: the output's four vectors stay in registers
    __m512 o0 = _mm512_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
    for (int64_t j = 0; j < n; ++j) {
      const T* vr = v + idx[j] * key_stride;
      const __m512 ev = _mm512_set1_ps(sc[j]);
      o0 = _mm512_fmadd_ps(ev, vload(vr), o0);
      o1 = _mm512_fmadd_ps(ev, vload(vr + 16), o1);
      o2 = _mm512_fmadd_ps(ev, vload(vr + 32), o2);
      o3 = _mm512_fmadd_ps(ev, vload(vr + 48), o3);
    }
    const __m512 inv = _mm512_set1_ps(1.f / sum);
    alignas(64) float res[64];
    _mm512_store_ps(res, _mm512_mul_ps(o0, inv));
    _mm512_store_ps(res + 16, _mm512_mul_ps(o1, inv));
    _mm512_store_ps(res + 32, _mm512_mul_ps(o2, inv));
    _mm512_store_ps(res + 48, _mm512_mul_ps(o3, inv));
    for (int64_t i = 0; i < 64; ++i) out[i] = static_cast<T>(res[i]);
    return;
  }
#endif
  acc.assign(c, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const T* vr = v + idx[j] * key_stride;
    const float e = sc[j];
#if defined(__AVX512F__)
    if (c % 16 == 0) {
      const __m512 ev = _mm512_set1_ps(e);
      for (int64_t i = 0; i < c; i += 16)
        _mm512_storeu_ps(acc.data() + i, _mm512_fmadd_ps(ev, vload(vr + i), _mm512_loadu_ps(acc.data() + i)));
      continue;
    }
#endif
    for (int64_t i = 0; i < c; ++i) acc[i] += e * static_cast<float>(vr[i]);
  }
  const float inv = 1.f / sum;
  for (int64_t i = 0; i < c; ++i) out[i] = static_cast<T>(acc[i] * inv);
}

at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "boosttune_native::attend_rows: q (B, G, M, C), k and "
              "v (B, G, L, C) expected");
  const int64_t b = q.size(0), g = q.size(1), m = q.size(2), c = q.size(3), keys = k.size(2);
  TORCH_CHECK(k.size(0) == b && k.size(1) == g && k.size(3) == c && v.sizes() == k.sizes(),
              "boosttune_native::attend_rows: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
              (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "boosttune_native::attend_rows: q, k and v fp32 or bf16 alike");
  // k and v as (B, G, L, C) with C contiguous and the keys a fixed stride apart (a cache's slice is)
  at::Tensor kc = k.stride(3) == 1 && v.strides() == k.strides() ? k : k.contiguous();
  at::Tensor vc = v.strides() == kc.strides() ? v : v.contiguous();
  if (vc.strides() != kc.strides()) kc = kc.contiguous(), vc = vc.contiguous();
  const at::Tensor qc = q.contiguous();
  at::Tensor vis;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool, "boosttune_native::attend_rows: a bool mask expected");
    vis = (mask->dim() == 2 ? mask->view({1, 1, mask->size(0), mask->size(1)}) : *mask)
              .expand({b, g, m, keys}).contiguous();
  }
  at::Tensor out = at::empty({b, g, m, c}, q.options());
  const int64_t sb = kc.stride(0), sg = kc.stride(1), sl = kc.stride(2);
  auto run = [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    const scalar_t* qp = qc.data_ptr<scalar_t>();
    const scalar_t* kp = kc.data_ptr<scalar_t>();
    const scalar_t* vp = vc.data_ptr<scalar_t>();
    const bool* mp = vis.defined() ? vis.data_ptr<bool>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, b * g * m, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qf, sc, acc;
      std::vector<int64_t> idx;
      for (int64_t r = begin; r < end; ++r) {
        const int64_t bi = r / (g * m), gi = (r / m) % g;
        attend_row(qp + r * c, kp + bi * sb + gi * sg, vp + bi * sb + gi * sg, sl,
                   mp != nullptr ? mp + r * keys : nullptr, keys, c, static_cast<float>(scale), op + r * c, qf, sc,
                   idx, acc);
      }
    });
  };
  if (q.scalar_type() == at::kFloat)
    run(static_cast<float*>(nullptr));
  else
    run(static_cast<c10::BFloat16*>(nullptr));
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
  m.def("w8a8_mm(Tensor x, Tensor weight, Tensor scales, int block) -> Tensor");
  m.def("w8a8_vectorised() -> bool", &w8a8_vectorised);
  m.def("w8a8_isa() -> str", &w8a8_isa);
  m.def("attend_rows(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(boosttune_native, CPU, m) {
  m.impl("linear", &linear);
  m.impl("int8_mm", &int8_mm);
  m.impl("w8a8_mm", &w8a8_mm);
  m.impl("attend_rows", &attend_rows);
}
