#include "loom/kit/quantize.hpp"

#include "loom/error.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <map>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/error.hpp"
#include "loom/kit/json.hpp"
#include "kernel_launch.hpp"
#include "quantize_kernels.hpp"

#ifdef LOOM_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace loom::kit {
namespace {

std::array<float, 16> make_nf4() {
  // The QLoRA paper's NF4 values (quantiles of N(0, 1) scaled to [-1, 1], with an exact zero).
  const double v[16] = {-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635, -0.18477343022823334,
                        -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0};
  std::array<float, 16> out{};
  for (int i = 0; i < 16; ++i) out[static_cast<std::size_t>(i)] = static_cast<float>(v[i]);
  return out;
}

// bitsandbytes' FP4: bit 3 the sign; bits 2-0 stand for 0, 0.0625, 8, 12, 4, 6, 2, 3 (over 12).
std::array<float, 8> fp4_magnitudes() {
  const double v[8] = {0, 0.0625, 8, 12, 4, 6, 2, 3};
  std::array<float, 8> out{};
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<float>(v[i] / 12.0);
  return out;
}

std::array<float, 16> make_fp4() {
  const auto m = fp4_magnitudes();
  std::array<float, 16> out{};
  for (int i = 0; i < 8; ++i) {
    out[static_cast<std::size_t>(i)] = m[static_cast<std::size_t>(i)];
    out[static_cast<std::size_t>(i + 8)] = -m[static_cast<std::size_t>(i)];
  }
  return out;
}

std::array<float, 256> make_map8(bool is_signed) {
  // For i = 0..6: 10^(i-6) times the midpoints of linspace(0.1, 1, 2^i + 1), and their negatives
  // (unsigned: linspace(0.1, 1, 2^(i+1) + 1), no negatives); then 0 and 1. In double, rounded once.
  std::vector<float> v = {0.0f, 1.0f};
  for (int i = 0; i < 7; ++i) {
    const int n = (1 << (is_signed ? i : i + 1)) + 1;
    std::vector<double> bounds;
    for (int k = 0; k < n; ++k) bounds.push_back(0.1 + (1.0 - 0.1) * k / (n - 1));
    for (int k = 0; k + 1 < n; ++k) {
      const auto x = static_cast<float>(std::pow(10.0, i - 6) * (bounds[static_cast<std::size_t>(k)] + bounds[static_cast<std::size_t>(k + 1)]) / 2.0);
      v.push_back(x);
      if (is_signed) v.push_back(-x);
    }
  }
  std::sort(v.begin(), v.end());
  std::array<float, 256> out{};
  std::copy(v.begin(), v.end(), out.begin());
  return out;
}

// The float32 midpoints of consecutive (ascending) values: a value above the k-th midpoint and not
// above the next takes code k + 1.
template <std::size_t N>
at::Tensor midpoints(const std::array<float, N>& ascending) {
  std::vector<float> t;
  for (std::size_t i = 0; i + 1 < N; ++i) t.push_back(static_cast<float>((static_cast<double>(ascending[i]) + ascending[i + 1]) / 2.0));
  return at::tensor(t, at::kFloat);
}

// The number of thresholds each x exceeds (strictly); NaN exceeds none.
at::Tensor count_above(const at::Tensor& x, const at::Tensor& thresholds) {
  return at::bucketize(x, thresholds.to(x.device()), /*out_int32=*/false, /*right=*/false).masked_fill(at::isnan(x), 0);
}

// x in blocks of `blocksize` (zero-padded), each scaled by the reciprocal of its absmax:
// {normalised [blocks, blocksize], absmax [blocks]}.
std::pair<at::Tensor, at::Tensor> normalise(const at::Tensor& flat, std::int64_t blocksize) {
  const auto n = flat.numel(), blocks = (n + blocksize - 1) / blocksize;
  at::Tensor padded = n == blocks * blocksize ? flat : at::cat({flat, at::zeros({blocks * blocksize - n}, flat.options())});
  const at::Tensor view = padded.view({blocks, blocksize});
  at::Tensor absmax = std::get<0>(view.abs().max(1));
  return {view * at::reciprocal(absmax).unsqueeze(1), absmax};
}

std::int64_t zero_code(QuantType type) { return type == QuantType::kNF4 ? 7 : 0; }

at::Tensor table_on(const std::array<float, 16>& values, const at::Device& device) {
  return at::tensor(std::vector<float>(values.begin(), values.end()), at::kFloat).to(device);
}

// The FP4 magnitudes' codes in ascending order of magnitude.
constexpr std::array<std::uint8_t, 8> kFp4CodeOfRank = {0, 1, 6, 7, 4, 5, 2, 3};

detail::QuantizeArgs quantize_args(QuantType type, std::int64_t blocksize) {
  detail::QuantizeArgs a;
  a.blocksize = blocksize;
  a.fp4 = type == QuantType::kFP4;
  a.pad_code = static_cast<std::uint8_t>(zero_code(type));
  if (!a.fp4) {
    const auto t = midpoints(code_values(QuantType::kNF4));
    std::copy(t.data_ptr<float>(), t.data_ptr<float>() + 15, a.thresholds);
    return a;
  }
  const auto magnitudes = fp4_magnitudes();
  std::array<float, 8> ascending{};
  for (std::size_t i = 0; i < 8; ++i) ascending[i] = magnitudes[kFp4CodeOfRank[i]];
  const auto t = midpoints(ascending);
  std::copy(t.data_ptr<float>(), t.data_ptr<float>() + 7, a.thresholds);
  std::copy(kFp4CodeOfRank.begin(), kFp4CodeOfRank.end(), a.fp4_code_of_rank);
  return a;
}

using launch::kernel_dtype;
#ifdef LOOM_WITH_CUDA
using launch::check_cuda;
using launch::current_stream;
#endif

// Fills absmax and packed from args.x on the CPU, in parallel over blocks and bytes.
void quantize_on_cpu(const detail::QuantizeArgs& a) {
  const auto blocks = (a.n + a.blocksize - 1) / a.blocksize;
  at::parallel_for(0, blocks, std::max<std::int64_t>(1, 16384 / a.blocksize), [&](std::int64_t b0, std::int64_t b1) {
    for (std::int64_t b = b0; b < b1; ++b) {
      float m = 0;
      for (std::int64_t i = b * a.blocksize, end = std::min(a.n, (b + 1) * a.blocksize); i < end; ++i) m = std::max(m, std::fabs(detail::input_at(a, i)));
      a.absmax[b] = m;
    }
  });
  at::parallel_for(0, (a.n + 1) / 2, 8192, [&](std::int64_t j0, std::int64_t j1) {
    for (std::int64_t j = j0; j < j1; ++j)
      a.packed[j] = detail::packed_byte(a, j, detail::input_at(a, 2 * j), 2 * j + 1 < a.n ? detail::input_at(a, 2 * j + 1) : 0.0f);
  });
}

// Writes n elements of `Stored` (float, or the 16 bits of a bfloat16 or half) on the CPU.
template <typename Stored, typename Convert>
void dequantize_on_cpu(const detail::DequantizeArgs& a, Stored* out, Convert convert) {
  at::parallel_for(0, a.n, 16384, [&](std::int64_t begin, std::int64_t end) {
    std::int64_t block = begin / a.blocksize, block_end = (block + 1) * a.blocksize;
    float scale = detail::block_scale(a, block);
    for (std::int64_t i = begin; i < end; ++i) {
      if (i >= block_end) {
        ++block;
        block_end += a.blocksize;
        scale = detail::block_scale(a, block);
      }
      out[i] = convert(detail::dequantized(a, i, scale));
    }
  });
}

}  // namespace

