#include "runtime/trainer.hpp"

#include <chrono>
#include <cmath>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <mutex>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "config/data.hpp"
#include "distributed/data_parallel.hpp"
#include "runtime/replica_check.hpp"
#include "runtime/replica_outputs.hpp"
#include "runtime/stage_runner.hpp"
#include "distributed/distributed.hpp"
#include "runtime/optimizer.hpp"
#include "runtime/output_folder.hpp"
#include "runtime/generate.hpp"
#include "runtime/metrics_sink.hpp"
#include "loom/error.hpp"
#include "loom/kit/atomic_file.hpp"
#include "loom/kit/input_file.hpp"
#include "loom/kit/json.hpp"
#include "loom/kit/memory.hpp"
#include "loom/kit/safetensors.hpp"
#include "loom/kit/torch_compat.hpp"

namespace loom::core {
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;

// The first SIGTERM/SIGINT received while training (see StopOnSignal), or 0.
std::atomic<int> stop_signal{0};

struct Cursor {
  std::uint64_t epoch = 0;
  std::size_t index = 0;
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
  Run(Session& session, const RankContext& where, fs::path out_dir)
      : session_(session), parallel_(*where.parallel), out_(std::move(out_dir)), s_(session.config), lr_{s_.lr, s_.warmup_steps, s_.scheduler},
        scaler_(s_.dtype == DType::kFloat16) {
    if (!s_.train_file) throw std::logic_error("a run without [data] train passed validation");
    train_ = load_jsonl(*s_.train_file, s_.format, s_.skip_bad_lines);
    if (s_.eval_file) eval_ = load_jsonl(*s_.eval_file, s_.format, s_.skip_bad_lines);
    const Plan& plan = *where.plan;
    if (s_.dtype == DType::kFloat16)
      for (const auto& b : plan.blocks)
        if (b.device == "cpu")
          throw UserError("[run] dtype = \"fp16\" needs every block on a CUDA device (block " + b.block +
                          " is on the cpu); use \"bf16\" or \"fp32\" on the CPU");
    executor_ = load_executor(*session.model, plan, s_.dtype, s_.seed, s_.check_devices,
                              where.pipeline_rank, &parallel_, session.adapter.get());
    if (main()) log_compact_base(executor_->model());
    {
      PlacementRequest shape;
      shape.model = session.structure;
      shape.checkpoint_every = s_.recompute_every;
      std::vector<bool> checkpointed;
      for (std::size_t i = 0; i < shape.model.blocks.size(); ++i) checkpointed.push_back(kit::block_checkpointed(shape, i));
      executor_->set_checkpointed(std::move(checkpointed));
    }
    // Dropout differs between data ranks (as it would between samples of one batch) and repeats
    // for a seed and mesh. Weights were initialised from the run seed alone, the same everywhere.
    // The ranks of one tensor group draw alike: they hold parts of one model and its dropout.
    at::manual_seed(s_.seed + 7919 * static_cast<std::uint64_t>(parallel_.rank() / parallel_.mesh().tensor));
    // The base is frozen whenever an adapter trains; without one every weight trains.
    std::vector<NamedParameter> trainable;
    for (auto& p : executor_->model().parameters()) p.tensor.set_requires_grad(!session.adapter);
    if (session.adapter) trainable = session.adapter->attach(executor_->model(), s_.seed);
    else trainable = executor_->model().parameters();
    // Which trainable tensors are split over the tensor group (the rest every tensor rank holds whole).
    for (const auto& p : trainable)
      split_.push_back(parallel_.mesh().tensor > 1 &&
                       (session.adapter ? session.adapter->shard_dim(executor_->model(), p.name) : executor_->model().shard_dim(p.name)) >= 0);
    sync_ = std::make_unique<GradientSync>(parallel_.data(), trainable, comm_device());
    optimizer_ = std::make_unique<AdamW>(std::move(trainable), AdamWSettings{s_.weight_decay, s_.adam_beta1, s_.adam_beta2, s_.adam_epsilon});
    ranks_ = parallel_.data().size();
    if (!plan.schedule.empty()) {
      runner_ = std::make_unique<StageRunner>(*executor_, plan, where.pipeline_rank, parallel_.pipeline(), comm_device(), session.structure.hidden_size,
                                              scalar_type(s_.dtype));
      runner_->tie(session.structure, optimizer_->params());
    }
    outputs_ = std::make_unique<ReplicaOutputs>(parallel_, runner_ != nullptr, comm_device());
    const auto per_step = static_cast<std::size_t>(s_.batch_size * s_.grad_accum * ranks_);
    total_steps_ = s_.max_steps > 0 ? s_.max_steps
                                    : static_cast<std::int64_t>((train_.samples.size() * static_cast<std::size_t>(s_.epochs) + per_step - 1) / per_step);
    order_ = epoch_order(train_.samples.size(), s_.seed, 0, s_.shuffle);
  }

