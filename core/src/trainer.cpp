#include "trainer.hpp"

#include <chrono>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "data.hpp"
#include "generate.hpp"
#include "loom/atomic_file.hpp"
#include "loom/error.hpp"
#include "loom/input_file.hpp"
#include "loom/json.hpp"
#include "loom/safetensors.hpp"
#include "loom/torch_compat.hpp"

namespace loom::core {
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;

// The first SIGTERM/SIGINT received while training (see StopOnSignal), or 0.
std::atomic<int> stop_signal{0};

struct Settings {
  std::int64_t batch_size, grad_accum, max_steps, epochs, warmup, log_every, eval_every, eval_samples, max_new_tokens, checkpoint_every;
  double lr, weight_decay, beta1, beta2, eps, max_grad_norm;
  std::string scheduler;
  std::uint64_t seed;
  DType dtype;
  CollateSettings collate;
  bool shuffle;
};

Settings read_settings(const PipelineSpec& spec) {
  const auto& t = spec.section("train").options;
  const auto& d = spec.section("data").options;
  Settings s;
  s.batch_size = t.get_int("batch_size");
  s.grad_accum = t.get_int("grad_accum");
  s.max_steps = t.get_int("max_steps");
  s.epochs = t.get_int("epochs");
  s.warmup = t.get_int("warmup_steps");
  s.log_every = t.get_int("log_every");
  s.eval_every = t.get_int("eval_every");
  s.eval_samples = t.get_int("eval_samples");
  s.max_new_tokens = t.get_int("max_new_tokens");
  s.checkpoint_every = t.get_int("checkpoint_every");
  s.lr = t.get_float("lr");
  s.weight_decay = t.get_float("weight_decay");
  s.beta1 = t.get_float("adam_beta1");
  s.beta2 = t.get_float("adam_beta2");
  s.eps = t.get_float("adam_epsilon");
  s.max_grad_norm = t.get_float("max_grad_norm");
  s.scheduler = t.get_string("scheduler");
  s.seed = static_cast<std::uint64_t>(spec.section("run").options.get_int("seed"));
  s.dtype = parse_dtype(spec.section("run").options.get_string("dtype"));
  s.collate = collate_settings(spec);
  s.shuffle = d.get_bool("shuffle");
  return s;
}

double learning_rate(const Settings& s, std::int64_t step, std::int64_t total) {
  if (s.warmup > 0 && step < s.warmup) return s.lr * static_cast<double>(step + 1) / static_cast<double>(s.warmup);
  if (s.scheduler == "constant") return s.lr;
  const double progress = total > s.warmup ? static_cast<double>(step - s.warmup) / static_cast<double>(total - s.warmup) : 1.0;
  if (s.scheduler == "linear") return s.lr * std::max(0.0, 1.0 - progress);
  return s.lr * 0.5 * (1.0 + std::cos(std::acos(-1.0) * std::min(1.0, progress)));
}

// AdamW with fp32 moments and, for bf16/fp16 parameters, an fp32 master copy, so small updates
// are not lost to rounding. Its whole state goes into checkpoints.
class AdamW {
 public:
  explicit AdamW(std::vector<NamedParameter> params) : params_(std::move(params)) {
    torch::NoGradGuard no_grad;
    for (auto& p : params_) {
      m_.push_back(at::zeros_like(p.tensor, p.tensor.options().dtype(at::kFloat)));
      v_.push_back(at::zeros_like(p.tensor, p.tensor.options().dtype(at::kFloat)));
      master_.push_back(p.tensor.scalar_type() == at::kFloat ? at::Tensor() : p.tensor.detach().to(at::kFloat));
    }
  }