const char* quant_type_name(QuantType type) { return type == QuantType::kNF4 ? "nf4" : "fp4"; }

QuantType parse_quant_type(const std::string& name) {
  if (name == "nf4") return QuantType::kNF4;
  if (name == "fp4") return QuantType::kFP4;
  throw UserError("quant_type \"" + name + "\": use \"nf4\" or \"fp4\"");
}

const std::array<float, 16>& code_values(QuantType type) {
  static const std::array<float, 16> nf4 = make_nf4(), fp4 = make_fp4();
  return type == QuantType::kNF4 ? nf4 : fp4;
}

const std::array<float, 256>& dynamic_map_8bit() {
  static const std::array<float, 256> map = make_map8(true);
  return map;
}

namespace {
void adamw_8bit_on_cpu(const detail::AdamW8bitArgs& a) {
  constexpr int kBlock = detail::kAdam8Block;
  const std::int64_t blocks = (a.n + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 16, [&](std::int64_t b0, std::int64_t b1) {
    float m[kBlock], v[kBlock];
    for (std::int64_t b = b0; b < b1; ++b) {
      float m_max = 0, v_max = 0;
      for (int t = 0; t < kBlock; ++t) {
        const std::int64_t i = b * kBlock + t;
        m[t] = v[t] = 0;
        if (i < a.n) {
          m[t] = detail::mul_rn(a.signed_map[a.m_codes[i]], a.m_absmax[b]);
          v[t] = detail::mul_rn(a.unsigned_map[a.v_codes[i]], a.v_absmax[b]);
          detail::adam8_update(a, i, m[t], v[t]);
        }
        m_max = std::max(m_max, std::fabs(m[t]));
        v_max = std::max(v_max, std::fabs(v[t]));
      }
      for (int t = 0; t < kBlock; ++t) {
        a.m_codes[b * kBlock + t] = detail::adam8_code(a.signed_map, m[t], m_max);
        a.v_codes[b * kBlock + t] = detail::adam8_code(a.unsigned_map, v[t], v_max);
      }
      a.m_absmax[b] = m_max;
      a.v_absmax[b] = v_max;
    }
  });
}

// The two maps as float32 tensors on `device` (made once a device).
std::pair<at::Tensor, at::Tensor> adam8_maps_on(const at::Device& device) {
  static std::mutex mutex;
  static std::map<std::string, std::pair<at::Tensor, at::Tensor>> maps;
  std::lock_guard<std::mutex> lock(mutex);
  auto& m = maps[device.str()];
  if (!m.first.defined()) {
    const auto& s = dynamic_map_8bit();
    const auto& u = dynamic_map_8bit_unsigned();
    m = {at::tensor(std::vector<float>(s.begin(), s.end())).to(device), at::tensor(std::vector<float>(u.begin(), u.end())).to(device)};
  }
  return m;
}
}  // namespace