  TrainReport run(bool resume, const std::function<void()>& first_step_done) {
    if (main()) {
      std::error_code ec;
      fs::create_directories(out_ / "checkpoints", ec);
      if (ec) throw UserError("cannot create " + (out_ / "checkpoints").string() + ": " + ec.message());
    }
    std::int64_t step = resume ? restore() : 0;
    if (!resume && main()) metrics_.start_empty();
    std::uint64_t trainable = 0;
    for (const auto& p : optimizer_->params()) trainable += static_cast<std::uint64_t>(p.tensor.numel());
    if (main())
      spdlog::info("training {} steps from step {}: {} samples, {} trainable parameters, batch {} x {} accumulation{}", total_steps_, step,
                   train_.samples.size(), trainable, s_.batch_size, s_.grad_accum,
                   ranks_ > 1 ? " x " + std::to_string(ranks_) + " data ranks" : std::string());
    const auto started = Clock::now();
    std::int64_t tokens_since = 0;
    auto window = Clock::now();
    double loss_sum = 0;
    std::int64_t loss_count = 0;
    for (; step < total_steps_; ++step) {
      note_progress(step);
      const StepResult r = train_step(step);
      tokens_since += r.tokens;
      loss_sum += r.loss;
      ++loss_count;
      last_loss_ = r.loss;
      const bool last = step + 1 == total_steps_;
      if ((step + 1) % s_.log_every == 0 || last) {
        const double seconds = std::chrono::duration<double>(Clock::now() - window).count();
        const double rate = seconds > 0 ? static_cast<double>(tokens_since) / seconds : 0;
        const double elapsed = std::chrono::duration<double>(Clock::now() - started).count();
        const double eta = elapsed / static_cast<double>(step + 1 - first_step_) * static_cast<double>(total_steps_ - step - 1);
        const double mean = loss_sum / static_cast<double>(loss_count);
        const auto peaks = peak_memory();
        if (main()) {
          nlohmann::json row = {{"step", step + 1}, {"loss", mean}, {"lr", lr_.at(step, total_steps_)}, {"tokens_per_s", rate},
                                {"skipped_samples", skipped_}};
          for (const auto& [device, bytes] : peaks) row["peak_memory_bytes"][device] = bytes;
          metrics_.append(row);
          std::cout << "step " << step + 1 << "/" << total_steps_ << "  loss " << fixed(mean, 4) << "  lr " << std::scientific
                    << std::setprecision(2) << lr_.at(step, total_steps_) << std::defaultfloat << "  " << fixed(rate, 0)
                    << " tok/s  eta " << duration(eta) << std::endl;
        }
        tokens_since = 0;
        loss_sum = 0;
        loss_count = 0;
        window = Clock::now();
      }
      if (step == first_step_ && first_step_done) first_step_done();
      if (s_.eval_every > 0 && (step + 1) % s_.eval_every == 0 && !last) evaluate(step + 1);
      const bool checkpointed = s_.checkpoint_every > 0 && (step + 1) % s_.checkpoint_every == 0;
      if (checkpointed) checkpoint(step + 1);
      if (r.stop_signal != 0 && !last) {
        if (!checkpointed) checkpoint(step + 1);
        TrainReport report;
        report.steps = step + 1;
        report.final_loss = last_loss_;
        report.stopped_by = r.stop_signal;
        return report;
      }
    }
    note_progress(total_steps_);
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
    // Every replica holds the same weights: data replica 0 writes them (its pipeline ranks each
    // their part, gathered into one folder by rank 0).
    if (session_.adapter) {
      report.adapter_dir = out_ / "adapter";
      outputs_->save_adapter(*session_.adapter, executor_->model(), report.adapter_dir);
      if (s_.merge_adapter) {
        session_.adapter->merge(executor_->model());
        report.merged_dir = out_ / "merged";
        outputs_->save_model(executor_->model(), report.merged_dir);
      }
    } else {
      report.merged_dir = out_ / "model";
      outputs_->save_model(executor_->model(), report.merged_dir);
    }
    return report;
  }