  // One fused (foreach) update per device and dtype group instead of a handful of kernels per
  // tensor: a LoRA run has hundreds of small tensors.
  void step(double lr, const Settings& s) {
    torch::NoGradGuard no_grad;
    ++t_;
    const double c1 = 1 - std::pow(s.beta1, static_cast<double>(t_)), c2 = 1 - std::pow(s.beta2, static_cast<double>(t_));
    std::map<std::string, std::vector<std::size_t>> groups;
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (params_[i].tensor.grad().defined()) groups[params_[i].tensor.device().str()].push_back(i);
    for (const auto& [device, members] : groups) {
      std::vector<at::Tensor> w, g, m, v;
      for (auto i : members) {
        w.push_back(master_[i].defined() ? master_[i] : params_[i].tensor);
        g.push_back(params_[i].tensor.grad().to(at::kFloat));
        m.push_back(m_[i]);
        v.push_back(v_[i]);
      }
      if (s.weight_decay > 0) at::_foreach_mul_(w, 1 - lr * s.weight_decay);
      at::_foreach_mul_(m, s.beta1);
      at::_foreach_add_(m, g, 1 - s.beta1);
      at::_foreach_mul_(v, s.beta2);
      at::_foreach_addcmul_(v, g, g, 1 - s.beta2);
      auto denom = at::_foreach_div(v, c2);
      at::_foreach_sqrt_(denom);
      at::_foreach_add_(denom, s.eps);
      at::_foreach_addcdiv_(w, m, denom, -lr / c1);
      for (auto i : members)
        if (master_[i].defined()) params_[i].tensor.copy_(master_[i]);
    }
  }

  // The gradients, by device: a foreach kernel takes the tensors of one device.
  std::map<std::string, std::vector<at::Tensor>> grads_by_device() const {
    std::map<std::string, std::vector<at::Tensor>> groups;
    for (const auto& p : params_)
      if (p.tensor.grad().defined()) groups[p.tensor.device().str()].push_back(p.tensor.grad());
    return groups;
  }

  // The global L2 norm of all gradients, with one host sync per device.
  double grad_norm() const {
    double squares = 0;
    for (const auto& [device, grads] : grads_by_device()) {
      const auto norms = at::_foreach_norm(grads, 2);
      squares += at::stack(norms).to(at::kFloat).pow(2).sum().item<double>();
    }
    return std::sqrt(squares);
  }

  void zero_grad() {
    for (auto& p : params_)
      if (p.tensor.grad().defined()) p.tensor.mutable_grad() = at::Tensor();
  }

  std::vector<NamedParameter>& params() { return params_; }
  std::int64_t steps_taken() const { return t_; }

  void save(std::vector<std::pair<std::string, at::Tensor>>& out) const {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      out.emplace_back("param." + std::to_string(i), master_[i].defined() ? master_[i] : params_[i].tensor);
      out.emplace_back("adam_m." + std::to_string(i), m_[i]);
      out.emplace_back("adam_v." + std::to_string(i), v_[i]);
    }
  }

  void load(const SafetensorsFile& f, std::int64_t steps) {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const auto key = std::to_string(i);
      const at::Tensor saved = f.tensor("param." + key);
      if (saved.sizes() != params_[i].tensor.sizes())
        throw UserError(f.path().string() + ": parameter " + params_[i].name + " has another shape than in this run");
      if (master_[i].defined()) master_[i].copy_(saved);
      params_[i].tensor.copy_(saved);
      m_[i].copy_(f.tensor("adam_m." + key));
      v_[i].copy_(f.tensor("adam_v." + key));
    }
    t_ = steps;
  }

 private:
  std::vector<NamedParameter> params_;
  std::vector<at::Tensor> m_, v_, master_;
  std::int64_t t_ = 0;
};

struct Cursor {
  std::uint64_t epoch = 0;
  std::size_t index = 0;
};

// A slice of rows at a time: each slice's fp32 copy stays near 64 MiB.
std::int64_t loss_rows_per_slice(std::int64_t vocab) { return std::max<std::int64_t>(1, (std::int64_t{16} << 20) / std::max<std::int64_t>(vocab, 1)); }

// The slices of [B, T - 1] rows the loss visits: whole batch rows when they fit, else runs of
// positions within one batch row. Each is a view of the logits; its fp32 copy stays small.
struct Slice {
  std::int64_t b, nb, t, nt;
};
std::vector<Slice> loss_slices(std::int64_t batch, std::int64_t positions, std::int64_t vocab) {
  const auto rows = loss_rows_per_slice(vocab);
  std::vector<Slice> out;
  if (positions <= 0) return out;
  if (positions <= rows) {
    const auto nb = std::max<std::int64_t>(1, rows / positions);
    for (std::int64_t b = 0; b < batch; b += nb) out.push_back({b, std::min(nb, batch - b), 0, positions});
  } else {
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t t = 0; t < positions; t += rows) out.push_back({b, 1, t, std::min(rows, positions - t)});
  }
  return out;
}

