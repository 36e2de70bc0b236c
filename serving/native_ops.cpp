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
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
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
// converted to fp32 once per RB rows (8 with AVX512, 6 with AVX2), a block of OB outputs' weights (a few
// KB) stays in L1 for the next rows, and the weights AHEAD outputs on are prefetched (a row of 576 or 1536
// bytes is too short for the hardware prefetcher to ramp up: without it one row ran at torch's speed). Rows of RB or
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
inline Vec vset(float a) { return _mm512_set1_ps(a); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline float vhmax(Vec v) { return _mm512_reduce_max_ps(v); }
inline Vec vfnma(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b, fused
inline Vec vround(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT); }
inline Vec vscale2(Vec p, Vec n) { return _mm512_scalef_ps(p, n); }  // p 2^n
inline Vec vzero_below(Vec x, Vec lo, Vec r) {  // r where x >= lo, else 0
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ)), r);
}
#define BOOSTTUNE_VEC 1
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t LANES = 8;
// 16 vector registers: 12 accumulators, 2 weight vectors, 1 input. Blocks of 2 rows (before) converted
// every weight 4 times for 8 rows; on an AVX2-only EPYC, 2 threads, the default LLM's 121 products took
// 31.6 ms at 8 rows and 67.5 at 16 that way, 24.4 and 51.2 in blocks of 6 (10.0 ms at 1 row either way).
constexpr int64_t RB = 6;
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
inline __m128 vsum4(Vec a, Vec b, Vec c, Vec d) {  // {vsum(a), vsum(b), vsum(c), vsum(d)}, bit for bit:
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // the same pairs, same order
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}
inline Vec vset(float a) { return _mm256_set1_ps(a); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline float vhmax(Vec v) {  // exact in any order
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  return *std::max_element(t, t + 8);
}
inline Vec vfnma(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }
inline Vec vround(Vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vscale2(Vec p, Vec n) {  // p 2^n for integral n >= -126: 2^n from its exponent bits
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                                                  _mm256_set1_epi32(127)), 23)));
}
inline Vec vzero_below(Vec x, Vec lo, Vec r) { return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), r); }
#define BOOSTTUNE_VEC 1
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
#endif
constexpr bool VECTORISED =  // the vector helpers exist (BOOSTTUNE_VEC, for #if)
#if defined(BOOSTTUNE_VEC)
    true;