void adamw_8bit_step(const at::Tensor& weights, const at::Tensor& grad, const at::Tensor& m_codes, const at::Tensor& m_absmax, const at::Tensor& v_codes,
                     const at::Tensor& v_absmax, const AdamW8bitStep& step) {
  const std::int64_t n = weights.numel(), blocks = (n + detail::kAdam8Block - 1) / detail::kAdam8Block;
  const auto on = [&](const at::Tensor& t) { return t.device() == weights.device() && t.is_contiguous(); };
  if (weights.scalar_type() != at::kFloat || !weights.is_contiguous() || grad.numel() != n || !on(m_codes) || !on(v_codes) || !on(m_absmax) ||
      !on(v_absmax) || m_codes.scalar_type() != at::kByte || v_codes.scalar_type() != at::kByte || m_absmax.scalar_type() != at::kFloat ||
      v_absmax.scalar_type() != at::kFloat || m_codes.numel() != blocks * detail::kAdam8Block || v_codes.numel() != blocks * detail::kAdam8Block ||
      m_absmax.numel() != blocks || v_absmax.numel() != blocks)
    throw std::logic_error("adamw_8bit_step: weights, moments and gradient do not match");
  // The kernels read float32 and bfloat16 gradients as they are (float16 too on a GPU).
  at::Tensor g = grad.reshape({-1});
  const auto gt = g.scalar_type();
  if (!(gt == at::kFloat || gt == at::kBFloat16 || (gt == at::kHalf && g.is_cuda()))) g = g.to(at::kFloat);
  g = g.to(weights.device()).contiguous();
  const auto [signed_map, unsigned_map] = adam8_maps_on(weights.device());
  detail::AdamW8bitArgs a;
  a.weights = weights.data_ptr<float>();
  a.grad = g.data_ptr();
  a.grad_dtype = kernel_dtype(g.scalar_type());
  a.m_codes = m_codes.data_ptr<std::uint8_t>();
  a.m_absmax = m_absmax.data_ptr<float>();
  a.v_codes = v_codes.data_ptr<std::uint8_t>();
  a.v_absmax = v_absmax.data_ptr<float>();
  a.signed_map = signed_map.data_ptr<float>();
  a.unsigned_map = unsigned_map.data_ptr<float>();
  a.n = n;
  a.beta1 = static_cast<float>(step.beta1);
  a.beta2 = static_cast<float>(step.beta2);
  a.one_minus_beta1 = static_cast<float>(1 - step.beta1);
  a.one_minus_beta2 = static_cast<float>(1 - step.beta2);
  a.eps = static_cast<float>(step.eps);
  a.decay = static_cast<float>(1 - step.lr * step.weight_decay);
  a.step = static_cast<float>(step.lr / (1 - std::pow(step.beta1, static_cast<double>(step.t))));
  a.c2 = static_cast<float>(1 - std::pow(step.beta2, static_cast<double>(step.t)));
  if (weights.is_cuda()) {
#ifdef LOOM_WITH_CUDA
    const c10::cuda::CUDAGuard guard(weights.device());
    check_cuda(detail::adamw_8bit_cuda(a, current_stream(weights)), "adamw_8bit_step");
#else
    throw std::logic_error("adamw_8bit_step: CUDA tensors in a kit built without CUDA");
#endif
  } else {
    adamw_8bit_on_cpu(a);
  }
}