 private:
  bool main() const { return parallel_.rank() == 0; }

  // Where this rank's collectives run: its first GPU under NCCL, else the CPU.
  c10::Device comm_device() const {
    for (const auto& d : executor_->devices())
      if (d.is_cuda()) return d;
    return c10::Device(c10::kCPU);
  }

  // Sums small per-rank figures over a group (one collective, one host sync).
  std::vector<double> sum_over(Communicator& group, std::vector<double> values) { return core::sum_over(group, std::move(values), comm_device()); }

  // Peak allocated bytes of every CUDA device of every rank, by "rank R cuda:N" (or "cuda:N" alone
  // in one process).
  std::vector<std::pair<std::string, std::uint64_t>> peak_memory() {
    std::vector<std::pair<std::string, std::uint64_t>> out;
    std::vector<double> all;
    const auto cuda = cuda_devices();
    for (const auto& d : cuda) all.push_back(static_cast<double>(kit::compat::cuda_peak_allocated(d.index()).value_or(0)));
    const int world = parallel_.world().size();
    if (world == 1) {
      for (std::size_t i = 0; i < cuda.size(); ++i) out.emplace_back(cuda[i].str(), static_cast<std::uint64_t>(all[i]));
      return out;
    }
    // Each rank fills its own slots of a [ranks x devices] table of (device index, peak), summed
    // over ranks; every rank uses as many GPUs as the others.
    std::vector<double> table(static_cast<std::size_t>(world) * cuda.size() * 2, 0.0);
    for (std::size_t i = 0; i < cuda.size(); ++i) {
      const std::size_t slot = (static_cast<std::size_t>(parallel_.rank()) * cuda.size() + i) * 2;
      table[slot] = cuda[i].index();
      table[slot + 1] = all[i];
    }
    table = sum_over(parallel_.world(), table);
    for (int r = 0; r < world; ++r)
      for (std::size_t i = 0; i < cuda.size(); ++i) {
        const std::size_t slot = (static_cast<std::size_t>(r) * cuda.size() + i) * 2;
        out.emplace_back("rank " + std::to_string(r) + " cuda:" + std::to_string(static_cast<int>(table[slot])),
                         static_cast<std::uint64_t>(table[slot + 1]));
      }
    return out;
  }

  // The next `count` samples of the run's order (every rank draws the same ones).
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

  // Summed next-token cross-entropy through the model's loss, on the head's device. The labels are
  // copied there before the forward pass is queued: a copy from host memory waits for its device
  // to drain, which after the forward would leave the GPU idle while the host starts the backward.
  at::Tensor loss_sum(const Tensors& t) {
    const at::Tensor labels = t.labels.to(executor_->head_device());
    return executor_->loss_sum(executor_->forward(t.ids, t.positions, t.mask), labels);
  }

  struct StepResult {
    double loss = 0;          // mean over the step's label tokens of every rank
    std::int64_t tokens = 0;  // over every rank
    int stop_signal = 0;      // a rank was asked to stop: every rank stops after this step
  };