struct NextTokenLoss : public torch::autograd::Function<NextTokenLoss> {
  static at::Tensor view(const at::Tensor& x, const Slice& s) { return x.narrow(0, s.b, s.nb).narrow(1, s.t, s.nt); }

  // logits [B, T, V]; targets [B, T - 1] (the labels shifted left), long, on the logits' device.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets) {
    const auto vocab = logits.size(2);
    at::Tensor lse = at::empty(targets.sizes(), logits.options().dtype(at::kFloat));
    at::Tensor total = at::zeros({}, logits.options().dtype(at::kFloat));
    for (const auto& s : loss_slices(logits.size(0), targets.size(1), vocab)) {
      const at::Tensor z = view(logits, s).to(at::kFloat).reshape({-1, vocab});
      const at::Tensor target = view(targets, s).reshape({-1});
      const at::Tensor l = at::logsumexp(z, -1);
      view(lse, s).copy_(l.view({s.nb, s.nt}));
      const at::Tensor picked = z.gather(1, target.clamp_min(0).unsqueeze(1)).squeeze(1);
      total += ((l - picked) * (target != -100)).sum();
    }
    ctx->save_for_backward({logits, targets, lse});
    return total;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &logits = saved[0], &targets = saved[1], &lse = saved[2];
    const auto vocab = logits.size(2);
    const at::Tensor scale = grads[0].to(at::kFloat);
    at::Tensor grad = at::zeros_like(logits);  // the last position predicts nothing: zero
    for (const auto& s : loss_slices(logits.size(0), targets.size(1), vocab)) {
      const at::Tensor target = view(targets, s).reshape({-1});
      // d(lse - z[target])/dz = softmax(z) - onehot(target), for counted rows.
      at::Tensor g = (view(logits, s).to(at::kFloat).reshape({-1, vocab}) - view(lse, s).reshape({-1, 1})).exp_();
      g.scatter_add_(1, target.clamp_min(0).unsqueeze(1), at::full({target.size(0), 1}, -1.0, g.options()));
      g.mul_((target != -100).to(at::kFloat).unsqueeze(1) * scale);
      view(grad, s).copy_(g.view({s.nb, s.nt, vocab}));
    }
    return {grad, at::Tensor()};
  }
};

std::string fixed(double v, int digits) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(digits) << v;
  return s.str();
}

std::string duration(double seconds) {
  const auto s = static_cast<long>(seconds + 0.5);
  char buf[32];
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%ldh%02ldm", s / 3600, (s % 3600) / 60);
  else std::snprintf(buf, sizeof buf, "%ldm%02lds", s / 60, s % 60);
  return buf;
}

class Run {
 public:
  Run(Session& session, const Plan& plan, fs::path out_dir) : session_(session), out_(std::move(out_dir)), s_(read_settings(session.spec)) {
    const auto& data = session.spec.section("data").options;
    const bool skip = data.get_string("on_bad_line") == "skip";
    train_ = load_jsonl(data.get_string("train"), data.get_string("format"), skip);
    if (data.has("eval")) eval_ = load_jsonl(data.get_string("eval"), data.get_string("format"), skip);
    if (s_.dtype == DType::kFloat16)
      for (const auto& b : plan.blocks)
        if (b.device == "cpu")
          throw UserError("[run] dtype = \"fp16\" needs every block on a CUDA device (block " + b.block +
                          " is on the cpu); use \"bf16\" or \"fp32\" on the CPU");
    at::manual_seed(s_.seed);
    executor_ = load_executor(*session.model, plan, s_.dtype, s_.seed, session.spec.section("run").options.get_bool("check_devices"));
    // The base is frozen whenever an adapter trains; without one every weight trains.
    std::vector<NamedParameter> trainable;
    for (auto& p : executor_->model().parameters()) p.tensor.set_requires_grad(!session.adapter);
    if (session.adapter) trainable = session.adapter->attach(executor_->model(), s_.seed);
    else trainable = executor_->model().parameters();
    optimizer_ = std::make_unique<AdamW>(std::move(trainable));
    const auto per_step = static_cast<std::size_t>(s_.batch_size * s_.grad_accum);
    total_steps_ = s_.max_steps > 0 ? s_.max_steps
                                    : static_cast<std::int64_t>((train_.samples.size() * static_cast<std::size_t>(s_.epochs) + per_step - 1) / per_step);
    order_ = epoch_order(train_.samples.size(), s_.seed, 0, s_.shuffle);
    if (s_.dtype == DType::kFloat16) loss_scale_ = 65536.0;
  }