const std::array<float, 256>& dynamic_map_8bit_unsigned() {
  static const std::array<float, 256> map = make_map8(false);
  return map;
}

std::int64_t QuantizedTensor::numel() const {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}
std::int64_t QuantizedTensor::blocks() const { return (numel() + blocksize - 1) / blocksize; }

std::uint64_t QuantizedTensor::bytes() const {
  std::uint64_t b = 0;
  for (const auto* t : {&packed, &absmax, &nested_absmax, &nested_map})
    if (t->defined()) b += static_cast<std::uint64_t>(t->numel()) * t->element_size();
  return b + 16 * sizeof(float);  // the code table stored beside them
}

std::uint64_t quantized_bytes(std::int64_t in, std::int64_t out, std::int64_t blocksize, bool double_quant) {
  const auto n = static_cast<std::uint64_t>(in) * static_cast<std::uint64_t>(out);
  const auto blocks = (n + static_cast<std::uint64_t>(blocksize) - 1) / static_cast<std::uint64_t>(blocksize);
  std::uint64_t b = (n + 1) / 2 + 16 * 4;
  if (double_quant) b += blocks + (blocks + 255) / 256 * 4 + 256 * 4;
  else b += blocks * 4;
  return b;
}

QuantizedTensor quantize_4bit(const at::Tensor& w, QuantType type, std::int64_t blocksize, bool double_quant) {
  torch::NoGradGuard no_grad;
  if (blocksize < 16 || blocksize > 4096) throw UserError("blocksize " + std::to_string(blocksize) + ": use 16 to 4096");
  QuantizedTensor q;
  q.type = type;
  q.blocksize = blocksize;
  q.shape = w.sizes().vec();
  q.dtype = w.scalar_type();
  // The kernels read float32, bfloat16 and (on CUDA) half as they are: no float32 copy of a matrix.
  at::Tensor flat = w.detach().reshape({-1});
  const auto t = flat.scalar_type();
  if (!(t == at::kFloat || t == at::kBFloat16 || (t == at::kHalf && flat.is_cuda()))) flat = flat.to(at::kFloat);
  flat = flat.contiguous();
  const auto n = flat.numel();
  at::Tensor absmax = at::empty({(n + blocksize - 1) / blocksize}, flat.options().dtype(at::kFloat));
  q.packed = at::empty({(n + 1) / 2}, flat.options().dtype(at::kByte));
  auto args = quantize_args(type, blocksize);
  args.x = flat.data_ptr();
  args.dtype = kernel_dtype(flat.scalar_type());
  args.n = n;
  args.absmax = absmax.data_ptr<float>();
  args.packed = q.packed.data_ptr<std::uint8_t>();
  if (flat.is_cuda()) {
#ifdef LOOM_WITH_CUDA
    const c10::cuda::CUDAGuard guard(flat.device());
    check_cuda(detail::quantize_4bit_cuda(args, current_stream(flat)), "quantize_4bit");
#endif
  } else {
    quantize_on_cpu(args);
  }
  if (!double_quant) {
    q.absmax = absmax;
    return q;
  }
  q.offset = static_cast<float>(absmax.to(at::kDouble).sum().item<double>() / static_cast<double>(absmax.numel()));
  const auto& map = dynamic_map_8bit();
  static const at::Tensor map_thresholds = midpoints(map);
  auto [nested_normalised, nested_absmax] = normalise(absmax - q.offset, q.nested_blocksize);
  q.absmax = count_above(nested_normalised, map_thresholds).reshape({-1}).narrow(0, 0, absmax.numel()).to(at::kByte);
  q.nested_absmax = nested_absmax;
  q.nested_map = at::tensor(std::vector<float>(map.begin(), map.end()), at::kFloat).to(w.device());
  return q;
}