  StepResult train_step(std::int64_t step) {
    executor_->model().set_training(true);
    std::vector<Tensors> micro;
    std::int64_t label_tokens = 0, tokens = 0, skipped = 0;
    const int me = parallel_.data().rank();
    for (std::int64_t i = 0; i < s_.grad_accum; ++i) {
      const auto drawn = next_samples(static_cast<std::size_t>(s_.batch_size * ranks_));
      const Batch b = session_.collator->collate(share_of(drawn, me, ranks_), *session_.tokenizer, s_.collate);
      skipped += b.skipped;
      if (b.rows == 0) {
        // A pipeline schedule runs every micro-batch it planned: an empty one becomes a row that
        // labels nothing (no loss, no gradient).
        if (runner_) micro.push_back(to_tensors(Batch{1, 1, {0}, {1}, {-100}, 0}));
        continue;
      }
      micro.push_back(to_tensors(b));
      label_tokens += label_count(micro.back());
      tokens += micro.back().mask.sum().item<std::int64_t>();
    }
    // The loss is normalised by the label tokens of the whole step on every rank, so summing the
    // ranks' gradients gives exactly one process's gradient over the global batch.
    const auto global = sum_over(parallel_.data(), {static_cast<double>(label_tokens), static_cast<double>(tokens), static_cast<double>(skipped)});
    const auto all_labels = static_cast<std::int64_t>(global[0]);
    skipped_ += static_cast<std::size_t>(global[2]);
    if (all_labels == 0)
      throw UserError("step " + std::to_string(step + 1) + ": the collator kept no sample with labels of the " +
                      std::to_string(s_.batch_size * s_.grad_accum * ranks_) + " drawn (" + std::to_string(skipped_) +
                      " skipped so far: no response template, or too long for [data] max_length); check the data against the [collator] "
                      "templates");
    // The loss is read back once, after every backward pass has been queued, so the host does not
    // wait for the forward pass before launching the backward one.
    double step_loss = 0;
    if (runner_) {
      std::vector<MicroBatch> batches;
      for (const auto& t : micro) batches.push_back({t.ids, t.positions, t.mask});
      const at::Tensor total = runner_->train_step(
          batches,
          [&](const at::Tensor& head_output, std::size_t m) {
            return executor_->loss_sum(head_output, micro[m].labels.to(executor_->head_device())) / static_cast<double>(all_labels);
          },
          scaler_.scale(), [&] { sync_->arm(); });
      sync_->finish();
      runner_->sum_tied_gradients(optimizer_->params());
      step_loss = total.defined() ? total.item<double>() : 0.0;  // on the last stage's rank
    } else {
      at::Tensor total = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(executor_->head_device()));
      for (std::size_t i = 0; i < micro.size(); ++i) {
        const at::Tensor scaled = loss_sum(micro[i]) / static_cast<double>(all_labels);
        // The last backward sums each bucket of gradients over the ranks as soon as it is complete.
        if (i + 1 == micro.size()) sync_->arm();
        torch::autograd::backward({scaler_.scale() != 1.0 ? scaled * scaler_.scale() : scaled});
        total = total + scaled.detach();
      }
      sync_->finish();
      step_loss = total.item<double>();
    }
    // One more small collective: the step's loss over every rank, and whether any rank was asked
    // to stop (each then stops after this same step).
    // (The ranks of a tensor group hold the same loss: one of them counts it.)
    const auto after = sum_over(parallel_.world(), {parallel_.coord().tensor == 0 ? step_loss : 0.0, static_cast<double>(stop_signal.load())});
    StepResult r;
    r.loss = after[0];
    r.tokens = static_cast<std::int64_t>(global[1]);
    r.stop_signal = after[1] > 0 ? (stop_signal.load() != 0 ? stop_signal.load() : SIGTERM) : 0;
    if (!finish_step(step)) {
      if (main()) spdlog::warn("step {}: gradients overflowed at loss scale {}; step skipped, scale halved", step + 1, scaler_.scale() * 2);
    }
    return r;
  }