  TrainReport run(bool resume, const std::function<void()>& first_step_done) {
    fs::create_directories(out_ / "checkpoints");
    std::int64_t step = resume ? restore() : 0;
    if (!resume) write_file_atomically(out_ / "metrics.jsonl", "");
    std::uint64_t trainable = 0;
    for (const auto& p : optimizer_->params()) trainable += static_cast<std::uint64_t>(p.tensor.numel());
    spdlog::info("training {} steps from step {}: {} samples, {} trainable parameters, batch {} x {} accumulation", total_steps_, step,
                 train_.samples.size(), trainable, s_.batch_size, s_.grad_accum);
    const auto started = Clock::now();
    std::int64_t tokens_since = 0;
    auto window = Clock::now();
    double loss_sum = 0;
    std::int64_t loss_count = 0;
    for (; step < total_steps_; ++step) {
      const auto [loss, tokens] = train_step(step);
      tokens_since += tokens;
      loss_sum += loss;
      ++loss_count;
      last_loss_ = loss;
      const bool last = step + 1 == total_steps_;
      if ((step + 1) % s_.log_every == 0 || last) {
        const double seconds = std::chrono::duration<double>(Clock::now() - window).count();
        const double rate = seconds > 0 ? static_cast<double>(tokens_since) / seconds : 0;
        const double elapsed = std::chrono::duration<double>(Clock::now() - started).count();
        const double eta = elapsed / static_cast<double>(step + 1 - first_step_) * static_cast<double>(total_steps_ - step - 1);
        const double mean = loss_sum / static_cast<double>(loss_count);
        nlohmann::json row = {{"step", step + 1}, {"loss", mean}, {"lr", learning_rate(s_, step, total_steps_)}, {"tokens_per_s", rate},
                              {"skipped_samples", skipped_}};
        for (const auto& d : executor_->devices())
          if (d.is_cuda())
            if (auto peak = compat::cuda_peak_allocated(d.index())) row["peak_memory_bytes"][d.str()] = *peak;
        log_metrics(row);
        std::cout << "step " << step + 1 << "/" << total_steps_ << "  loss " << fixed(mean, 4) << "  lr " << std::scientific
                  << std::setprecision(2) << learning_rate(s_, step, total_steps_) << std::defaultfloat << "  " << fixed(rate, 0)
                  << " tok/s  eta " << duration(eta) << std::endl;
        tokens_since = 0;
        loss_sum = 0;
        loss_count = 0;
        window = Clock::now();
      }
      if (step == first_step_ && first_step_done) first_step_done();
      if (s_.eval_every > 0 && (step + 1) % s_.eval_every == 0 && !last) evaluate(step + 1);
      const bool checkpointed = s_.checkpoint_every > 0 && (step + 1) % s_.checkpoint_every == 0;
      if (checkpointed) checkpoint(step + 1);
      if (const int signal = stop_signal.load(); signal != 0 && !last) {
        if (!checkpointed) checkpoint(step + 1);
        TrainReport report;
        report.steps = step + 1;
        report.final_loss = last_loss_;
        report.stopped_by = signal;
        return report;
      }
    }
    TrainReport report;
    report.steps = total_steps_;
    report.final_loss = last_loss_;
    if (!eval_.samples.empty()) {
      const auto [loss, em, n] = evaluate(total_steps_);
      report.eval_loss = loss;
      report.exact_match = em;
      report.exact_match_samples = n;
    }
    report.skipped_samples = skipped_;
    report.skipped_lines = train_.skipped_lines + eval_.skipped_lines;
    if (session_.adapter) {
      report.adapter_dir = out_ / "adapter";
      session_.adapter->save(executor_->model(), report.adapter_dir);
      if (session_.spec.section("adapter").options.get_bool("merge")) {
        session_.adapter->merge(executor_->model());
        report.merged_dir = out_ / "merged";
        executor_->model().save_pretrained(report.merged_dir);
      }
    } else {
      report.merged_dir = out_ / "model";
      executor_->model().save_pretrained(report.merged_dir);
    }
    return report;
  }