#else
    false;
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
    if (i % 64 == 0)  // the weights 8 outputs on, a cache line per row per 64 inputs: the short rows of a
      for (int64_t o = 0; o < OB; ++o)  // block are too short for the hardware prefetcher to ramp up
        __builtin_prefetch(w + (AHEAD + o) * in + i, 0, 3);
    Vec wf[OB];  // the block's weights converted once for all its rows, each row's inputs loaded once
    for (int64_t o = 0; o < OB; ++o) wf[o] = vint8(w + o * in + i);
    for (int64_t r = 0; r < ROWS; ++r) {
      const Vec xv = vload(x + r * in + i);
      for (int64_t o = 0; o < OB; ++o) acc[r][o] = vfma(xv, wf[o], acc[r][o]);
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

template <int64_t MAX, typename F>
void with_rows(int64_t m, F&& f) {
  // f(std::integral_constant<int64_t, m>) for 1 <= m <= MAX (<= 8): one instantiation per row count
  static_assert(MAX >= 1 && MAX <= 8, "row blocks of 1 to 8 rows");
  switch (m) {
    case 1: f(std::integral_constant<int64_t, 1>{}); break;
    case 2: if constexpr (MAX >= 2) f(std::integral_constant<int64_t, 2>{}); break;
    case 3: if constexpr (MAX >= 3) f(std::integral_constant<int64_t, 3>{}); break;
    case 4: if constexpr (MAX >= 4) f(std::integral_constant<int64_t, 4>{}); break;
    case 5: if constexpr (MAX >= 5) f(std::integral_constant<int64_t, 5>{}); break;
    case 6: if constexpr (MAX >= 6) f(std::integral_constant<int64_t, 6>{}); break;
    case 7: if constexpr (MAX >= 7) f(std::integral_constant<int64_t, 7>{}); break;
    case 8: if constexpr (MAX >= 8) f(std::integral_constant<int64_t, 8>{}); break;
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
        with_rows<RB>(m, [&](auto rows) { int8_rows<rows.value>(xr, in, wb, n, sums); });
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
// fed with it (tests/test_native.py checks it bit for bit). Without VNNI, AVX512 widens the bytes to int16
// and multiplies them in pairs (vpmaddwd), AVX2 uses vpmaddubsw with the signs moved (below): exact too.
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t QCH = 64;  // bytes per integer vector
constexpr int64_t QRB = RB;  // rows per block (w8a8_block holds 2 ROWS x OB vectors)
using IVec = __m512i;
inline IVec izero() { return _mm512_setzero_si512(); }
inline IVec iload(const void* p) { return _mm512_loadu_si512(p); }
inline Vec icvt(IVec v) { return _mm512_cvtepi32_ps(v); }
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
#if defined(__AVXVNNI__)
constexpr int64_t QRB = 2;  // 16 vector registers
inline IVec idot(IVec acc, IVec u, IVec s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
constexpr int64_t QRB = 4;  // w8a8_block's AVX2 form keeps its fp32 sums in memory, leaving 16 registers to
                            // 4 rows x 2 outputs of integer sums, the 2 outputs' weights and a row's inputs
// Without VNNI: the weight's code w = u - 128 (a signed byte), and |w| times x with w's sign moved onto x
// (vpsignb) in vpmaddubsw, 32 multiply-adds an instruction: |w| <= 128 and |x| <= 127, so a pair's sum
// (<= 32512) never saturates, and the sum is exact. It is sum w x, not sum (w + 128) x: SIGNED_DOT tells
// quantize_rows to leave the 128 sum x offset out. Before, both were widened to int16 for vpmaddwd: on an
// AVX2-only EPYC a compiled w8a8 step of 8 rows took 53.5 ms that way, 38.5 this way, of which attend_rows'
// scalar loops took ~20 (21.0 with them vectorised, below; int8_mm's step: 24.3). w8a8_block has its own
// AVX2 form (below), which makes |w| and w once per 32 weights for all the rows of a block.
#define BOOSTTUNE_SIGNED_DOT 1
inline IVec signed_codes(IVec u) { return _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80))); }
inline IVec sdot(IVec acc, IVec w_abs, IVec w, IVec s) {  // acc + sum w s, in int32 lanes of 4 pairs
  const __m256i p = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(s, w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#endif
constexpr bool W8A8_VECTORISED = true;
#define BOOSTTUNE_W8A8_SIMD 1
#else
constexpr int64_t QCH = 64;
constexpr bool W8A8_VECTORISED = false;  // serving/quantize.py computes w8a8 in torch then
#endif
constexpr int64_t QSTEP = 64;  // w8a8 blocks are multiples of this (serving/quantize.py's W8A8_BLOCKS)


template <typename T>
float block_absmax(const T* x, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {  // the same maximum as the loop below, 16 at a time
    __m512 m = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(vload(x + i)));
    return _mm512_reduce_max_ps(m);
  }
#elif defined(__AVX2__) && defined(BOOSTTUNE_VEC)
  if (n % 8 == 0) {  // the same maximum, 8 at a time
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, vload(x + i)));
    return vhmax(m);
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
#elif defined(__AVX2__) && defined(BOOSTTUNE_VEC)
  if (n % 8 == 0) {  // the same codes, 8 at a time: |x * inv| <= 127, so the saturating packs keep every code
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i sum = _mm256_setzero_si256();
    for (int64_t i = 0; i < n; i += 8) {
      const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(vload(x + i), vinv));
      const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(h, h));
      sum = _mm256_add_epi32(sum, c);
    }
    alignas(32) int32_t t[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), sum);
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
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
#if defined(BOOSTTUNE_SIGNED_DOT)
      (void)sum;  // the integer products are sum w x already (sdot)
#else
      offset += a * (128.f * static_cast<float>(sum));
#endif
    }
    offsets[r] = offset;
  }
}