namespace launch {

detail::DequantizeArgs dequantize_args(const QuantizedTensor& q, std::vector<at::Tensor>& kept) {
  detail::DequantizeArgs a;
  a.n = q.numel();
  a.blocksize = q.blocksize;
  std::copy(code_values(q.type).begin(), code_values(q.type).end(), a.values);
  const auto contiguous = [&](const at::Tensor& t) -> const at::Tensor& { return kept.emplace_back(t.contiguous()); };
  a.packed = contiguous(q.packed).data_ptr<std::uint8_t>();
  if (q.double_quantized()) {
    a.absmax_codes = contiguous(q.absmax).data_ptr<std::uint8_t>();
    a.nested_absmax = contiguous(q.nested_absmax).data_ptr<float>();
    a.nested_map = contiguous(q.nested_map).data_ptr<float>();
    a.offset = q.offset;
    a.nested_blocksize = q.nested_blocksize;
  } else {
    a.absmax = contiguous(q.absmax).data_ptr<float>();
  }
  return a;
}

}  // namespace launch

using launch::dequantize_args;

at::Tensor dequantize_4bit(const QuantizedTensor& q, at::ScalarType dtype) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> kept;
  const detail::DequantizeArgs a = dequantize_args(q, kept);
  const at::Tensor packed = kept.front();
  // Other dtypes (double) go through float32, which holds every dequantized value exactly.
  const bool direct = dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
  at::Tensor out = at::empty(q.shape, packed.options().dtype(direct ? dtype : at::kFloat));
  if (packed.is_cuda()) {
#ifdef LOOM_WITH_CUDA
    const c10::cuda::CUDAGuard guard(packed.device());
    check_cuda(detail::dequantize_4bit_cuda(a, out.data_ptr(), kernel_dtype(out.scalar_type()), current_stream(packed)), "dequantize_4bit");
#endif
  } else if (out.scalar_type() == at::kBFloat16) {
    dequantize_on_cpu(a, static_cast<std::uint16_t*>(out.data_ptr()), detail::bfloat16_bits);
  } else if (out.scalar_type() == at::kHalf) {
    dequantize_on_cpu(a, out.data_ptr<at::Half>(), [](float v) { return at::Half(v); });
  } else {
    dequantize_on_cpu(a, out.data_ptr<float>(), [](float v) { return v; });
  }
  return direct ? out : out.to(dtype);
}

