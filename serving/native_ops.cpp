// boosttune_native: the compiled forward's matrix products called without Python (serving/native.py builds
// and loads this file; serving/compiled.py uses it).
//
// A compiled forward calls each product of the LLM through one op that finds its weight by an integer
// key, so that the weights never enter the graph. Registered from Python, that op cost ~9 us per call on
// an AVX512-BF16 EPYC (211 calls per step of the default LLM); here it is a table lookup and a call
// through the dispatcher.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

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

}  // namespace

// put and drop are called from Python only (composite: any tensor, oneDNN's packed ones included); linear
// is a CPU kernel, so that a compiled graph can trace it through the fake kernel serving/native.py gives
TORCH_LIBRARY(boosttune_native, m) {
  m.def("put(Tensor weight, int key, bool packed) -> ()", &put);
  m.def("drop(int key) -> ()", &drop);
  m.def("linear(Tensor x, int key, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(boosttune_native, CPU, m) {
  m.impl("linear", &linear);
}