#if defined(BOOSTTUNE_SIGNED_DOT)
template <int64_t ROWS>
void w8a8_block(const int8_t* xq, const float* xs, int64_t in, int64_t block, const uint8_t* w, float* sums) {
  // The AVX2 form of the block below (same sums, bit for bit): 64 inputs a step, the weights' |w| and w made
  // once per 32 for all ROWS rows, one prefetch per output a step (no branch), the blocks' fp32 sums in
  // memory (256 bytes of L1, touched once per block of 192-256 inputs) so that the registers hold 4 rows of
  // integer sums, and the lanes of 4 sums reduced at once (vsum4, vsum's order). On an AVX2-only EPYC
  // (2 threads, fp32 inputs; scripts/bench_native_builds.py, the builds alternated in one process) the
  // default LLM's 121 products took 0.95-0.97x the generic form's time at 1 row, 0.87 at 2, 0.78-0.80 at 4,
  // 0.74-0.80 at 8-16 rows. An earlier session timed forms like these one build after the other and saw
  // no difference: that machine's speed drifted more than the difference within minutes.
  alignas(32) float acc[ROWS * OB][LANES];
  const int64_t nb = in / block;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * block;
    IVec d[ROWS][OB];
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t o = 0; o < OB; ++o) d[r][o] = izero();
    for (int64_t i = i0; i < i0 + block; i += QSTEP) {
      for (int64_t o = 0; o < OB; ++o) __builtin_prefetch(w + (AHEAD + o) * in + i, 0, 3);
      for (int64_t h = i; h < i + QSTEP; h += QCH) {
        IVec ws[OB], wa[OB];
        for (int64_t o = 0; o < OB; ++o) {
          ws[o] = signed_codes(iload(w + o * in + h));
          wa[o] = _mm256_abs_epi8(ws[o]);
        }
        for (int64_t r = 0; r < ROWS; ++r) {
          const IVec xv = iload(xq + r * in + h);
          for (int64_t o = 0; o < OB; ++o) d[r][o] = sdot(d[r][o], wa[o], ws[o], xv);
        }
      }
    }
    for (int64_t r = 0; r < ROWS; ++r) {
      const Vec a = vset(xs[r * nb + b]);
      for (int64_t o = 0; o < OB; ++o) {
        float* f = acc[r * OB + o];
        vstore(f, vfma(icvt(d[r][o]), a, b ? vload(f) : vzero()));
      }
    }
  }
  int64_t k = 0;
  for (; k + 4 <= ROWS * OB; k += 4)
    _mm_storeu_ps(sums + k, vsum4(vload(acc[k]), vload(acc[k + 1]), vload(acc[k + 2]), vload(acc[k + 3])));
  for (; k < ROWS * OB; ++k) sums[k] = vsum(vload(acc[k]));
}
#elif defined(BOOSTTUNE_W8A8_SIMD)
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

#endif

#if defined(BOOSTTUNE_W8A8_SIMD)
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
    float sums[QRB * OB];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t o0 = b * OB, n = std::min(OB, outs - o0);
      const uint8_t* wb = wp + o0 * in;
      for (int64_t r0 = 0; r0 < rows; r0 += QRB) {
        const int64_t m = std::min(QRB, rows - r0);
        const int8_t* xr = xq + r0 * in;
        const float* sr = xs + r0 * nb;
        with_rows<QRB>(m, [&](auto rows) { w8a8_rows<rows.value>(xr, sr, in, block, wb, n, sums); });
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

// NP passes of 16 rows (1 or 2) over one group's 32 outputs: with two, each weight tile loaded serves both
// passes' input tiles (four tile multiplies per four loads, where one pass takes two per three)
template <int NP, typename S>
void amx_passes(const int32_t* xt, const float* st, const uint8_t* w, const uint8_t* ahead, const float* offsets,
                const float* sp, S* op, int64_t pass, int64_t rows, int64_t in, int64_t outs, int64_t o0,
                int64_t n_out, int64_t nb, int64_t chunks, int64_t per_block, float (*acc)[AMX_OUTS][16]) {
  alignas(64) int32_t sums[AMX_OUTS][16];
  for (int p = 0; p < NP; ++p)
    for (int64_t o = 0; o < AMX_OUTS; ++o) _mm512_store_ps(acc[p][o], _mm512_setzero_ps());
  const int32_t* t0 = xt + pass * chunks * 256;
  const int32_t* t1 = t0 + chunks * 256;
  for (int64_t b = 0; b < nb; ++b) {
    _tile_zero(0);
    _tile_zero(1);
    if (NP == 2) {
      _tile_zero(5);
      _tile_zero(6);
    }
    for (int64_t c = b * per_block; c < (b + 1) * per_block; ++c) {
      if (ahead != nullptr)  // the next group's weights, a line per output per chunk
        for (int64_t o = 0; o < AMX_OUTS; ++o) __builtin_prefetch(ahead + o * in + c * 64, 0, 2);
      _tile_loadd(2, w + c * 64, in);
      _tile_loadd(3, w + 16 * in + c * 64, in);
      _tile_loadd(4, t0 + c * 256, 64);
      _tile_dpbusd(0, 2, 4);
      _tile_dpbusd(1, 3, 4);
      if (NP == 2) {
        _tile_loadd(7, t1 + c * 256, 64);
        _tile_dpbusd(5, 2, 7);
        _tile_dpbusd(6, 3, 7);
      }
    }
    for (int p = 0; p < NP; ++p) {
      if (p == 0) {
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[16], 64);
      } else {
        _tile_stored(5, sums[0], 64);
        _tile_stored(6, sums[16], 64);
      }
      const __m512 a = _mm512_loadu_ps(st + ((pass + p) * nb + b) * AMX_ROWS);
      for (int64_t o = 0; o < AMX_OUTS; ++o)
        _mm512_store_ps(acc[p][o], _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[o])), a,
                                                   _mm512_load_ps(acc[p][o])));
    }
  }
  for (int p = 0; p < NP; ++p) {
    const int64_t r0 = (pass + p) * AMX_ROWS, m = std::min(AMX_ROWS, rows - r0);
    write_rows(acc[p], offsets + r0, sp + o0, op + r0 * outs + o0, m, n_out, outs);
  }
}