  // Unscales, checks, clips and applies the gradients (the same on every rank: they were summed).
  // False when fp16 overflowed.
  bool finish_step(std::int64_t step) {
    if (scaler_.scale() != 1.0) optimizer_->scale_grads(1.0 / scaler_.scale());
    // Over every stage (each counts its own parameters; a tied copy once) and every tensor rank
    // (each its shards; what they all hold whole, once), so clipping and the fp16 overflow check
    // agree on every rank.
    std::vector<bool> skip = runner_ ? runner_->counted_elsewhere() : std::vector<bool>(split_.size(), false);
    if (parallel_.coord().tensor != 0)
      for (std::size_t i = 0; i < skip.size(); ++i) skip[i] = skip[i] || !split_[i];
    double squares = optimizer_->grad_squares(skip);
    if (parallel_.mesh().tensor > 1) squares = sum_over(parallel_.tensor(), {squares})[0];
    if (runner_) squares = sum_over(parallel_.pipeline(), {squares})[0];
    const double norm = std::sqrt(squares);
    const bool finite = std::isfinite(norm);
    if (!finite && !scaler_.enabled()) throw UserError("step " + std::to_string(step + 1) + ": the gradients are not finite; lower [train] lr");
    if (!scaler_.update(finite)) {
      optimizer_->zero_grad();
      return false;
    }
    if (s_.max_grad_norm > 0 && norm > s_.max_grad_norm) optimizer_->scale_grads(s_.max_grad_norm / (norm + 1e-6));
    optimizer_->step(lr_.at(step, total_steps_));
    optimizer_->zero_grad();
    if (s_.check_replicas) {
      const auto& params = optimizer_->params();
      check_replicas(parallel_.data(), "data", params, std::vector<bool>(params.size(), true), step, comm_device());
      std::vector<bool> whole(split_.size());
      for (std::size_t i = 0; i < whole.size(); ++i) whole[i] = !split_[i];
      check_replicas(parallel_.tensor(), "tensor", params, whole, step, comm_device());
    }
    return true;
  }