namespace {

// y = x W^T with W dequantized for the product only; backward dequantizes it again for the
// input's gradient (the frozen weight has none), so no full-precision copy outlives a product.
struct QuantizedLinear : public torch::autograd::Function<QuantizedLinear> {
  static const QuantizedTensor& weight_of(torch::autograd::AutogradContext* ctx) {
    return *reinterpret_cast<const QuantizedTensor*>(static_cast<std::intptr_t>(ctx->saved_data["weight"].toInt()));
  }
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, std::int64_t weight) {
    ctx->saved_data["weight"] = weight;
    return at::linear(x, dequantize_4bit(weight_of(ctx), x.scalar_type()));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const at::Tensor& g = grads[0];
    return {at::matmul(g, dequantize_4bit(weight_of(ctx), g.scalar_type())), at::Tensor()};
  }
};

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

constexpr const char* kQuantStatePrefix = "weight.quant_state.bitsandbytes__";

// bitsandbytes' quant_state of one weight: the JSON it stores as bytes beside the codes.
struct QuantState {
  QuantType type = QuantType::kNF4;
  std::int64_t blocksize = 64;
  std::vector<std::int64_t> shape;
  bool nested = false;
  float offset = 0;
  std::int64_t nested_blocksize = 256;
};

// Every value read with its range: a block size of 64.5 or 1e30, an offset no float holds, a type
// other than the one the tensor's name declares are refused, not rounded or decoded as another.
QuantState parse_quant_state(const std::string& text, const std::string& named_type) {
  const nlohmann::json doc = json::parse(text, "quant_state");
  const json::Value state(doc, "quant_state");
  QuantState q;
  const std::string type = state["quant_type"].string();
  if (type != named_type)
    state["quant_type"].fail("is " + json::quote(type) + " in the state of a tensor named ...bitsandbytes__" + named_type + "; the two must agree");
  q.type = parse_quant_type(type);
  q.blocksize = state["blocksize"].integer(16, 4096);
  const auto& shape = state["shape"].array();
  if (shape.size() != 2) state["shape"].fail("expected [out_features, in_features], found " + json::describe(shape));
  for (std::size_t i = 0; i < 2; ++i) q.shape.push_back(state["shape"][i].integer(1, std::int64_t{1} << 24));
  if (state.has("nested_offset")) {
    q.nested = true;
    const double offset = state["nested_offset"].number();
    // The mean of the block scales, which are magnitudes of weights.
    if (!(offset >= 0 && offset <= 65504)) state["nested_offset"].fail("expected the mean block scale, from 0 to 65504, found " + json::describe(doc["nested_offset"]));
    q.offset = static_cast<float>(offset);
    q.nested_blocksize = state.has("nested_blocksize") ? state["nested_blocksize"].integer(16, 4096) : 256;
  }
  return q;
}

}  // namespace

QuantizedWeight::QuantizedWeight(std::int64_t in, std::int64_t out, QuantType type, std::int64_t blocksize, bool double_quant,
                                 const at::TensorOptions& options, at::ScalarType compute)
    : in_(in), out_(out), double_quant_(double_quant), options_(options), compute_(compute) {
  q_.type = type;
  q_.blocksize = blocksize;
  q_.shape = {out, in};
  q_.dtype = options.dtype().toScalarType();
}

at::Tensor QuantizedWeight::forward(const at::Tensor& x, const at::Tensor& bias) {
  const at::Tensor input = x.scalar_type() == compute_ ? x : x.to(compute_);
  const at::Tensor b = !bias.defined() || bias.scalar_type() == compute_ ? bias : bias.to(compute_);
  at::Tensor y;
  if (!at::GradMode::is_enabled() || !input.requires_grad()) {
    y = linear_from_codes(input, q_);
    if (!y.defined()) y = at::linear(input, dequantize_4bit(q_, compute_), b);
    else if (b.defined()) y = y + b;
  } else {
    y = QuantizedLinear::apply(input, static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(&q_)));
    if (b.defined()) y = y + b;
  }
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

at::Tensor QuantizedWeight::dense() const { return dequantize_4bit(q_, options_.dtype().toScalarType()); }

void QuantizedWeight::add_(const at::Tensor&) {
  throw UserError("a 4-bit weight cannot take an adapter's update in place; merge into a dense copy of it (dense())");
}