template <typename S>
void w8a8_amx(const int8_t* xq, const float* xs, const float* offsets, const uint8_t* wp, const float* sp, S* op,
              int64_t rows, int64_t in, int64_t outs, int64_t block) {
  const int64_t nb = in / block, chunks = in / 64, per_block = block / 64;
  const int64_t groups = (outs + AMX_OUTS - 1) / AMX_OUTS, passes = (rows + AMX_ROWS - 1) / AMX_ROWS;
  // the inputs as tiles, per pass of 16 rows: per chunk of 64 inputs, 16 groups of 4 for each of 16 rows
  // (rows past the last are 0); and the block scales, rows along the vector
  std::vector<int32_t> xt(passes * chunks * 256);
  std::vector<float> st(passes * nb * AMX_ROWS);
  const int32_t* x4 = reinterpret_cast<const int32_t*>(xq);
  at::parallel_for(0, passes, 8, [&](int64_t begin, int64_t end) {  // a prompt's rows: both cores lay them out
    for (int64_t pass = begin; pass < end; ++pass) {
      int32_t* tiles = xt.data() + pass * chunks * 256;
      float* scales = st.data() + pass * nb * AMX_ROWS;
      const int64_t r0 = pass * AMX_ROWS, m = std::min(AMX_ROWS, rows - r0);
      if (m < AMX_ROWS) {
        std::fill(tiles, tiles + chunks * 256, 0);
        std::fill(scales, scales + nb * AMX_ROWS, 0.f);
      }
      for (int64_t n = 0; n < m; ++n) {
        const int32_t* row = x4 + (r0 + n) * (in / 4);
        for (int64_t k = 0; k < in / 4; ++k) tiles[(k / 16) * 256 + (k % 16) * 16 + n] = row[k];
        for (int64_t b = 0; b < nb; ++b) scales[b * AMX_ROWS + n] = xs[(r0 + n) * nb + b];
      }
    }
  });
  // a group's weights (32 outputs x in: 48 KB for 1,536 inputs) stay in the core's cache while every pass
  // of rows goes over them: a prompt's 512 rows read the weights from memory once, not once per 16 rows
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
    alignas(64) float acc[2][AMX_OUTS][16];
    std::vector<uint8_t> padded;
    for (int64_t g = begin; g < end; ++g) {
      const int64_t o0 = g * AMX_OUTS, n_out = std::min(AMX_OUTS, outs - o0);
      const uint8_t* w = wp + o0 * in;
      if (n_out < AMX_OUTS) {  // the last group: a copy padded with code 0
        padded.assign(AMX_OUTS * in, 128);
        std::copy(w, w + n_out * in, padded.begin());
        w = padded.data();
      }
      const uint8_t* next = g + 1 < end && o0 + 2 * AMX_OUTS <= outs ? wp + (o0 + AMX_OUTS) * in : nullptr;
      for (int64_t pass = 0; pass < passes; pass += 2) {
        const uint8_t* ahead = pass + 2 >= passes ? next : nullptr;  // fetched during the group's last passes
        if (pass + 1 < passes)
          amx_passes<2>(xt.data(), st.data(), w, ahead, offsets, sp, op, pass, rows, in, outs, o0, n_out, nb, chunks,
                        per_block, acc);
        else
          amx_passes<1>(xt.data(), st.data(), w, ahead, offsets, sp, op, pass, rows, in, outs, o0, n_out, nb, chunks,
                        per_block, acc);
      }
    }
    _tile_release();
  });
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
  TORCH_CHECK(weight.size(1) == in && scales.size(0) == outs && block > 0 && block % QSTEP == 0 && in % block == 0,
              "boosttune_native::w8a8_mm: shapes (", rows, ", ", in, ") x (", outs, ", ", weight.size(1), ") with ",
              scales.size(0), " scales and blocks of ", block, "; the block must divide in_features and be a "
              "multiple of ", QSTEP);
  const at::Tensor xc = x.contiguous(), w = weight.contiguous(), sc = scales.contiguous();
  at::Tensor out = at::empty({rows, outs}, x.options());