  // Loss and greedy exact-match over the eval samples, each rank taking every ranks_-th one, the
  // sums reduced over ranks.
  std::tuple<double, double, std::int64_t> evaluate(std::int64_t step) {
    torch::NoGradGuard no_grad;
    executor_->model().set_training(false);
    std::vector<std::string> samples = eval_.samples;
    if (s_.eval_samples > 0 && samples.size() > static_cast<std::size_t>(s_.eval_samples)) samples.resize(static_cast<std::size_t>(s_.eval_samples));
    const std::size_t total_samples = samples.size();
    std::vector<std::string> mine;
    for (std::size_t i = static_cast<std::size_t>(parallel_.data().rank()); i < samples.size(); i += static_cast<std::size_t>(ranks_))
      mine.push_back(samples[i]);
    double loss = 0;
    std::int64_t label_tokens = 0;
    for (std::size_t i = 0; i < mine.size(); i += static_cast<std::size_t>(s_.batch_size)) {
      const std::vector<std::string> chunk(mine.begin() + static_cast<std::ptrdiff_t>(i),
                                           mine.begin() + static_cast<std::ptrdiff_t>(std::min(mine.size(), i + static_cast<std::size_t>(s_.batch_size))));
      const Batch b = session_.collator->collate(chunk, *session_.tokenizer, s_.collate);
      if (b.rows == 0) continue;
      const Tensors t = to_tensors(b);
      if (runner_) {
        const at::Tensor out = runner_->forward(t.ids, t.positions, t.mask);
        if (out.defined()) loss += executor_->loss_sum(out, t.labels.to(executor_->head_device())).item<double>();
      } else {
        loss += loss_sum(t).item<double>();
      }
      label_tokens += label_count(t);
    }
    std::vector<std::string> prompts, references;
    for (const auto& s : mine)
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
      const auto answers = runner_ ? generate([&](const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& mask,
                                                  KVCache* cache) { return runner_->last_logits(ids, positions, mask, cache); },
                                              *session_.tokenizer, part, g)
                                   : generate(*executor_, *session_.tokenizer, part, g);
      for (std::size_t k = 0; k < answers.size(); ++k) exact += trim(answers[k]) == trim(references[i + k]) ? 1 : 0;
    }
    if (runner_) loss = sum_over(parallel_.pipeline(), {loss})[0];  // the last stage's
    const auto sums = sum_over(parallel_.data(), {loss, static_cast<double>(label_tokens), static_cast<double>(exact), static_cast<double>(prompts.size())});
    const double mean_loss = sums[1] > 0 ? sums[0] / sums[1] : 0;
    const auto all_exact = static_cast<std::int64_t>(sums[2]), all_prompts = static_cast<std::int64_t>(sums[3]);
    const double em = all_prompts == 0 ? 0 : static_cast<double>(all_exact) / static_cast<double>(all_prompts);
    if (main()) {
      nlohmann::json row = {{"step", step}, {"eval", true}, {"eval_loss", mean_loss}, {"eval_samples", total_samples}};
      if (all_prompts > 0) row["exact_match"] = em;
      metrics_.append(row);
      std::cout << "eval at step " << step << "  loss " << fixed(mean_loss, 4);
      if (all_prompts > 0) std::cout << "  exact-match " << fixed(100 * em, 1) << "% (" << all_exact << "/" << all_prompts << ")";
      std::cout << std::endl;
    }
    executor_->model().set_training(true);
    note_progress(step);
    return {mean_loss, em, all_prompts};
  }

  static std::string trim(const std::string& s) {
    const auto b = s.find_first_not_of(" \t\r\n");
    if (b == std::string::npos) return "";
    return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
  }

  // The CUDA devices this rank uses, each once.
  std::vector<c10::Device> cuda_devices() const {
    std::vector<c10::Device> out;
    for (const auto& d : executor_->devices())
      if (d.is_cuda()) out.push_back(d);
    return out;
  }

  static std::string rng_file(int rank) { return "rng-rank" + std::to_string(rank) + ".safetensors"; }
  std::string optimizer_file() const {
    const MeshCoord c = parallel_.coord();
    return "optimizer-pipeline" + std::to_string(c.pipeline) + "-tensor" + std::to_string(c.tensor) + ".safetensors";
  }

  // A checkpoint is a folder written under a temporary name and renamed into place, then named in
  // checkpoints/latest: a crash leaves the previous checkpoint intact. Every rank writes its random
  // state; one rank per model shard (data rank 0) the optimizer state, keyed by parameter name;
  // rank 0 the step, the data cursor and the mesh (trainer.json) and the adapter.
  void checkpoint(std::int64_t step) {
    char name[32];
    std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
    const fs::path dir = out_ / "checkpoints" / name, tmp = out_ / "checkpoints" / (std::string(".") + name + ".tmp");
    std::string failure;
    try {
      if (main()) {
        kit::remove_tree(tmp);
        fs::create_directories(tmp);
      }
      parallel_.world().barrier();
      write_checkpoint(step, tmp);
    } catch (const CommunicationError&) {
      throw;
    } catch (const std::exception& e) {  // a full disk, a quota, a file size limit, permissions
      failure = describe_error(e);
    }
    // Every rank learns whether all wrote their part before rank 0 names the checkpoint.
    const auto failed = sum_over(parallel_.world(), {failure.empty() ? 0.0 : 1.0});
    if (failed[0] > 0) {
      if (main()) kit::remove_tree(tmp);
      const std::string previous = last_checkpoint_.empty() ? "there is no earlier checkpoint" : "the checkpoint " + last_checkpoint_ + " is intact";
      throw UserError("cannot write the checkpoint at step " + std::to_string(step) + " (" +
                      (failure.empty() ? "another rank failed to write its part" : failure) + "); " + previous +
                      ": free space and continue with --resume");
    }
    if (main()) {
      kit::remove_tree(dir);
      fs::rename(tmp, dir);
      kit::write_file_atomically(out_ / "checkpoints" / "latest", std::string(name) + "\n");
      spdlog::info("checkpoint {}", dir.string());
    }
    parallel_.world().barrier();
    last_checkpoint_ = name;
    note_progress(step);
  }

  void write_checkpoint(std::int64_t step, const fs::path& tmp) {
    std::vector<std::pair<std::string, at::Tensor>> rng;
    rng.emplace_back("rng.cpu", at::detail::getDefaultCPUGenerator().get_state());
    // Each GPU's generator too: dropout there draws from it, and a resumed run must draw the same.
    for (const auto& device : cuda_devices()) rng.emplace_back("rng." + device.str(), at::globalContext().defaultGenerator(device).get_state());
    kit::write_safetensors(tmp / rng_file(parallel_.rank()), rng);
    if (parallel_.coord().data == 0) {
      std::vector<std::pair<std::string, at::Tensor>> tensors;
      optimizer_->save(tensors);
      kit::write_safetensors(tmp / optimizer_file(), tensors);
    }
    if (session_.adapter) outputs_->save_adapter(*session_.adapter, executor_->model(), tmp / "adapter");
    if (!main()) return;
    const Mesh& m = parallel_.mesh();
    const nlohmann::json state = {{"step", step},
                                  {"optimizer_steps", optimizer_->steps_taken()},
                                  {"epoch", cursor_.epoch},
                                  {"index", cursor_.index},
                                  {"loss_scale", scaler_.scale()},
                                  {"good_steps", scaler_.good_steps()},
                                  {"skipped_samples", skipped_},
                                  {"total_steps", total_steps_},
                                  {"last_loss", last_loss_},
                                  {"mesh", {{"data", m.data}, {"pipeline", m.pipeline}, {"tensor", m.tensor}}}};
    kit::write_file_atomically(tmp / "trainer.json", state.dump(2) + "\n");
  }

  std::int64_t restore() {
    const fs::path checkpoints = out_ / "checkpoints";
    std::error_code ec;
    if (!fs::exists(checkpoints / "latest", ec)) {
      if (main()) {
        spdlog::warn("--resume: no checkpoint in {} yet; starting from step 0", checkpoints.string());
        metrics_.start_empty();
      }
      return 0;
    }
    const CheckpointState state =
        read_checkpoint_state(checkpoints, {total_steps_, s_.batch_size * s_.grad_accum * ranks_, train_.samples.size()});
    if (state.mesh != parallel_.mesh())
      throw UserError("--resume: " + (checkpoints / state.name).string() + " was written by a run on the mesh " + state.mesh.str() + " (" +
                      std::to_string(state.mesh.world()) + " processes); this run is " + parallel_.mesh().str() + " (" +
                      std::to_string(parallel_.mesh().world()) + "); resume on the same mesh");
    const std::string& name = state.name;
    const fs::path dir = checkpoints / name;
    const std::int64_t step = state.step;
    for (const auto& file : {optimizer_file(), rng_file(parallel_.rank())})
      if (!fs::exists(dir / file, ec))
        throw UserError("--resume: " + (dir / file).string() + " is missing (written by an older loom, or the checkpoint is damaged); start a new run");
    optimizer_->load(kit::SafetensorsFile(dir / optimizer_file()), state.optimizer_steps);
    const kit::SafetensorsFile rng(dir / rng_file(parallel_.rank()));
    auto generator = at::detail::getDefaultCPUGenerator();
    generator.set_state(rng.tensor("rng.cpu").clone());
    for (const auto& device : cuda_devices()) {
      if (!rng.find("rng." + device.str())) {
        spdlog::warn("--resume: the checkpoint has no random state for {}; dropout there will not repeat the interrupted run", device.str());
        continue;
      }
      auto cuda_generator = at::globalContext().defaultGenerator(device);
      cuda_generator.set_state(rng.tensor("rng." + device.str()).clone());
    }
    cursor_.epoch = state.epoch;
    cursor_.index = state.index;
    order_ = epoch_order(train_.samples.size(), s_.seed, cursor_.epoch, s_.shuffle);
    scaler_.restore(state.loss_scale, state.good_steps);
    skipped_ = state.skipped_samples;
    last_loss_ = state.last_loss;
    // Rows the interrupted run logged after this checkpoint are logged again by this one.
    if (main()) {
      metrics_.keep_through(step);
      spdlog::info("resumed from {} (step {})", dir.string(), step);
    }
    first_step_ = step;
    last_checkpoint_ = name;
    return step;
  }

  Session& session_;
  Parallel& parallel_;
  fs::path out_;
  MetricsSink metrics_{out_ / "metrics.jsonl"};
  const RunConfig& s_;  // the session's
  LearningRate lr_;
  LossScaler scaler_;
  int ranks_ = 1;  // data-parallel ranks
  Dataset train_, eval_;
  std::unique_ptr<Executor> executor_;
  std::unique_ptr<GradientSync> sync_;
  std::vector<bool> split_;  // per trainable tensor: split over the tensor group
  std::unique_ptr<AdamW> optimizer_;
  std::unique_ptr<StageRunner> runner_;  // with a pipeline schedule
  std::unique_ptr<ReplicaOutputs> outputs_;
  std::int64_t total_steps_ = 0, first_step_ = 0;
  std::vector<std::size_t> order_;
  Cursor cursor_;
  double last_loss_ = 0;
  std::size_t skipped_ = 0;
  std::string last_checkpoint_;  // the newest complete checkpoint, for messages
};