std::vector<std::pair<std::string, at::Tensor>> QuantizedWeight::stored() {
  // bitsandbytes' keys and layout, so the folder loads in transformers with its quantization_config.
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (!filled_) return out;
  out.emplace_back("weight", q_.packed.view({-1, 1}));
  out.emplace_back("weight.absmax", q_.absmax);
  out.emplace_back("weight.quant_map", table_on(code_values(q_.type), q_.packed.device()));
  nlohmann::json state = {{"quant_type", quant_type_name(q_.type)},
                          {"blocksize", q_.blocksize},
                          {"dtype", q_.dtype == at::kBFloat16 ? "bfloat16" : q_.dtype == at::kHalf ? "float16" : "float32"},
                          {"shape", q_.shape}};
  if (q_.double_quantized()) {
    out.emplace_back("weight.nested_absmax", q_.nested_absmax);
    out.emplace_back("weight.nested_quant_map", q_.nested_map);
    state["nested_blocksize"] = q_.nested_blocksize;
    state["nested_dtype"] = "float32";
    state["nested_offset"] = q_.offset;
  }
  const std::string text = state.dump();
  out.emplace_back(std::string(kQuantStatePrefix) + quant_type_name(q_.type),
                   at::tensor(std::vector<std::uint8_t>(text.begin(), text.end()), at::kByte).to(q_.packed.device()));
  return out;
}

std::uint64_t QuantizedWeight::bytes() const { return filled_ ? q_.bytes() : quantized_bytes(in_, out_, q_.blocksize, double_quant_); }

void QuantizedWeight::assign(const std::string& suffix, const at::Tensor& value) {
  const auto device = options_.device();
  if (suffix == "weight" && value.is_floating_point()) {
    if (!parts_.empty()) throw UserError("is a floating-point weight beside 4-bit parts (" + parts_.front() + "): a checkpoint holds one or the other");
    if (value.sizes().vec() != q_.shape)
      throw UserError("has shape " + shape_text(value.sizes().vec()) + ", the config implies " + shape_text(q_.shape));
    // Quantized on the layer's device as soon as it is read: the full-precision tensor goes away.
    const auto type = q_.type;
    const auto blocksize = q_.blocksize;
    q_ = quantize_4bit(value.to(device, options_.dtype().toScalarType()), type, blocksize, double_quant_);
    filled_ = true;
    return;
  }
  // A checkpoint already in bitsandbytes' layout: keep its parts as stored.
  if (filled_) throw UserError("has a 4-bit part (" + suffix + ") beside a floating-point weight: a checkpoint holds one or the other");
  parts_.push_back(suffix);
  if (suffix == "weight") {
    if (value.scalar_type() != at::kByte) throw UserError("is stored as " + std::string(c10::toString(value.scalar_type())) + ", not as floats or 4-bit codes");
    q_.packed = value.reshape({-1}).to(device);
  } else if (suffix == "weight.absmax") {
    q_.absmax = value.reshape({-1}).to(device);
  } else if (suffix == "weight.nested_absmax") {
    q_.nested_absmax = value.reshape({-1}).to(device, at::kFloat);
  } else if (suffix == "weight.nested_quant_map") {
    q_.nested_map = value.reshape({-1}).to(device, at::kFloat);
  } else if (suffix == "weight.quant_map") {
    // Our code tables are bitsandbytes'; a different table is another format.
    const at::Tensor ours = table_on(code_values(q_.type), at::kCPU);
    if (value.numel() != 16 || !at::equal(value.reshape({-1}).to(at::kCPU, at::kFloat), ours))
      throw UserError("holds a quant_map that is not the " + std::string(quant_type_name(q_.type)) + " table");
  } else if (suffix.rfind(kQuantStatePrefix, 0) == 0) {
    const at::Tensor bytes = value.to(at::kCPU).contiguous();
    if (bytes.scalar_type() != at::kByte || bytes.numel() > (1 << 16)) throw UserError("quant_state is not a small byte tensor of JSON");
    const std::string text(reinterpret_cast<const char*>(bytes.data_ptr<std::uint8_t>()), static_cast<std::size_t>(bytes.numel()));
    const QuantState state = parse_quant_state(text, suffix.substr(std::strlen(kQuantStatePrefix)));
    if (state.shape != std::vector<std::int64_t>{out_, in_})
      throw UserError("quant_state shape " + shape_text(state.shape) + ", the config implies " + shape_text({out_, in_}));
    q_.type = state.type;
    q_.blocksize = state.blocksize;
    if (state.nested) {
      q_.offset = state.offset;
      q_.nested_blocksize = state.nested_blocksize;
    }
  } else {
    throw UserError("is not a part of a 4-bit weight loom knows (" + suffix + ")");
  }
}