#if defined(BOOSTTUNE_W8A8_SIMD)
  std::vector<int8_t> q(rows * in);
  std::vector<float> xs(rows * (in / block)), offsets(rows);
  const int64_t nb = in / block;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {  // rows apart: the same codes on any split
    const int64_t n = end - begin;
    if (x.scalar_type() == at::kFloat)
      quantize_rows(xc.data_ptr<float>() + begin * in, n, in, block, q.data() + begin * in, xs.data() + begin * nb,
                    offsets.data() + begin);
    else
      quantize_rows(xc.data_ptr<c10::BFloat16>() + begin * in, n, in, block, q.data() + begin * in,
                    xs.data() + begin * nb, offsets.data() + begin);
  });
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
// fp32 arithmetic for bf16 or fp32 inputs; a row that sees no key gives zeros. AVX512 and AVX2 take 16 or 8
// keys and outputs at a time; on an AVX2-only EPYC a call for 8 tokens of a 150-token cache took 678 µs in
// scalar loops, 108 in vectors (eager, under torch's profiler).
#if defined(BOOSTTUNE_VEC)
inline Vec vexp(Vec x) {
  // e^x = 2^n e^r, n = round(x log2 e), r = x - n ln 2 (ln 2 in two parts), e^r by its Taylor polynomial
  // of degree 7 (|r| <= ln 2 / 2: relative error below 2e-7); 0 below -87 (e^-87 is near fp32's least
  // normal). For x <= 0, a softmax's shifted scores: n >= -126, so 2^n is a normal float (vscale2)
  const Vec lo = vset(-87.f);
  const Vec xc = vmax(x, lo);
  const Vec n = vround(vmul(xc, vset(1.44269504f)));
  Vec r = vfnma(n, vset(0.693145752f), xc);
  r = vfnma(n, vset(1.42860677e-6f), r);
  Vec p = vset(1.f / 5040.f);
  p = vfma(p, r, vset(1.f / 720.f));
  p = vfma(p, r, vset(1.f / 120.f));
  p = vfma(p, r, vset(1.f / 24.f));
  p = vfma(p, r, vset(1.f / 6.f));
  p = vfma(p, r, vset(0.5f));
  p = vfma(p, r, vset(1.f));
  p = vfma(p, r, vset(1.f));
  return vzero_below(x, lo, vscale2(p, n));
}
#endif

#if defined(__AVX512F__)
// The lane sums of 16 vectors: lane j of the result is v[j]'s sum, by the same tree of additions for every
// j (within each 128-bit lane (e0 + e2) + (e1 + e3), then (L0 + L1) + (L2 + L3)), so a key's dot does not
// depend on which keys share its chunk. Four levels of shuffles and adds for 16 sums, where
// _mm512_reduce_add_ps per vector took four each.
inline __m512 lane_sums(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sums of v[4i] .. v[4i + 3]
    u[i] = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[2 * i]), _mm512_castps_pd(t[2 * i + 1]))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[2 * i]), _mm512_castps_pd(t[2 * i + 1]))));
  constexpr int even = 0 | (2 << 2) | (0 << 4) | (2 << 6), odd = 1 | (3 << 2) | (1 << 4) | (3 << 6);
  for (int i = 0; i < 2; ++i)  // lanes L0 + L1 and L2 + L3 of u[2i], then of u[2i + 1]
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], even),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], odd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], even), _mm512_shuffle_f32x4(w[0], w[1], odd));
}
#elif defined(__AVX2__) && defined(__FMA__)
// The lane sums of 8 vectors by the same tree for every one: within each 128-bit half (e0 + e2) + (e1 + e3),
// then the low half plus the high one.
inline __m256 lane_sums(const __m256* v) {
  __m256 t[4], u[2];
  for (int i = 0; i < 4; ++i)  // per half: [a0 + a2, b0 + b2, a1 + a3, b1 + b3]
    t[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // per half: the half's sums of v[4i] .. v[4i + 3]
    u[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(t[2 * i]), _mm256_castps_pd(t[2 * i + 1]))),
                         _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(t[2 * i]), _mm256_castps_pd(t[2 * i + 1]))));
  return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}