 private:
  std::vector<std::string> next_samples(std::size_t count) {
    std::vector<std::string> out;
    while (out.size() < count) {
      if (cursor_.index >= order_.size()) {
        ++cursor_.epoch;
        cursor_.index = 0;
        order_ = epoch_order(train_.samples.size(), s_.seed, cursor_.epoch, s_.shuffle);
      }
      out.push_back(train_.samples[order_[cursor_.index++]]);
    }
    return out;
  }

  struct Tensors {
    at::Tensor ids, mask, labels, positions;
  };

  static Tensors to_tensors(const Batch& b) {
    Tensors t;
    t.ids = at::tensor(b.input_ids, at::kLong).view({b.rows, b.cols});
    t.mask = at::tensor(b.attention_mask, at::kLong).view({b.rows, b.cols});
    t.labels = at::tensor(b.labels, at::kLong).view({b.rows, b.cols});
    t.positions = (t.mask.cumsum(1) - 1).clamp_min(0);
    return t;
  }

  // Tokens that carry a next-token label, counted on the CPU batch (no device sync).
  static std::int64_t label_count(const Tensors& t) {
    return (t.labels.narrow(1, 1, t.labels.size(1) - 1) != -100).sum().item<std::int64_t>();
  }

  // Summed next-token cross-entropy, on the logits' device. The labels are copied there before the
  // forward pass is queued: a copy from host memory waits for its device to drain, which after the
  // forward would leave the GPU idle while the host starts the backward pass.
  at::Tensor loss_sum(const Tensors& t) {
    const at::Tensor labels = t.labels.to(executor_->head_device());
    return next_token_loss_sum(executor_->forward(t.ids, t.positions, t.mask), labels);
  }

  std::pair<double, std::int64_t> train_step(std::int64_t step) {
    executor_->model().set_training(true);
    std::vector<Tensors> micro;
    std::int64_t label_tokens = 0, tokens = 0;
    for (std::int64_t i = 0; i < s_.grad_accum; ++i) {
      const Batch b = session_.collator->collate(next_samples(static_cast<std::size_t>(s_.batch_size)), *session_.tokenizer, s_.collate);
      skipped_ += static_cast<std::size_t>(b.skipped);
      if (b.rows == 0) continue;
      micro.push_back(to_tensors(b));
      label_tokens += label_count(micro.back());
      tokens += micro.back().mask.sum().item<std::int64_t>();
    }
    if (label_tokens == 0)
      throw UserError("step " + std::to_string(step + 1) + ": the collator kept no sample with labels of the " +
                      std::to_string(s_.batch_size * s_.grad_accum) + " drawn (" + std::to_string(skipped_) +
                      " skipped so far: no response template, or too long for [data] max_length); check the data against the [collator] "
                      "templates");
    // The loss is read back once, after every backward pass has been queued, so the host does not
    // wait for the forward pass before launching the backward one.
    at::Tensor total;
    for (const auto& t : micro) {
      const at::Tensor scaled = loss_sum(t) / static_cast<double>(label_tokens);
      torch::autograd::backward({loss_scale_ != 1.0 ? scaled * loss_scale_ : scaled});
      total = total.defined() ? total + scaled.detach() : scaled.detach();
    }
    const double loss = total.item<double>();
    if (!finish_step(step)) spdlog::warn("step {}: gradients overflowed at loss scale {}; step skipped, scale halved", step + 1, loss_scale_ * 2);
    return {loss, tokens};
  }

  // Unscales, checks, clips and applies the gradients. False when fp16 overflowed.
  bool finish_step(std::int64_t step) {
    torch::NoGradGuard no_grad;
    if (loss_scale_ != 1.0)
      for (auto& [device, grads] : optimizer_->grads_by_device()) at::_foreach_div_(grads, loss_scale_);
    const double norm = optimizer_->grad_norm();
    if (!std::isfinite(norm)) {
      optimizer_->zero_grad();
      if (s_.dtype != DType::kFloat16) throw UserError("step " + std::to_string(step + 1) + ": the gradients are not finite; lower [train] lr");
      loss_scale_ /= 2;
      good_steps_ = 0;
      return false;
    }
    if (s_.max_grad_norm > 0 && norm > s_.max_grad_norm)
      for (auto& [device, grads] : optimizer_->grads_by_device()) at::_foreach_mul_(grads, s_.max_grad_norm / (norm + 1e-6));
    optimizer_->step(learning_rate(s_, step, total_steps_), s_);
    optimizer_->zero_grad();
    if (s_.dtype == DType::kFloat16 && ++good_steps_ % 2000 == 0) loss_scale_ *= 2;
    return true;
  }