// Stops a run at the next step boundary on the first SIGTERM/SIGINT and exits at once on the
// second; the previous handlers come back when training ends. Runs side by side in one process
// (ranks as threads, in the tests) share one installation: the first installs, the last restores.
class StopOnSignal {
 public:
  StopOnSignal() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (users_++ > 0) return;
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
    std::lock_guard<std::mutex> lock(mutex_);
    if (--users_ > 0) return;
    ::sigaction(SIGTERM, &previous_term_, nullptr);
    ::sigaction(SIGINT, &previous_int_, nullptr);
  }

 private:
  static inline std::mutex mutex_;
  static inline int users_ = 0;
  static inline struct sigaction previous_term_ {}, previous_int_ {};
};

}  // namespace

CheckpointState read_checkpoint_state(const fs::path& checkpoints, const RunShape& run) {
  const fs::path latest = checkpoints / "latest";
  std::string name = kit::read_regular_file(latest, 4096, "checkpoint pointer");
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
  if (name.size() != 13 || name.compare(0, 5, "step-") != 0 || name.find_first_not_of("0123456789", 5) != std::string::npos)
    throw UserError(latest.string() + " holds " + kit::json::quote(name, 40) + ", not the name of a checkpoint (step-NNNNNNNN); the run folder is damaged");
  std::error_code ec;
  const fs::path dir = checkpoints / name;
  if (!fs::is_directory(dir, ec)) throw UserError(latest.string() + " names " + name + ", which is not a checkpoint folder in " + checkpoints.string());
  const fs::path state_file = dir / "trainer.json";
  const auto root = kit::json::read_file(state_file, 1u << 20, "checkpoint state");
  const kit::json::Value state(root, state_file.string());
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
  if (root.contains("mesh")) {
    const auto mesh = state["mesh"];
    c.mesh.data = static_cast<int>(mesh["data"].integer(1, 1 << 16));
    c.mesh.pipeline = static_cast<int>(mesh["pipeline"].integer(1, 1 << 10));
    c.mesh.tensor = static_cast<int>(mesh["tensor"].integer(1, 1 << 10));
  }
  return c;
}


TrainReport train(Session& session, const RankContext& where, const fs::path& out_dir, bool resume, const std::function<void()>& first_step_done) {
  StopOnSignal stop;
  Run run(session, where, out_dir);
  return run.run(resume, first_step_done);
}

}  // namespace loom::core