#endif

// Rows of one (b, g) that see the same keys (a token's query heads, which share its kv head), attended
// together: each key and value is read once for all of them, and each row is computed by the same operations
// as alone (a set of one), so its output does not depend on which rows share its set.
constexpr int kMaxSet = 4;

struct AttendScratch {
  std::vector<float> qf, sc;
  std::vector<int64_t> idx;
};

template <int nq, typename T>
void attend_set(const T* const* q, const T* k, const T* v, int64_t key_stride, const bool* visible,
                int64_t keys, int64_t c, float scale, T* const* out, AttendScratch& s) {
  s.qf.resize(nq * c);
  for (int r = 0; r < nq; ++r)
    for (int64_t i = 0; i < c; ++i) s.qf[r * c + i] = static_cast<float>(q[r][i]);
  s.idx.clear();
  for (int64_t l = 0; l < keys; ++l)
    if (visible == nullptr || visible[l]) s.idx.push_back(l);
  const int64_t n = static_cast<int64_t>(s.idx.size()), np = (n + 15) / 16 * 16;
  if (n == 0) {
    for (int r = 0; r < nq; ++r)
      for (int64_t i = 0; i < c; ++i) out[r][i] = static_cast<T>(0.f);
    return;
  }
  s.sc.assign(nq * np, -std::numeric_limits<float>::infinity());  // row r's scores at r * np; padding: e = 0
  float* sc = s.sc.data();
  const float* qf = s.qf.data();
  const int64_t* idx = s.idx.data();
  int64_t done = 0;
#if defined(BOOSTTUNE_VEC)
  if (c % LANES == 0) {  // LANES keys at a time: per key and row one chain of products over the C inputs, then
    Vec parts[nq][LANES];  // lane_sums
    for (; done < n; done += LANES) {
      const int64_t nl = std::min<int64_t>(LANES, n - done);
      for (int64_t j = 0; j < LANES; ++j) {
        Vec a[nq];
        for (int r = 0; r < nq; ++r) a[r] = vzero();
        if (j < nl) {
          const T* kr = k + idx[done + j] * key_stride;
          for (int64_t i = 0; i < c; i += LANES) {
            const Vec kv = vload(kr + i);
            for (int r = 0; r < nq; ++r) a[r] = vfma(vload(qf + r * c + i), kv, a[r]);
          }
        }
        for (int r = 0; r < nq; ++r) parts[r][j] = a[r];
      }
      for (int r = 0; r < nq; ++r) {
        alignas(64) float res[LANES];
        vstore(res, vmul(lane_sums(parts[r]), vset(scale)));
        std::copy(res, res + nl, sc + r * np + done);
      }
    }
  }
#endif
  for (; done < n; ++done)
    for (int r = 0; r < nq; ++r) {
      const T* kr = k + idx[done] * key_stride;
      float dot = 0.f;
      for (int64_t i = 0; i < c; ++i) dot += qf[r * c + i] * static_cast<float>(kr[i]);
      sc[r * np + done] = dot * scale;
    }
  float inv[nq];
  for (int r = 0; r < nq; ++r) {  // a fixed-order softmax numerator and its sum, per row
    float* row = sc + r * np;
#if defined(BOOSTTUNE_VEC)
    Vec mv = vset(-std::numeric_limits<float>::infinity());  // the padding is -inf
    for (int64_t j = 0; j < np; j += LANES) mv = vmax(mv, vload(row + j));
    const Vec m = vset(vhmax(mv));
    Vec sv = vzero();
    for (int64_t j = 0; j < np; j += LANES) {
      const Vec e = vexp(vsub(vload(row + j), m));
      vstore(row + j, e);
      sv = vadd(sv, e);
    }
    inv[r] = 1.f / vsum(sv);
#else
    const float mx = *std::max_element(row, row + n);
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) sum += (row[j] = std::exp(row[j] - mx));
    inv[r] = 1.f / sum;
#endif
  }
  int64_t d0 = 0;
