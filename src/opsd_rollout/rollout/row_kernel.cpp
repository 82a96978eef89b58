// One row times a weight matrix on the CPU: y[o] = sum_i w[o, i] * x[i] for a float32 or bfloat16 weight
// [out, in] (row-major, contiguous) and an input x [in]. Each output row is one sequential read of its weight row,
// summed in float32 (a bfloat16 weight widened on the fly); the output rows are split across torch's intra-op
// threads, so every core streams its own band of the weight. Built on first use by rollout/row_kernel.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

inline float widen(float value) { return value; }

inline float widen(uint16_t bits) {  // bfloat16: the upper half of a float32
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

template <typename Weight>
void dot_rows(const Weight* __restrict weight, const float* __restrict x, float* __restrict y, int64_t begin,
              int64_t end, int64_t in) {
  for (int64_t row = begin; row < end; ++row) {
    const Weight* w = weight + row * in;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < in; ++i) sum += widen(w[i]) * x[i];
    y[row] = sum;
  }
}

torch::Tensor row_linear(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.device().is_cpu(),
              "row_linear: weight must be a contiguous 2-d CPU tensor");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 || weight.scalar_type() == torch::kBFloat16,
              "row_linear: weight must be float32 or bfloat16");
  const int64_t out = weight.size(0), in = weight.size(1);
  TORCH_CHECK(x.numel() == in, "row_linear: x has ", x.numel(), " elements, the weight ", in, " inputs");
  const torch::Tensor x32 = x.reshape({in}).to(torch::kFloat32).contiguous();
  torch::Tensor y = torch::empty({out}, x32.options());
  const float* xs = x32.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(in, 1));  // ~16K weights a task
  if (weight.scalar_type() == torch::kFloat32) {
    const float* w = weight.data_ptr<float>();
    at::parallel_for(0, out, grain, [&](int64_t begin, int64_t end) { dot_rows(w, xs, ys, begin, end, in); });
  } else {
    const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
    at::parallel_for(0, out, grain, [&](int64_t begin, int64_t end) { dot_rows(w, xs, ys, begin, end, in); });
  }
  return y.to(x.scalar_type());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("row_linear", &row_linear, "one row times a weight [out, in]"); }