  std::tuple<double, double, std::int64_t> evaluate(std::int64_t step) {
    torch::NoGradGuard no_grad;
    executor_->model().set_training(false);
    std::vector<std::string> samples = eval_.samples;
    if (s_.eval_samples > 0 && samples.size() > static_cast<std::size_t>(s_.eval_samples)) samples.resize(static_cast<std::size_t>(s_.eval_samples));
    double loss = 0;
    std::int64_t label_tokens = 0;
    for (std::size_t i = 0; i < samples.size(); i += static_cast<std::size_t>(s_.batch_size)) {
      const std::vector<std::string> chunk(samples.begin() + static_cast<std::ptrdiff_t>(i),
                                           samples.begin() + static_cast<std::ptrdiff_t>(std::min(samples.size(), i + static_cast<std::size_t>(s_.batch_size))));
      const Batch b = session_.collator->collate(chunk, *session_.tokenizer, s_.collate);
      if (b.rows == 0) continue;
      const Tensors t = to_tensors(b);
      loss += loss_sum(t).item<double>();
      label_tokens += label_count(t);
    }
    const double mean_loss = label_tokens > 0 ? loss / static_cast<double>(label_tokens) : 0;
    std::vector<std::string> prompts, references;
    for (const auto& s : samples)
      if (auto split = session_.collator->split_for_generation(s)) {
        prompts.push_back(split->prompt);
        references.push_back(split->reference);
      }
    std::int64_t exact = 0;
    GenerationSettings g;
    g.max_new_tokens = s_.max_new_tokens;
    const std::size_t chunk = 64;
    for (std::size_t i = 0; i < prompts.size(); i += chunk) {
      const std::vector<std::string> part(prompts.begin() + static_cast<std::ptrdiff_t>(i),
                                          prompts.begin() + static_cast<std::ptrdiff_t>(std::min(prompts.size(), i + chunk)));
      const auto answers = generate(*executor_, *session_.tokenizer, part, g);
      for (std::size_t k = 0; k < answers.size(); ++k) exact += trim(answers[k]) == trim(references[i + k]) ? 1 : 0;
    }
    const double em = prompts.empty() ? 0 : static_cast<double>(exact) / static_cast<double>(prompts.size());
    nlohmann::json row = {{"step", step}, {"eval", true}, {"eval_loss", mean_loss}, {"eval_samples", samples.size()}};
    if (!prompts.empty()) row["exact_match"] = em;
    log_metrics(row);
    std::cout << "eval at step " << step << "  loss " << fixed(mean_loss, 4);
    if (!prompts.empty()) std::cout << "  exact-match " << fixed(100 * em, 1) << "% (" << exact << "/" << prompts.size() << ")";
    std::cout << std::endl;
    executor_->model().set_training(true);
    return {mean_loss, em, static_cast<std::int64_t>(prompts.size())};
  }

  static std::string trim(const std::string& s) {
    const auto b = s.find_first_not_of(" \t\r\n");
    if (b == std::string::npos) return "";
    return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
  }

  void log_metrics(const nlohmann::json& row) {
    std::ofstream out(out_ / "metrics.jsonl", std::ios::app);
    out << row.dump() << "\n";
    out.flush();
    if (!out) throw UserError("cannot write " + (out_ / "metrics.jsonl").string() + ": " + std::strerror(errno) + " (is the disk full?)");
  }

  // The CUDA devices the plan uses, each once.
  std::vector<c10::Device> cuda_devices() const {
    std::vector<c10::Device> out;
    for (const auto& d : executor_->devices())
      if (d.is_cuda() && std::find(out.begin(), out.end(), d) == out.end()) out.push_back(d);
    return out;
  }