#if defined(BOOSTTUNE_VEC)
  // up to kV vectors of outputs of every row in registers (nq * kV accumulators: AVX2 has 16 registers,
  // AVX512 32), over the keys in order
  constexpr int kV = LANES == 16 || nq <= 2 ? 4 : 2;
  for (; c % LANES == 0 && d0 < c; d0 += kV * LANES) {
    const int nv = static_cast<int>(std::min<int64_t>(kV * LANES, c - d0) / LANES);
    Vec o[nq][kV];
    for (int r = 0; r < nq; ++r)
      for (int t = 0; t < nv; ++t) o[r][t] = vzero();
    for (int64_t j = 0; j < n; ++j) {
      const T* vr = v + idx[j] * key_stride + d0;
      Vec vv[kV];
      for (int t = 0; t < nv; ++t) vv[t] = vload(vr + LANES * t);
      for (int r = 0; r < nq; ++r) {
        const Vec e = vset(sc[r * np + j]);
        for (int t = 0; t < nv; ++t) o[r][t] = vfma(e, vv[t], o[r][t]);
      }
    }
    for (int r = 0; r < nq; ++r)
      for (int t = 0; t < nv; ++t) {
        alignas(64) float res[LANES];
        vstore(res, vmul(o[r][t], vset(inv[r])));
        for (int i = 0; i < LANES; ++i) out[r][d0 + LANES * t + i] = static_cast<T>(res[i]);
      }
  }
#endif
  for (; d0 < c; ++d0)
    for (int r = 0; r < nq; ++r) {
      float acc = 0.f;
      for (int64_t j = 0; j < n; ++j) acc += sc[r * np + j] * static_cast<float>(v[idx[j] * key_stride + d0]);
      out[r][d0] = static_cast<T>(acc * inv[r]);
    }
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
  const bool* mp = vis.defined() ? vis.data_ptr<bool>() : nullptr;
  // sets of up to kMaxSet rows of one (b, g) with equal masks (the heads of one token, folded per kv head
  // t rows apart), in the order of their first rows
  std::vector<std::array<int64_t, kMaxSet>> sets;
  std::vector<int> sizes;
  std::vector<char> taken(m);
  for (int64_t bg = 0; bg < b * g; ++bg) {
    std::fill(taken.begin(), taken.end(), 0);
    for (int64_t i = 0; i < m; ++i) {
      if (taken[i]) continue;
      std::array<int64_t, kMaxSet> set{};
      int n = 0;
      set[n++] = bg * m + i;
      for (int64_t j = i + 1; j < m && n < kMaxSet; ++j)
        if (!taken[j] && (mp == nullptr || std::memcmp(mp + (bg * m + j) * keys, mp + (bg * m + i) * keys, keys) == 0))
          taken[j] = 1, set[n++] = bg * m + j;
      sets.push_back(set);
      sizes.push_back(n);
    }
  }
  auto run = [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    const scalar_t* qp = qc.data_ptr<scalar_t>();
    const scalar_t* kp = kc.data_ptr<scalar_t>();
    const scalar_t* vp = vc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(sets.size()), 1, [&](int64_t begin, int64_t end) {
      AttendScratch scratch;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r0 = sets[i][0], nq = sizes[i], bi = r0 / (g * m), gi = (r0 / m) % g;
        const scalar_t* qs[kMaxSet];
        scalar_t* os[kMaxSet];
        for (int64_t r = 0; r < nq; ++r) qs[r] = qp + sets[i][r] * c, os[r] = op + sets[i][r] * c;
        const scalar_t* kb = kp + bi * sb + gi * sg;
        const scalar_t* vb = vp + bi * sb + gi * sg;
        const bool* visible = mp != nullptr ? mp + r0 * keys : nullptr;
        const float sf = static_cast<float>(scale);
        static_assert(kMaxSet == 4, "one case per set size");
        switch (nq) {  // the set size as a constant: its loops unrolled, its accumulators in registers
          case 1: attend_set<1>(qs, kb, vb, sl, visible, keys, c, sf, os, scratch); break;
          case 2: attend_set<2>(qs, kb, vb, sl, visible, keys, c, sf, os, scratch); break;
          case 3: attend_set<3>(qs, kb, vb, sl, visible, keys, c, sf, os, scratch); break;
          default: attend_set<4>(qs, kb, vb, sl, visible, keys, c, sf, os, scratch); break;
        }
      }
    });
  };
  if (q.scalar_type() == at::kFloat)
    run(static_cast<float*>(nullptr));
  else
    run(static_cast<c10::BFloat16*>(nullptr));
  return out;
}

