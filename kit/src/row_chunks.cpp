#include <algorithm>
#include <atomic>
#include <mutex>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/kit/blocks.hpp"
#include "loom/kit/decoder_block.hpp"

namespace loom::kit {
namespace {

// A slice's [rows, units] intermediates: 256 MiB of one by default, a handful alive in a slice's backward.
std::atomic<std::int64_t> slice_bytes{std::int64_t{256} << 20};

at::Tensor state_of(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}
void restore(at::Generator gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

struct ChunkedMlp : torch::CustomClassHolder {
  std::function<at::Tensor(const at::Tensor&)> mlp;
  std::int64_t rows_per_chunk = 0;
  std::vector<at::Tensor> random;
};

// `mlp` over x's rows (all dimensions but the last) a slice at a time, into one output.
at::Tensor run_slices(const at::Tensor& x, const ChunkedMlp& run) {
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  const std::int64_t n = rows.size(0);
  at::Tensor out;
  for (std::int64_t start = 0; start < n; start += run.rows_per_chunk) {
    const std::int64_t len = std::min(run.rows_per_chunk, n - start);
    const at::Tensor y = run.mlp(rows.narrow(0, start, len));
    if (!out.defined()) out = at::empty({n, y.size(-1)}, y.options());
    out.narrow(0, start, len).copy_(y);
  }
  std::vector<std::int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(out.size(-1));
  return out.view(shape);
}

struct RowChunkedMlp : public torch::autograd::Function<RowChunkedMlp> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& anchor, c10::intrusive_ptr<ChunkedMlp> run) {
    (void)anchor;
    run->random = random_state(x.device());
    ctx->saved_data["run"] = c10::IValue::make_capsule(run);
    ctx->save_for_backward({x});
    return run_slices(x, *run);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto run = c10::static_intrusive_pointer_cast<ChunkedMlp>(ctx->saved_data["run"].toCapsule());
    const at::Tensor x = ctx->get_saved_variables().at(0);
    const bool wants_input = x.requires_grad();
    const at::Tensor rows = x.detach().reshape({-1, x.size(-1)});
    const at::Tensor upstream = grads.at(0).reshape({rows.size(0), -1});
    at::Tensor input_grad = wants_input ? at::empty_like(rows) : at::Tensor();
    const auto now = random_state(x.device());
    set_random_state(x.device(), run->random);
    for (std::int64_t start = 0; start < rows.size(0); start += run->rows_per_chunk) {
      const std::int64_t len = std::min(run->rows_per_chunk, rows.size(0) - start);
      const at::Tensor slice = rows.narrow(0, start, len).detach().set_requires_grad(wants_input);
      at::Tensor y;
      {
        torch::AutoGradMode grad(true);
        y = run->mlp(slice);
      }
      if (y.requires_grad()) torch::autograd::backward({y}, {upstream.narrow(0, start, len)});
      if (wants_input) {
        if (slice.grad().defined()) input_grad.narrow(0, start, len).copy_(slice.grad());
        else input_grad.narrow(0, start, len).zero_();
      }
    }
    set_random_state(x.device(), now);
    return {wants_input ? input_grad.view(x.sizes()) : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

std::vector<at::Tensor> random_state(const c10::Device& device) {
  std::vector<at::Tensor> out{state_of(at::detail::getDefaultCPUGenerator())};
  if (device.is_cuda()) out.push_back(state_of(at::globalContext().defaultGenerator(device)));
  return out;
}

void set_random_state(const c10::Device& device, const std::vector<at::Tensor>& state) {
  restore(at::detail::getDefaultCPUGenerator(), state.at(0));
  if (device.is_cuda() && state.size() > 1) restore(at::globalContext().defaultGenerator(device), state[1]);
}

void set_mlp_slice_bytes(std::int64_t bytes) { slice_bytes = std::max<std::int64_t>(1, bytes); }
std::int64_t mlp_slice_bytes() { return slice_bytes.load(); }

std::int64_t mlp_chunk_rows(std::int64_t units, std::int64_t value_bytes) {
  const std::int64_t rows = slice_bytes.load() / std::max<std::int64_t>(1, units * value_bytes);
  return std::max<std::int64_t>(128, rows / 128 * 128);
}

bool mlp_runs_in_chunks(std::int64_t rows, std::int64_t units, std::int64_t value_bytes) { return rows > 2 * mlp_chunk_rows(units, value_bytes); }

at::Tensor mlp_over_row_chunks(const at::Tensor& x, std::int64_t units, std::initializer_list<AdaptableLinear*> linears,
                               const std::function<at::Tensor(const at::Tensor&)>& mlp) {
  const std::int64_t rows = x.dim() == 0 ? 0 : x.numel() / std::max<std::int64_t>(1, x.size(-1));
  if (!mlp_runs_in_chunks(rows, units, static_cast<std::int64_t>(x.element_size()))) return mlp(x);
  auto run = c10::make_intrusive<ChunkedMlp>();
  run->mlp = mlp;
  run->rows_per_chunk = mlp_chunk_rows(units, static_cast<std::int64_t>(x.element_size()));
  if (!torch::GradMode::is_enabled() || (!x.requires_grad() && !any_trains(linears))) return run_slices(x, *run);
  // The anchor puts the function in the graph when only the weights train.
  static const at::Tensor anchor = at::zeros({}, at::kFloat).set_requires_grad(true);
  return RowChunkedMlp::apply(x, anchor, run);
}

}  // namespace loom::kit