  // A checkpoint is a folder written under a temporary name and renamed into place, then named
  // in checkpoints/latest: a crash leaves the previous checkpoint intact.
  void checkpoint(std::int64_t step) {
    char name[32];
    std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
    const fs::path dir = out_ / "checkpoints" / name, tmp = out_ / "checkpoints" / (std::string(".") + name + ".tmp");
    try {
      write_checkpoint(step, name, dir, tmp);
    } catch (const std::exception& e) {  // a full disk, a quota, a file size limit
      std::error_code ec;
      fs::remove_all(tmp, ec);
      const std::string previous = last_checkpoint_.empty() ? "there is no earlier checkpoint" : "the checkpoint " + last_checkpoint_ + " is intact";
      throw UserError("cannot write the checkpoint at step " + std::to_string(step) + " (" + e.what() + "); " + previous +
                      ": free space and continue with --resume");
    }
    last_checkpoint_ = name;
    spdlog::info("checkpoint {}", dir.string());
  }

  void write_checkpoint(std::int64_t step, const char* name, const fs::path& dir, const fs::path& tmp) {
    fs::remove_all(tmp);
    fs::create_directories(tmp);
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    optimizer_->save(tensors);
    tensors.emplace_back("rng.cpu", at::detail::getDefaultCPUGenerator().get_state());
    // Each GPU's generator too: dropout there draws from it, and a resumed run must draw the same.
    for (const auto& device : cuda_devices()) tensors.emplace_back("rng." + device.str(), at::globalContext().defaultGenerator(device).get_state());
    write_safetensors(tmp / "trainer.safetensors", tensors);
    const nlohmann::json state = {{"step", step},          {"optimizer_steps", optimizer_->steps_taken()}, {"epoch", cursor_.epoch},
                                  {"index", cursor_.index}, {"loss_scale", loss_scale_},                     {"good_steps", good_steps_},
                                  {"skipped_samples", skipped_}, {"total_steps", total_steps_},              {"last_loss", last_loss_}};
    write_file_atomically(tmp / "trainer.json", state.dump(2) + "\n");
    if (session_.adapter) session_.adapter->save(executor_->model(), tmp / "adapter");
    fs::remove_all(dir);
    fs::rename(tmp, dir);
    write_file_atomically(out_ / "checkpoints" / "latest", std::string(name) + "\n");
  }

  std::int64_t restore() {
    const fs::path checkpoints = out_ / "checkpoints";
    std::error_code ec;
    if (!fs::exists(checkpoints / "latest", ec)) {
      spdlog::warn("--resume: no checkpoint in {} yet; starting from step 0", checkpoints.string());
      write_file_atomically(out_ / "metrics.jsonl", "");
      return 0;
    }
    const CheckpointState state = read_checkpoint_state(checkpoints, {total_steps_, s_.batch_size * s_.grad_accum, train_.samples.size()});
    const std::string& name = state.name;
    const fs::path dir = checkpoints / name;
    const std::int64_t step = state.step;
    const SafetensorsFile tensors(dir / "trainer.safetensors");
    optimizer_->load(tensors, state.optimizer_steps);
    auto generator = at::detail::getDefaultCPUGenerator();
    generator.set_state(tensors.tensor("rng.cpu").clone());
    for (const auto& device : cuda_devices()) {
      if (!tensors.find("rng." + device.str())) {
        spdlog::warn("--resume: the checkpoint has no random state for {}; dropout there will not repeat the interrupted run", device.str());
        continue;
      }
      auto cuda_generator = at::globalContext().defaultGenerator(device);
      cuda_generator.set_state(tensors.tensor("rng." + device.str()).clone());
    }
    cursor_.epoch = state.epoch;
    cursor_.index = state.index;
    order_ = epoch_order(train_.samples.size(), s_.seed, cursor_.epoch, s_.shuffle);
    loss_scale_ = state.loss_scale;
    good_steps_ = state.good_steps;
    skipped_ = state.skipped_samples;
    last_loss_ = state.last_loss;
    // Rows the interrupted run logged after this checkpoint are logged again by this one.
    std::string kept;
    if (fs::exists(out_ / "metrics.jsonl", ec)) {
      const int fd = open_regular_file(out_ / "metrics.jsonl", "metrics file");
      ::close(fd);
      std::ifstream metrics(out_ / "metrics.jsonl", std::ios::binary);
      std::string line;
      bool too_long = false;
      while (read_line(metrics, line, too_long) && !too_long) {
        try {
          const auto row = json::parse(line, "metrics.jsonl");
          if (!row.is_object() || !row.contains("step") || !row["step"].is_number_integer()) break;
          if (row["step"].get<std::int64_t>() <= step) kept += line + "\n";
        } catch (const UserError&) {
          break;  // a torn last line from the kill
        }
      }
    }
    write_file_atomically(out_ / "metrics.jsonl", kept);
    first_step_ = step;
    last_checkpoint_ = name;
    spdlog::info("resumed from {} (step {})", dir.string(), step);
    return step;
  }