void QuantizedWeight::finish_load(const std::string& name) {
  if (filled_) return;
  const auto has = [&](const std::string& part) { return std::find(parts_.begin(), parts_.end(), part) != parts_.end(); };
  const bool state = std::any_of(parts_.begin(), parts_.end(), [](const std::string& p) { return p.rfind(kQuantStatePrefix, 0) == 0; });
  std::string missing;
  for (const char* part : {"weight", "weight.absmax"})
    if (!has(part)) missing += std::string(missing.empty() ? "" : ", ") + name + "." + part;
  if (!state) missing += std::string(missing.empty() ? "" : ", ") + name + "." + kQuantStatePrefix + quant_type_name(q_.type);
  if (!missing.empty()) throw UserError("the checkpoint lacks " + missing);
  auto& q = q_;
  const bool nested = q.absmax.scalar_type() == at::kByte;
  if (nested && (!q.nested_absmax.defined() || !q.nested_map.defined()))
    throw UserError(name + ": a double-quantized absmax needs weight.nested_absmax and weight.nested_quant_map");
  const auto n = q.numel(), blocks = q.blocks();
  const bool sizes_fit = q.packed.numel() == (n + 1) / 2 && q.absmax.numel() == blocks &&
                         (!nested || (q.nested_map.numel() == 256 && q.nested_absmax.numel() == (blocks + q.nested_blocksize - 1) / q.nested_blocksize));
  if (!sizes_fit) throw UserError(name + ": the 4-bit parts' sizes do not fit a " + shape_text(q.shape) + " weight in blocks of " + std::to_string(q.blocksize));
  if (!nested) {
    q.absmax = q.absmax.to(at::kFloat);
    q.nested_absmax = at::Tensor();
  }
  filled_ = true;
}

at::Tensor dequantize_mxfp4(const at::Tensor& blocks, const at::Tensor& scales, at::ScalarType dtype) {
  if (blocks.scalar_type() != at::kByte || scales.scalar_type() != at::kByte)
    throw UserError("MXFP4 blocks and scales are bytes (U8); found " + std::string(c10::toString(blocks.scalar_type())) + " and " +
                    c10::toString(scales.scalar_type()));
  if (blocks.dim() < 2 || blocks.size(-1) != 16 || scales.dim() != blocks.dim() - 1 || scales.sizes() != blocks.sizes().slice(0, blocks.dim() - 1))
    throw UserError("MXFP4 blocks " + shape_text(blocks.sizes().vec()) + " and scales " + shape_text(scales.sizes().vec()) +
                    " do not match: blocks are [..., groups, 16] and scales [..., groups]");
  // E2M1: sign, two exponent bits, one mantissa bit (OCP Microscaling Formats v1.0).
  static const float kCodes[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  const at::Tensor table = at::from_blob(const_cast<float*>(kCodes), {16}, at::kFloat).to(blocks.device());
  const at::Tensor bytes = blocks.to(at::kLong);
  const at::Tensor codes = at::stack({at::remainder(bytes, 16), at::div(bytes, 16, "floor")}, -1).flatten(-2);  // [..., G, 32]
  const at::Tensor exponent = scales.to(at::kInt) - 127;
  const at::Tensor values = table.index({codes}) * at::pow(2.0, exponent.to(at::kFloat)).unsqueeze(-1);
  return values.flatten(-2).to(dtype);
}

}  // namespace loom::kit