// attend: attention where speed matters more than row independence (bf16, where no output is promised
// token-identical): attend_rows' kernel where each (b, g) feeds at most kAttendRows query rows (a token or a
// few per request, its heads folded in: it reads only the keys a row sees, and each key once per set of rows),
// else torch's (flash attention over blocks of rows, a tree's or a prompt's).
constexpr int64_t kAttendRows = 9;

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
                  double scale) {
  if (q.dim() == 4 && q.size(2) <= kAttendRows) return attend_rows(q, k, v, mask, scale);
  if (mask.has_value() && mask->defined() && mask->scalar_type() == at::kBool) {
    // an additive mask in q's dtype (0 where visible, -inf elsewhere), as a compiled graph lowers a bool
    // one: torch's flash attention takes it ~15 % faster than the bool mask it would convert itself
    const at::Tensor additive =
        at::zeros(mask->sizes(), q.options()).masked_fill_(mask->logical_not(), -std::numeric_limits<double>::infinity());
    return at::scaled_dot_product_attention(q, k, v, additive, 0.0, false, scale);
  }
  return at::scaled_dot_product_attention(q, k, v, mask, 0.0, false, scale);
}

at::Tensor attend_prompts(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& starts,
                          double scale) {
  // prompts fed one after another into empty caches: request b's rows starts[b] .. starts[b + 1] - 1 attend
  // causally over their own keys, one call of torch's flash attention each (its causal path skips the
  // blocks above the diagonal), where a pooled step pads every request to the longest prompt
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == 1 && k.sizes() == v.sizes() &&
              k.size(2) == q.size(2) && q.size(1) % k.size(1) == 0 && starts.dim() == 1 &&
              starts.scalar_type() == at::kLong, "boosttune_native::attend_prompts: q (1, Q, N, C), k and v (1, G, N, C) "
              "and (B + 1,) int64 starts expected; got q ", q.sizes(), ", k ", k.sizes(), ", starts ", starts.sizes());
  const int64_t rep = q.size(1) / k.size(1), n = q.size(2);
  const at::Tensor cuts = starts.cpu().contiguous();
  const int64_t* cut = cuts.data_ptr<int64_t>();
  TORCH_CHECK(cuts.numel() >= 1 && cut[0] == 0 && cut[cuts.numel() - 1] == n,
              "boosttune_native::attend_prompts: starts must run from 0 to the ", n, " rows");
  at::Tensor out = at::empty_like(q);
  for (int64_t b = 0; b + 1 < cuts.numel(); ++b) {
    const int64_t a = cut[b], t = cut[b + 1] - a;
    TORCH_CHECK(t >= 0, "boosttune_native::attend_prompts: starts must not decrease");
    if (t == 0) continue;
    const at::Tensor kb = k.narrow(2, a, t), vb = v.narrow(2, a, t);
    out.narrow(2, a, t).copy_(at::scaled_dot_product_attention(
        q.narrow(2, a, t), rep == 1 ? kb : kb.repeat_interleave(rep, 1), rep == 1 ? vb : vb.repeat_interleave(rep, 1),
        std::nullopt, 0.0, true, scale));
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
  m.def("w8a8_mm(Tensor x, Tensor weight, Tensor scales, int block) -> Tensor");
  m.def("w8a8_vectorised() -> bool", &w8a8_vectorised);
  m.def("w8a8_isa() -> str", &w8a8_isa);
  m.def("attend_rows(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
  m.def("attend_prompts(Tensor q, Tensor k, Tensor v, Tensor starts, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(boosttune_native, CPU, m) {
  m.impl("linear", &linear);
  m.impl("int8_mm", &int8_mm);
  m.impl("w8a8_mm", &w8a8_mm);
  m.impl("attend_rows", &attend_rows);
  m.impl("attend", &attend);
  m.impl("attend_prompts", &attend_prompts);
}