  Session& session_;
  fs::path out_;
  Settings s_;
  Dataset train_, eval_;
  std::unique_ptr<Executor> executor_;
  std::unique_ptr<AdamW> optimizer_;
  std::int64_t total_steps_ = 0, first_step_ = 0, good_steps_ = 0;
  std::vector<std::size_t> order_;
  Cursor cursor_;
  double loss_scale_ = 1.0, last_loss_ = 0;
  std::size_t skipped_ = 0;
  std::string last_checkpoint_;  // the newest complete checkpoint, for messages
};

// Stops a run at the next step boundary on the first SIGTERM/SIGINT and exits at once on the
// second; the previous handlers come back when training ends.
class StopOnSignal {
 public:
  StopOnSignal() {
    stop_signal = 0;
    struct sigaction action {};
    action.sa_handler = [](int signal) {
      if (stop_signal.exchange(signal) != 0) ::_exit(128 + signal);
      static const char note[] = "\nloom: stopping at the next step with a checkpoint (signal again to stop at once)\n";
      [[maybe_unused]] const auto written = ::write(2, note, sizeof note - 1);
    };
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGTERM, &action, &previous_term_);
    ::sigaction(SIGINT, &action, &previous_int_);
  }
  ~StopOnSignal() {
    ::sigaction(SIGTERM, &previous_term_, nullptr);
    ::sigaction(SIGINT, &previous_int_, nullptr);
  }

 private:
  struct sigaction previous_term_ {}, previous_int_ {};
};

}  // namespace

CheckpointState read_checkpoint_state(const fs::path& checkpoints, const RunShape& run) {
  const fs::path latest = checkpoints / "latest";
  std::string name = read_regular_file(latest, 4096, "checkpoint pointer");
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
  if (name.size() != 13 || name.compare(0, 5, "step-") != 0 || name.find_first_not_of("0123456789", 5) != std::string::npos)
    throw UserError(latest.string() + " holds " + json::quote(name, 40) + ", not the name of a checkpoint (step-NNNNNNNN); the run folder is damaged");
  std::error_code ec;
  const fs::path dir = checkpoints / name;
  if (!fs::is_directory(dir, ec)) throw UserError(latest.string() + " names " + name + ", which is not a checkpoint folder in " + checkpoints.string());
  const fs::path state_file = dir / "trainer.json";
  const auto root = json::read_file(state_file, 1u << 20, "checkpoint state");
  const json::Value state(root, state_file.string());
  CheckpointState c;
  c.name = name;
  c.step = state["step"].integer(0, run.total_steps);
  if (c.step != std::stoll(name.substr(5))) state["step"].fail(std::to_string(c.step) + " is not the step of " + name);
  c.optimizer_steps = state["optimizer_steps"].integer(0, c.step);
  const auto per_epoch = static_cast<std::int64_t>(run.samples);
  c.epoch = static_cast<std::uint64_t>(state["epoch"].integer(0, c.step * run.samples_per_step / std::max<std::int64_t>(per_epoch, 1) + 1));
  c.index = static_cast<std::size_t>(state["index"].integer(0, per_epoch));
  c.loss_scale = state["loss_scale"].number();
  if (!(c.loss_scale > 0 && std::isfinite(c.loss_scale))) state["loss_scale"].fail("must be a positive finite number");
  c.good_steps = state["good_steps"].integer(0, c.step);
  c.skipped_samples = static_cast<std::size_t>(state["skipped_samples"].integer(0));
  c.last_loss = state["last_loss"].number_or(0.0);
  return c;
}

at::Tensor next_token_loss_sum(const at::Tensor& logits, const at::Tensor& labels) {
  if (logits.size(1) < 2) return at::zeros({}, logits.options().dtype(at::kFloat));
  return NextTokenLoss::apply(logits, labels.narrow(1, 1, labels.size(1) - 1).contiguous());
}

TrainReport train(Session& session, const Plan& plan, const fs::path& out_dir, bool resume, const std::function<void()>& first_step_done) {
  StopOnSignal stop;
  Run run(session, plan, out_dir);
  return run.run(resume, first_step_done);
}

}  // namespace loom::core
