#include "runtime/trainer.hpp"

#include <chrono>
#include <cmath>
#include <iomanip>
#include <iostream>
#include <sstream>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <mutex>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "runtime/hf_folder.hpp"
#include "config/data.hpp"
#include "distributed/data_parallel.hpp"
#include "runtime/replica_check.hpp"
#include "runtime/replica_outputs.hpp"
#include "runtime/rank_runtime.hpp"
#include "distributed/distributed.hpp"
#include "runtime/optimizer.hpp"
#include "runtime/micro_batches.hpp"
#include "runtime/checkpointer.hpp"
#include "runtime/evaluator.hpp"
#include "runtime/metrics_sink.hpp"
#include "loom/error.hpp"
#include "loom/kit/memory.hpp"
#include "loom/kit/torch_compat.hpp"
#include "plugins/plugin_guard.hpp"
#include "config/objective_data.hpp"
#include "objectives/reference_weights.hpp"
#include "objectives/sampled_completions.hpp"
#include "objectives/token_logps.hpp"
#include "runtime/folded_adapters.hpp"
#include <torch/csrc/autograd/grad_mode.h>

namespace loom::core {
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;

// The first SIGTERM/SIGINT received while training (see StopOnSignal), or 0.
std::atomic<int> stop_signal{0};

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
      : session_(session), parallel_(*where.parallel), out_(std::move(out_dir)), s_(session.config),
        scaler_(s_.dtype == DType::kFloat16) {
    if (!session.objective)
      throw UserError("no objective plugin serves this run: [objective] names none and the plugin folders hold no 'sft' (loom_objective_sft); "
                      "reinstall loom or add its plugin folder to [plugins] paths");
    RunData data = load_run_data(s_);
    train_ = std::move(data.train);
    eval_ = std::move(data.eval);
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
      // A model's own loss term (a mixture of experts' load balancing) spans every block's pass:
      // it needs them all in this process, with their graphs.
      if (auto* aux = capability<AuxiliaryLoss>(executor_->model()); aux && !aux->auxiliary_loss_name().empty()) {
        const auto recomputed = std::count(checkpointed.begin(), checkpointed.end(), true);
        if (!plan.schedule.empty() || recomputed > 0)
          throw UserError(std::string("[model] output_router_logits: the routers' load-balancing loss spans every layer, and loom adds it only where one "
                                      "process runs every layer and keeps its activations; ") +
                          (recomputed > 0 ? "set [train] activation_checkpointing = \"none\"" : "use a placement without pipeline stages") +
                          ", or set [model] output_router_logits = false");
        auxiliary_ = aux;
      }
      executor_->set_checkpointed(std::move(checkpointed), s_.offload_checkpoints);
    }
    // Dropout differs between data ranks (as it would between samples of one batch) and repeats
    // for a seed and mesh. Weights were initialised from the run seed alone, the same everywhere.
    // The ranks of one tensor group draw alike: they hold parts of one model and its dropout.
    at::manual_seed(s_.seed + 7919 * static_cast<std::uint64_t>(parallel_.rank() / parallel_.mesh().tensor));
    // The base is frozen whenever an adapter trains; without one every weight trains.
    std::vector<NamedParameter> trainable;
    for (auto& p : executor_->model().parameters()) p.tensor.set_requires_grad(!session.adapter);
    if (session.adapter && !s_.adapter_start.empty()) trainable = session.adapter->load(executor_->model(), s_.adapter_start);
    else if (session.adapter) trainable = session.adapter->attach(executor_->model(), s_.seed);
    else trainable = executor_->model().parameters();
    // The reference model is the model as the run starts: its trainable values now, before a
    // resumed run restores its checkpoint's.
    if (session.needs.reference) starting_ = std::make_unique<StartingWeights>(trainable);
    if (session.needs.data == ObjectiveData::kPrompts && s_.parallel.expert > 1)
      throw UserError("[parallel] expert > 1: objective '" + session.spec.section(kKindObjective).plugin +
                      "' samples completions, which an expert group would have to decode in lockstep; leave expert at 1");
    // Which trainable tensors are split over the tensor group (the rest every tensor rank holds whole).
    for (const auto& p : trainable)
      split_.push_back(parallel_.mesh().tensor > 1 &&
                       (session.adapter ? session.adapter->shard_dim(executor_->model(), p.name) : executor_->model().shard_dim(p.name)) >= 0);
    // Under expert parallelism each data rank trains its own experts: their gradients are summed
    // over the ranks holding the same experts (their expert group's rows came to them through the
    // exchange's backward), every other gradient over the data group.
    std::vector<NamedParameter> everywhere, experts_here;
    experts_ = expert_group(executor_->model());
    const std::vector<at::Tensor> experts_held = experts_ != nullptr ? expert_tensors(executor_->model()) : std::vector<at::Tensor>{};
    // The model says of its other tensors (gpt-oss's experts' biases) whether they are shared out too.
    const auto* shards = experts_ != nullptr ? capability<ExpertShards>(executor_->model()) : nullptr;
    for (const auto& p : trainable) {
      expert_shared_.push_back(std::any_of(experts_held.begin(), experts_held.end(),
                                           [&](const at::Tensor& h) { return p.tensor.storage().is_alias_of(h.storage()); }) ||
                               (shards != nullptr && shards->experts_held(p.name).group == &experts_->expert()));
      (expert_shared_.back() ? experts_here : everywhere).push_back(p);
    }
    sync_ = std::make_unique<GradientSync>(parallel_.data(), everywhere, comm_device());
    if (experts_ != nullptr) expert_sync_ = std::make_unique<GradientSync>(experts_->expert_replicas(), experts_here, comm_device());
    optimizer_ = std::make_unique<Optimizer>(std::move(trainable), optimizer_settings(s_));
    ranks_ = parallel_.data().size();
    one_stage_ = plan.schedule.empty();
    runner_ = RankRuntime::for_plan(*executor_, plan, where.pipeline_rank, parallel_.pipeline(), comm_device(), session.structure.hidden_size,
                                    scalar_type(s_.dtype));
    runner_->tie(session.structure, optimizer_->params());
    outputs_ = std::make_unique<ReplicaOutputs>(parallel_, !plan.schedule.empty(), comm_device());
    if (const auto& model = session.spec.section(kKindModel).options; model.has("path"))
      outputs_->name_base(model.get_string("path"), model.has("revision") ? model.get_string("revision") : "");
    checkpointer_ = std::make_unique<Checkpointer>(out_ / "checkpoints", parallel_, cuda_devices(), comm_device());
    evaluator_ = std::make_unique<Evaluator>(*runner_, *session.collator, *session.tokenizer, parallel_, comm_device(),
                                             EvalSettings{s_.batch_size, s_.eval_samples, s_.max_new_tokens, s_.collate, where.generation_rows});
    generation_rows_ = where.generation_rows;
    if (session.needs.data == ObjectiveData::kPrompts) check_prompts();
    total_steps_ = run_steps(s_, train_.samples.size(), ranks_);
    lr_ = learning_rate(s_, total_steps_);
    draws_ = std::make_unique<SampleDraws>(train_.samples.size(), s_.seed, s_.shuffle);
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
    std::int64_t steps_done = total_steps_;
    for (; step < total_steps_; ++step) {
      if (stop_early_) {  // resumed from the checkpoint of the evaluation that ended the run
        steps_done = step;
        break;
      }
      note_progress(step);
      const StepResult r = train_step(step);
      tokens_since += r.tokens;
      loss_sum += r.loss;
      auxiliary_sum_ += r.auxiliary;
      for (const auto& [name, value] : r.metrics) {
        const std::string& key = name;
        auto it = std::find_if(metric_window_.begin(), metric_window_.end(), [&](const auto& e) { return e.first == key; });
        if (it == metric_window_.end()) it = metric_window_.insert(metric_window_.end(), {name, {0.0, 0}});
        it->second.first += value;
        ++it->second.second;
      }
      ++loss_count;
      last_loss_ = r.loss;
      const bool last = step + 1 == total_steps_;
      if ((step + 1) % s_.log_every == 0 || last) {
        const double seconds = std::chrono::duration<double>(Clock::now() - window).count();
        const double rate = seconds > 0 ? static_cast<double>(tokens_since) / seconds : 0;
        const double elapsed = std::chrono::duration<double>(Clock::now() - started).count();
        const double eta = elapsed / static_cast<double>(step + 1 - first_step_) * static_cast<double>(total_steps_ - step - 1);
        const double mean = loss_sum / static_cast<double>(loss_count);
        last_window_ = {mean, loss_count};
        const auto peaks = peak_memory();
        if (main()) {
          nlohmann::json row = {{"step", step + 1}, {"loss", mean}, {"lr", lr_.at(step, total_steps_)},
                                {"grad_norm", grad_norm_sum_ / static_cast<double>(loss_count)}, {"tokens_per_s", rate},
                                {"skipped_samples", skipped_}};
          if (auxiliary_) row[auxiliary_->auxiliary_loss_name()] = auxiliary_sum_ / static_cast<double>(loss_count);
          std::string shown;  // the objective's headline figures on the progress line
          for (const auto& [name, sum_steps] : metric_window_) {
            const double value = sum_steps.first / static_cast<double>(sum_steps.second);
            row[name] = value;
            if (name == "reward" || name == "rewards/accuracies" || name == "rewards/margins") shown += "  " + name + " " + fixed(value, 3);
          }
          for (const auto& [device, bytes] : peaks) row["peak_memory_bytes"][device] = bytes;
          metrics_.append(row);
          std::cout << "step " << step + 1 << "/" << total_steps_ << "  loss " << fixed(mean, 4) << "  lr " << std::scientific
                    << std::setprecision(2) << lr_.at(step, total_steps_) << std::defaultfloat << "  " << fixed(rate, 0)
                    << " tok/s" << shown << "  eta " << duration(eta) << std::endl;
        }
        tokens_since = 0;
        loss_sum = 0;
        loss_count = 0;
        grad_norm_sum_ = 0;
        auxiliary_sum_ = 0;
        metric_window_.clear();
        window = Clock::now();
      }
      if (step == first_step_ && first_step_done) first_step_done();
      // The last step's evaluation is the final one, except that with best_metric its checkpoint
      // needs one too (and the final evaluation then reuses it).
      if (s_.eval_every > 0 && (step + 1) % s_.eval_every == 0 && (!last || !s_.best_metric.empty())) evaluate_during_training(step + 1);
      const bool checkpointed = s_.checkpoint_every > 0 && (step + 1) % s_.checkpoint_every == 0;
      if (checkpointed) checkpoint(step + 1);
      if (r.stop_signal != 0 && !last) {
        if (!checkpointed) checkpoint(step + 1);
        TrainReport report;
        report.steps = step + 1;
        report.final_loss = last_window_.first;
        report.final_loss_steps = last_window_.second;
        report.stopped_by = r.stop_signal;
        return report;
      }
      if (stop_early_) {
        steps_done = step + 1;
        break;
      }
    }
    note_progress(steps_done);
    TrainReport report;
    report.steps = steps_done;
    report.final_loss = last_window_.first;
    report.final_loss_steps = last_window_.second;
    report.skipped_samples = skipped_;
    report.skipped_lines = train_.skipped_lines + eval_.skipped_lines;
    if (stop_early_ && steps_done < total_steps_)
      report.stopped_early = s_.best_metric + " did not improve by more than " + fixed(s_.early_stopping_threshold, 4) + " in " +
                             std::to_string(evals_without_improvement_) + " evaluations in a row";
    // [train] best_metric: the outputs are the best checkpoint's weights when it evaluated better
    // than the last ones (the final evaluation below is then of them).
    std::optional<EvalResult> final_eval;
    if (eval_step_ == steps_done) final_eval = eval_at_step_;
    if (!s_.best_metric.empty() && !eval_.samples.empty() && !best_.empty()) {
      try {
        if (!final_eval) final_eval = evaluate(steps_done);
        if (better(*best_value_, *metric(*final_eval), 0)) {
          checkpointer_->load_weights(best_, *optimizer_);
          report.best_checkpoint = out_ / "checkpoints" / best_;
          final_eval.reset();
          if (main()) spdlog::info("the outputs are the best checkpoint's weights: {} ({} {})", best_, s_.best_metric, *best_value_);
        }
      } catch (const UserError& e) {
        report.eval_failure = e.what();  // the last weights are the outputs
      }
    }
    // The trained weights are written before the final evaluation, which then cannot cost them.
    // Every replica holds the same weights: data replica 0 writes them (its pipeline ranks each
    // their part, gathered into one folder by rank 0).
    if (session_.adapter) {
      report.adapter_dir = out_ / "adapter";
      outputs_->save_adapter(*session_.adapter, executor_->model(), report.adapter_dir);
    } else {
      report.merged_dir = out_ / "model";
      save_model_folder(report.merged_dir);
    }
    if (!eval_.samples.empty() && report.eval_failure.empty()) {
      try {
        const EvalResult e = final_eval ? *final_eval : evaluate(steps_done, report.best_checkpoint.empty() ? "" : best_);
        report.eval_loss = e.loss;
        report.exact_match = e.exact_match();
        report.exact_match_samples = e.prompts;
      } catch (const UserError& e) {
        report.eval_failure = e.what();  // every rank fails it together (Evaluator)
      }
    }
    // Merged after evaluating: the evaluation takes the adapter beside its base, not folded twice.
    if (session_.adapter && s_.merge_adapter) {
      session_.adapter->merge(executor_->model());
      report.merged_dir = out_ / "merged";
      save_model_folder(report.merged_dir);
    }
    return report;
  }

 private:
  bool main() const { return parallel_.rank() == 0; }

  // The expert groups under [parallel] expert > 1 (null otherwise), once the model is seen to
  // share out its experts over them.
  ExpertParallel* expert_group(LoadedModel& model) {
    auto* groups = capability<ExpertParallel>(parallel_);
    if (groups == nullptr || groups->expert().size() == 1) return nullptr;
    auto* weights = capability<ExpertWeights>(model);
    const auto* shards = capability<ExpertShards>(model);
    for (const auto& e : weights ? weights->expert_weights() : std::vector<NamedExperts>{}) {
      if (!e.weight.defined()) continue;
      if (shards == nullptr || shards->experts_held(e.name).group != &groups->expert())
        throw UserError("[parallel] expert = " + std::to_string(groups->expert().size()) + ": model plugin '" + session_.plugins.at(kKindModel)->name +
                        "' does not share out its experts over expert ranks (it offers no ExpertShards); leave expert at 1");
      // The exchange hands the layer's rows to the group as they are: NCCL takes GPU tensors only.
      if (comm_device().is_cuda() && !e.weight.is_cuda())
        throw UserError("[parallel] expert = " + std::to_string(groups->expert().size()) + ": " + e.name + " is on " + e.weight.device().str() +
                        ", but the expert group exchanges rows between GPUs (NCCL); place every mixture-of-experts layer on a GPU");
    }
    return groups;
  }
  // This rank's stacked experts weights and their adapter's A and B: a trainable tensor sharing
  // storage with one of them is this rank's share of the experts.
  static std::vector<at::Tensor> expert_tensors(LoadedModel& model) {
    std::vector<at::Tensor> out;
    auto* weights = capability<ExpertWeights>(model);
    for (const auto& e : weights ? weights->expert_weights() : std::vector<NamedExperts>{}) {
      if (e.weight.defined()) out.push_back(e.weight);
      if (e.delta != nullptr && e.delta->defined()) out.insert(out.end(), {e.delta->a, e.delta->b});
    }
    return out;
  }

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
        out.emplace_back(peak_memory_key(world, r, "cuda:" + std::to_string(static_cast<int>(table[slot]))),
                         static_cast<std::uint64_t>(table[slot + 1]));
      }
    return out;
  }

  // The next `count` samples of the run's order (every rank draws the same ones).
  std::vector<std::string> next_samples(std::size_t count) {
    std::vector<std::string> out;
    for (const std::size_t i : draws_->next(count)) out.push_back(train_.samples[i]);
    return out;
  }

  struct StepResult {
    double loss = 0;          // mean over the step's label tokens of every rank
    std::int64_t tokens = 0;  // over every rank
    int stop_signal = 0;      // a rank was asked to stop: every rank stops after this step
    double auxiliary = 0;     // the model's own term (AuxiliaryLoss), unweighted, mean over the step's micro-batches
    std::vector<std::pair<std::string, double>> metrics;  // the objective's and its sampling's, over every rank
  };


  // Every prompt a sampling objective may draw, before the first step: one that encodes to nothing,
  // or that leaves no room for a whole completion within the model's positions, would otherwise stop
  // the run at whichever step drew it.
  void check_prompts() const {
    const std::int64_t positions = session_.structure.max_positions, completion = session_.needs.sampling.max_tokens;
    const ObjectiveSamples read(session_.chat);
    for (std::size_t i = 0; i < train_.samples.size(); ++i) {
      const auto ids = read.prompt_ids(split_sample(train_.samples[i]), *session_.tokenizer).size();
      if (ids == 0) throw UserError(train_.where(i) + ": the prompt [data] format renders encodes to no tokens: nothing to continue");
      if (positions > 0 && static_cast<std::int64_t>(ids) + completion > positions)
        throw UserError(train_.where(i) + ": a prompt of " + std::to_string(ids) + " tokens and a completion of up to " + std::to_string(completion) +
                        " ([objective] max_completion_length) pass the model's " + std::to_string(positions) + " positions; shorten it or lower max_completion_length");
    }
  }

  // One step's micro-batches as the objective reads them, this rank's share.
  struct StepRows {
    std::vector<MicroBatch> micro;
    std::vector<bool> padding;  // per micro-batch: a row that labels nothing, standing in for an empty one
    std::vector<std::int64_t> pairs;         // kPreferences: per micro-batch
    std::vector<at::Tensor> advantages;      // kPrompts: per micro-batch
    std::vector<at::Tensor> reference;       // per micro-batch, where the objective needs the reference (last stage)
    std::vector<std::int64_t> labels;        // per micro-batch: its labelled tokens
    std::int64_t label_tokens = 0, tokens = 0, skipped = 0, rows = 0;
    std::vector<std::pair<std::string, double>> metrics;  // the step's, over every rank (sampling's)
  };

  // Adds a collated micro-batch, or the padding row that stands in for an empty one where every
  // micro-batch must run (a pipeline schedule, an expert group's exchanges).
  void add_micro_batch(StepRows& out, const Batch& b, std::int64_t rows) {
    out.skipped += b.skipped;
    if (b.rows == 0) {
      if (!one_stage_ || experts_ != nullptr) {
        out.micro.push_back(to_micro_batch(Batch{1, 1, {0}, {1}, {-100}, 0}));
        out.padding.push_back(true);
        out.pairs.push_back(0);
        out.labels.push_back(0);
      }
      return;
    }
    out.micro.push_back(to_micro_batch(b));
    out.padding.push_back(false);
    out.pairs.push_back(session_.needs.data == ObjectiveData::kPreferences ? rows : 0);
    out.rows += rows;
    out.labels.push_back(label_count(out.micro.back()));
    out.label_tokens += out.labels.back();
    out.tokens += (out.micro.back().mask > 0).sum().item<std::int64_t>();  // packed rows' mask holds sample numbers
  }

  StepRows step_rows(std::int64_t step) {
    StepRows out;
    const int me = parallel_.data().rank();
    const ObjectiveData data = session_.needs.data;
    if (data == ObjectiveData::kPrompts) {
      // The step's prompts at once: each rank samples its share's completions together.
      const auto drawn = next_samples(static_cast<std::size_t>(s_.batch_size * s_.grad_accum * ranks_));
      const auto mine = share_of(drawn, me, ranks_);
      SamplingPlan plan;
      plan.first_prompt = static_cast<std::int64_t>(mine.size()) * me;
      plan.micro_prompts = s_.batch_size;
      plan.seed = s_.seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(step) + 1;
      plan.max_positions = session_.structure.max_positions;
      plan.data_ranks = ranks_;
      plan.data_rank = me;
      plan.scores = parallel_.pipeline().rank() == 0 && parallel_.tensor().rank() == 0;
      const auto started = Clock::now();
      SampledStep sampled = sample_step(
          mine, session_, plan,
          [&](const std::vector<std::string>& prompts, const GenerationSettings& settings) {
            GenerationSettings g = settings;
            share_generation(g, *runner_, parallel_, comm_device(), generation_rows_);
            executor_->model().set_training(false);
            std::vector<Generated> out;
            {
              const FoldedAdapters folded(executor_->model(), FoldFor::kWhileEvaluating, [&](std::vector<double> fold) {
                return reduce_over(parallel_.tensor(), std::move(fold), comm_device(), ReduceOp::kMin);
              });
              out = generate_completions(next_logits_of(*runner_), *session_.tokenizer, prompts, g);
            }
            executor_->model().set_training(session_.needs.data == ObjectiveData::kText);
            return out;
          },
          [&](std::vector<double> values) {
            for (Communicator* group : {&parallel_.pipeline(), &parallel_.tensor()}) values = sum_over(*group, std::move(values));
            return sum_over(parallel_.data(), std::move(values));
          });
      for (std::size_t m = 0; m < sampled.micro.size(); ++m) {
        add_micro_batch(out, sampled.micro[m], sampled.micro[m].rows);
        out.advantages.push_back(sampled.advantages[m]);
      }
      out.metrics = std::move(sampled.metrics);
      out.metrics.emplace_back("time/generation_s", std::chrono::duration<double>(Clock::now() - started).count());
      return out;
    }
    for (std::int64_t i = 0; i < s_.grad_accum; ++i) {
      const auto drawn = next_samples(static_cast<std::size_t>(s_.batch_size * ranks_));
      const auto mine = share_of(drawn, me, ranks_);
      if (data == ObjectiveData::kPreferences) {
        const PairBatch pairs = collate_pairs(mine, session_.needs, ObjectiveSamples(session_.chat), *session_.tokenizer, s_.collate);
        add_micro_batch(out, pairs.batch, pairs.pairs);
      } else {
        const Batch b = collate_micro_batch(mine, *session_.collator, *session_.tokenizer, s_);
        add_micro_batch(out, b, b.rows);
      }
    }
    return out;
  }

  // Each position's log-probability of its label from the head's output, as the objective reads
  // them: under the logits divided by the temperature a sampling objective's completions were drawn
  // at; from the head's input a slice of rows at a time where the model offers that
  // (HeadTokenLogps), else from the whole logits.
  at::Tensor token_logps(const at::Tensor& head_output, const at::Tensor& labels) {
    const double temperature = session_.needs.data == ObjectiveData::kPrompts ? session_.needs.sampling.temperature : 1.0;
    if (auto* fused = capability<HeadTokenLogps>(executor_->model()))
      if (at::Tensor logps = fused->token_logps(head_output, labels, temperature); logps.defined()) return logps;
    const at::Tensor logits = executor_->model().logits(head_output);
    return next_token_logps(temperature != 1.0 ? logits / temperature : logits, labels);
  }

  // Each micro-batch's reference log-probabilities (the last stage's), from the model as the run started.
  void reference_passes(StepRows& rows) {
    const auto started = Clock::now();
    executor_->model().set_training(false);
    starting_->with_start_values([&] {
      for (const auto& m : rows.micro) {
        const at::Tensor out = runner_->forward(m.ids, m.positions, m.mask);
        rows.reference.push_back(out.defined() ? token_logps(out, m.labels.to(executor_->head_device())) : at::Tensor());
      }
    });
    executor_->model().set_training(session_.needs.data == ObjectiveData::kText);
    rows.metrics.emplace_back("time/reference_s", std::chrono::duration<double>(Clock::now() - started).count());
  }

  StepResult train_step(std::int64_t step) {
    // An objective that compares log-probabilities (with the reference's, or with those the
    // completions were sampled at) trains without dropout, as TRL's disable_dropout does.
    executor_->model().set_training(session_.needs.data == ObjectiveData::kText);
    StepRows rows = step_rows(step);
    auto& micro = rows.micro;
    const auto& padding = rows.padding;
    // The labels go to the head's device before the forward pass is queued: a copy from host
    // memory waits for its device to drain, which after the forward would leave the GPU idle
    // while the host starts the backward.
    if (runner_->holds_last_stage())
      for (auto& m : micro) m.labels = m.labels.to(executor_->head_device());
    // The loss is normalised by the label tokens (and rows) of the whole step on every rank, so
    // summing the ranks' gradients gives exactly one process's gradient over the global batch.
    const auto global = sum_over(parallel_.data(), {static_cast<double>(rows.label_tokens), static_cast<double>(rows.tokens), static_cast<double>(rows.skipped),
                                                    static_cast<double>(std::count(padding.begin(), padding.end(), false)), static_cast<double>(rows.rows)});
    const auto all_labels = static_cast<std::int64_t>(global[0]);
    skipped_ += static_cast<std::size_t>(global[2]);
    if (all_labels == 0)
      throw UserError("step " + std::to_string(step + 1) + ": " +
                      (session_.needs.data == ObjectiveData::kPreferences ? "no pair of the " : "the collator kept no sample with labels of the ") +
                      std::to_string(s_.batch_size * s_.grad_accum * ranks_) + " drawn (" + std::to_string(skipped_) +
                      " skipped so far: no response template, or too long for [data] max_length); check the data" +
                      (session_.needs.data == ObjectiveData::kPreferences ? " and [data] max_length" : " against the [collator] templates"));
    if (starting_) reference_passes(rows);
    const auto update_started = Clock::now();
    const auto& metric_names = session_.needs.metric_names;
    std::vector<at::Tensor> metric_sums(metric_names.size());
    std::vector<double> metric_counts(metric_names.size(), 0.0);
    // The loss is read back once, after every backward pass has been queued, so the host does not
    // wait for the forward pass before launching the backward one.
    // The model's own term (AuxiliaryLoss) joins as the mean over the step's micro-batches of every rank.
    at::Tensor auxiliary;
    const auto loss_of = [&](const ForwardState& state, std::size_t m) {
      const at::Tensor& labels = micro[m].labels;
      // A padding row adds nothing, but under expert parallelism its backward must still run: the
      // group's other ranks exchange gradients inside it.
      if (padding[m]) {
        const at::Tensor l = executor_->loss_sum(state.hidden, labels) / static_cast<double>(all_labels);
        return experts_ != nullptr && state.hidden.requires_grad() ? l + state.hidden.sum() * 0.0 : l;
      }
      ObjectiveRows r;
      r.rows = labels.size(0);
      r.mask = labels.ne(kIgnoreLabel).to(at::kFloat);
      r.mask.narrow(1, 0, 1).zero_();
      r.loss_sum = [&] { return executor_->loss_sum(state.hidden, labels); };
      r.token_logps = [&] { return token_logps(state.hidden, labels); };
      r.tokens = static_cast<double>(rows.labels[m]);
      if (m < rows.reference.size()) r.reference_logps = rows.reference[m];
      if (m < rows.advantages.size()) r.advantages = rows.advantages[m].to(labels.device());
      r.pairs = rows.pairs[m];
      r.step_rows = global[4];
      r.step_tokens = static_cast<double>(all_labels);
      ObjectiveLoss o = session_.objective->loss(r);
      for (std::size_t k = 0; k < metric_names.size(); ++k)
        for (const auto& metric : o.metrics)
          if (metric.name == metric_names[k]) {
            const at::Tensor v = metric.sum.detach().to(at::kDouble).to(labels.device());
            metric_sums[k] = metric_sums[k].defined() ? metric_sums[k] + v : v;
            metric_counts[k] += metric.count;
          }
      at::Tensor l = o.loss;
      if (const at::Tensor term = auxiliary_ ? auxiliary_->auxiliary_loss(state) : at::Tensor(); term.defined()) {
        auxiliary = auxiliary.defined() ? auxiliary + term.detach() : term.detach();
        l = l + term.to(l.device()) * (auxiliary_->auxiliary_loss_weight() / global[3]);
      }
      return l;
    };
    const at::Tensor total = runner_->train_step(micro, loss_of, scaler_.scale(),
                                                 [&] {  // the last backward sums each bucket of gradients over the ranks as soon as it is complete
                                                   sync_->arm();
                                                   if (expert_sync_) expert_sync_->arm();
                                                 });
    sync_->finish();
    if (expert_sync_) expert_sync_->finish();
    runner_->sum_tied_gradients(optimizer_->params());
    // The unscale, the gradients' norm and the optimizer's lists are queued or built while the
    // device still runs the backward pass: after the loss's read below the device would wait for
    // the host's work.
    if (scaler_.scale() != 1.0) optimizer_->scale_grads(1.0 / scaler_.scale());
    const auto squares = optimizer_->queue_grad_squares(counted_elsewhere());
    std::vector<at::Tensor> expert_squares;  // this rank's experts', summed over the expert group below
    if (experts_ != nullptr) {
      std::vector<bool> others(expert_shared_.size());
      for (std::size_t i = 0; i < others.size(); ++i) others[i] = !expert_shared_[i];
      expert_squares = optimizer_->queue_grad_squares(others);
    }
    optimizer_->prepare_step();
    const double step_loss = total.defined() ? total.item<double>() : 0.0;  // on the last stage's rank
    // One more small collective: the step's loss over every rank, and whether any rank was asked
    // to stop (each then stops after this same step).
    // (The ranks of a tensor group hold the same loss: one of them counts it.)
    const double auxiliary_sum = auxiliary.defined() && parallel_.coord().tensor == 0 ? auxiliary.item<double>() : 0.0;
    // The objective's metrics ride along, as sums and counts (the last stage's, one tensor rank's).
    const bool counts_metrics = parallel_.coord().tensor == 0 && runner_->holds_last_stage();
    std::vector<double> small{parallel_.coord().tensor == 0 ? step_loss : 0.0, static_cast<double>(stop_signal.load()), auxiliary_sum};
    for (std::size_t k = 0; k < metric_names.size(); ++k) {
      small.push_back(counts_metrics && metric_sums[k].defined() ? metric_sums[k].item<double>() : 0.0);
      small.push_back(counts_metrics ? metric_counts[k] : 0.0);
    }
    const auto after = sum_over(parallel_.world(), small);
    StepResult r;
    r.loss = after[0];
    r.auxiliary = after[2] / global[3];
    r.tokens = static_cast<std::int64_t>(global[1]);
    r.stop_signal = after[1] > 0 ? (stop_signal.load() != 0 ? stop_signal.load() : SIGTERM) : 0;
    for (std::size_t k = 0; k < metric_names.size(); ++k)
      if (after[4 + 2 * k] > 0) r.metrics.emplace_back(metric_names[k], after[3 + 2 * k] / after[4 + 2 * k]);
    if (!finish_step(step, squares, expert_squares)) {
      if (main()) spdlog::warn("step {}: gradients overflowed at loss scale {}; step skipped, scale halved", step + 1, scaler_.scale() * 2);
    }
    for (auto& m : rows.metrics) r.metrics.push_back(std::move(m));
    if (session_.needs.data != ObjectiveData::kText)
      r.metrics.emplace_back("time/update_s", std::chrono::duration<double>(Clock::now() - update_started).count());
    return r;
  }

  // The parameters whose gradient another rank counts in the norm. Over every stage (each counts
  // its own parameters; a tied copy once) and every tensor rank (each its shards; what they all
  // hold whole, once), so clipping and the fp16 overflow check agree on every rank.
  std::vector<bool> counted_elsewhere() const {
    std::vector<bool> skip = runner_->counted_elsewhere();
    if (parallel_.coord().tensor != 0)
      for (std::size_t i = 0; i < skip.size(); ++i) skip[i] = skip[i] || !split_[i];
    for (std::size_t i = 0; i < skip.size(); ++i) skip[i] = skip[i] || expert_shared_[i];  // counted apart
    return skip;
  }

  // Why a step's gradients are not finite, on every rank alike (only a failing step pays for it):
  // the weights themselves may be, from the last step's update or from the start.
  std::string why_not_finite(std::int64_t step) {
    double bad = 0;
    std::string first;
    for (const auto& p : optimizer_->params())
      if (!at::isfinite(p.tensor).all().item<bool>()) {
        bad = 1;
        first = " (" + p.name + " among them)";
        break;
      }
    bad = sum_over(parallel_.world(), {bad})[0];
    char settings[160];
    std::snprintf(settings, sizeof settings, "[train] optimizer = \"%s\", lr = %g, adam_epsilon = %g, weight_decay = %g", s_.optimizer.c_str(), s_.lr,
                  s_.adam_epsilon, s_.weight_decay);
    if (bad > 0 && step > first_step_)
      return "the gradients are not finite because the trainable weights are not" + first + ": step " + std::to_string(step) + "'s update made them so (" +
             settings + "); lower lr, or raise adam_epsilon if it is tiny";
    if (bad > 0) return "the gradients are not finite because the trainable weights are not" + first + ", before any update (the loaded weights or adapter hold NaN or inf)";
    return "the gradients are not finite (the weights are); lower [train] lr";
  }

  // Checks, clips and applies the unscaled gradients (the same on every rank: they were summed),
  // from their squares queued by queue_grad_squares. False when fp16 overflowed.
  bool finish_step(std::int64_t step, const std::vector<at::Tensor>& queued_squares, const std::vector<at::Tensor>& expert_squares) {
    double squares = Optimizer::read_squares(queued_squares);
    if (experts_ != nullptr) squares += sum_over(experts_->expert(), {Optimizer::read_squares(expert_squares)})[0];
    if (parallel_.mesh().tensor > 1) squares = sum_over(parallel_.tensor(), {squares})[0];
    if (parallel_.mesh().pipeline > 1) squares = sum_over(parallel_.pipeline(), {squares})[0];
    const double norm = std::sqrt(squares);
    const bool finite = std::isfinite(norm);
    if (finite) grad_norm_sum_ += norm;
    if (!finite && !scaler_.enabled()) throw UserError("step " + std::to_string(step + 1) + ": " + why_not_finite(step));
    if (!scaler_.update(finite)) {
      optimizer_->zero_grad();
      return false;
    }
    if (s_.max_grad_norm > 0 && norm > s_.max_grad_norm) optimizer_->scale_grads(s_.max_grad_norm / (norm + 1e-6));
    optimizer_->step(lr_.at(step, total_steps_));
    optimizer_->zero_grad();
    // The tensor ranks' whole copies by default, from the first step on (a plugin that forgets a
    // gradient sum drifts from step 1, and silently); every replica every step when asked.
    const bool due = s_.check_replicas_every > 0 && (step == first_step_ || (step + 1) % s_.check_replicas_every == 0);
    if (s_.check_replicas || due) {
      const auto& params = optimizer_->params();
      if (s_.check_replicas) {
        std::vector<bool> everywhere(expert_shared_.size());
        for (std::size_t i = 0; i < everywhere.size(); ++i) everywhere[i] = !expert_shared_[i];
        check_replicas(parallel_.data(), "data", params, everywhere, step, comm_device());
        if (experts_ != nullptr) check_replicas(experts_->expert_replicas(), "data (same experts)", params, expert_shared_, step, comm_device());
      }
      std::vector<bool> whole(split_.size());
      for (std::size_t i = 0; i < whole.size(); ++i) whole[i] = !split_[i];
      check_replicas(parallel_.tensor(), "tensor", params, whole, step, comm_device());
    }
    return true;
  }

  // The model as a Hugging Face folder, with the model folder's generation_config.json and the
  // tokenizer's files beside it (rank 0, once every rank wrote its part).
  void save_model_folder(const fs::path& dir) {
    outputs_->save_model(executor_->model(), dir);
    // Rank 0 alone, between collectives: a failure here is a warning, never a rank that leaves the
    // others waiting (the weights are written).
    if (main()) try {
        write_hf_companions(dir, model_folder_of(session_), tokenizer_folder_of(session_));
      } catch (const std::exception& e) {
        spdlog::warn("{}: generation_config.json and the tokenizer's files were not written beside the weights: {}", dir.string(), e.what());
      }
  }

  // [train] best_metric of an evaluation (nullopt without one).
  std::optional<double> metric(const EvalResult& e) const {
    if (s_.best_metric == "eval_loss") return e.loss;
    if (s_.best_metric != "exact_match") return std::nullopt;
    if (e.prompts == 0)
      throw UserError("[train] best_metric = \"exact_match\": the evaluation found no prompt to answer in [data] eval (the collator's response "
                      "template splits a sample into prompt and answer); use best_metric = \"eval_loss\"");
    return e.exact_match();
  }
  // Whether `candidate` beats `than` by more than `by` (a lower loss, a higher exact-match).
  bool better(double candidate, std::optional<double> than, double by) const {
    if (!than) return true;
    return s_.best_metric == "eval_loss" ? candidate < *than - by : candidate > *than + by;
  }

  // An evaluation between steps, kept for the checkpoint of its step; early stopping counts the
  // evaluations in a row that did not beat the best one by early_stopping_threshold.
  void evaluate_during_training(std::int64_t step) {
    eval_at_step_ = evaluate(step);
    eval_step_ = step;
    const auto value = metric(*eval_at_step_);
    if (!value) return;
    const bool improved = better(*value, best_eval_, s_.early_stopping_threshold);
    if (better(*value, best_eval_, 0)) best_eval_ = *value;
    evals_without_improvement_ = improved ? 0 : evals_without_improvement_ + 1;
    if (s_.early_stopping_patience > 0 && evals_without_improvement_ >= s_.early_stopping_patience) {
      stop_early_ = true;
      if (main())
        spdlog::info("early stopping at step {}: {} did not improve in {} evaluations in a row (best {})", step, s_.best_metric,
                     evals_without_improvement_, *best_eval_);
    }
  }

  // The held-out loss and exact-match, logged and written as a metrics row.
  // `weights_of`: a checkpoint whose weights were loaded back (the row says so).
  EvalResult evaluate(std::int64_t step, const std::string& weights_of = "") {
    const EvalResult e = evaluator_->evaluate(eval_.samples);
    if (main()) {
      nlohmann::json row = {{"step", step}, {"eval", true}, {"eval_loss", e.loss}, {"eval_samples", e.samples}};
      if (e.prompts > 0) row["exact_match"] = e.exact_match();
      if (!weights_of.empty()) row["weights_of"] = weights_of;
      metrics_.append(row);
      std::cout << (weights_of.empty() ? "eval at step " + std::to_string(step) : "eval of " + weights_of + "'s weights") << "  loss " << fixed(e.loss, 4);
      if (e.prompts > 0) std::cout << "  exact-match " << fixed(100 * e.exact_match(), 1) << "% (" << e.exact << "/" << e.prompts << ")";
      std::cout << std::endl;
    }
    note_progress(step);
    return e;
  }

  // The CUDA devices this rank uses, each once.
  std::vector<c10::Device> cuda_devices() const {
    std::vector<c10::Device> out;
    for (const auto& d : executor_->devices())
      if (d.is_cuda()) out.push_back(d);
    return out;
  }

  void checkpoint(std::int64_t step) {
    CheckpointState state;
    state.step = step;
    state.optimizer_steps = optimizer_->steps_taken();
    state.epoch = draws_->cursor().epoch;
    state.index = draws_->cursor().index;
    state.loss_scale = scaler_.scale();
    state.good_steps = scaler_.good_steps();
    state.skipped_samples = skipped_;
    state.total_steps = total_steps_;
    state.last_loss = last_loss_;
    char name[32];
    std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
    if (eval_step_ == step && eval_at_step_) {
      state.eval_loss = eval_at_step_->loss;
      if (eval_at_step_->prompts > 0) state.exact_match = eval_at_step_->exact_match();
      if (const auto value = metric(*eval_at_step_); value && better(*value, best_value_, 0)) {
        best_ = name;
        best_value_ = value;
      }
    }
    state.best = best_;
    state.best_value = best_value_;
    state.best_eval = best_eval_;
    state.evals_without_improvement = evals_without_improvement_;
    // A full fine-tune's checkpoint holds its model as a Hugging Face folder, as an adapter's holds
    // the adapter.
    checkpointer_->save(state, *optimizer_, [&](const fs::path& dir) {
      if (session_.adapter) outputs_->save_adapter(*session_.adapter, executor_->model(), dir / "adapter");
      else save_model_folder(dir / "model");
    });
    if (best_ == name) checkpointer_->name_best(best_);
    checkpointer_->prune(s_.keep_checkpoints, best_);
    note_progress(step);
  }

  std::int64_t restore() {
    const auto state =
        checkpointer_->restore({total_steps_, s_.batch_size * s_.grad_accum * ranks_, train_.samples.size()}, *optimizer_);
    if (!state) {
      if (main()) {
        spdlog::warn("--resume: no checkpoint in {} yet; starting from step 0", (out_ / "checkpoints").string());
        metrics_.start_empty();
      }
      return 0;
    }
    draws_ = std::make_unique<SampleDraws>(train_.samples.size(), s_.seed, s_.shuffle, DrawCursor{state->epoch, state->index});
    scaler_.restore(state->loss_scale, state->good_steps);
    skipped_ = state->skipped_samples;
    last_loss_ = state->last_loss;
    last_window_ = {state->last_loss, 1};
    best_ = state->best;
    best_value_ = state->best_value;
    best_eval_ = state->best_eval;
    evals_without_improvement_ = state->evals_without_improvement;
    stop_early_ = s_.early_stopping_patience > 0 && evals_without_improvement_ >= s_.early_stopping_patience;
    // Rows the interrupted run logged after this checkpoint are logged again by this one.
    if (main()) {
      metrics_.keep_through(state->step);
      spdlog::info("resumed from {} (step {})", (out_ / "checkpoints" / state->name).string(), state->step);
    }
    first_step_ = state->step;
    return state->step;
  }

  Session& session_;
  Parallel& parallel_;
  fs::path out_;
  MetricsSink metrics_{out_};
  const RunConfig& s_;  // the session's
  LearningRate lr_;
  LossScaler scaler_;
  int ranks_ = 1;  // data-parallel ranks
  Dataset train_, eval_;
  std::unique_ptr<Executor> executor_;
  std::unique_ptr<GradientSync> sync_;
  ExpertParallel* experts_ = nullptr;          // the expert groups, under [parallel] expert > 1
  std::vector<bool> expert_shared_;            // per trainable tensor: one of this rank's share of the experts
  std::unique_ptr<GradientSync> expert_sync_;  // their gradients' sum
  std::vector<bool> split_;  // per trainable tensor: split over the tensor group
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<RankRuntime> runner_;
  bool one_stage_ = true;  // no pipeline schedule: this process holds every block
  AuxiliaryLoss* auxiliary_ = nullptr;  // the model's own loss term, where it adds one
  double auxiliary_sum_ = 0;            // its values since the last metrics row
  std::unique_ptr<ReplicaOutputs> outputs_;
  std::unique_ptr<Checkpointer> checkpointer_;
  std::unique_ptr<Evaluator> evaluator_;
  std::unique_ptr<StartingWeights> starting_;  // the reference model's values, where the objective needs one
  std::function<std::int64_t(std::int64_t, std::int64_t)> generation_rows_;  // the rows of a generation cache that fit
  // The objective's metrics since the last metrics row: each one's sum of step values and steps, in first-seen order.
  std::vector<std::pair<std::string, std::pair<double, std::int64_t>>> metric_window_;
  std::int64_t total_steps_ = 0, first_step_ = 0;
  double grad_norm_sum_ = 0;  // over the steps since the last metrics row, before clipping (a step fp16 overflowed adds 0)
  std::unique_ptr<SampleDraws> draws_;
  double last_loss_ = 0;
  std::pair<double, std::int64_t> last_window_{0.0, 0};  // the last metrics row's mean loss and its steps
  std::size_t skipped_ = 0;
  // [train] best_metric and early stopping.
  std::optional<EvalResult> eval_at_step_;  // the latest evaluation between steps, at eval_step_
  std::int64_t eval_step_ = -1;
  std::string best_;                          // the best checkpoint ("" before one)
  std::optional<double> best_value_, best_eval_;  // its metric; the best metric of any evaluation
  std::int64_t evals_without_improvement_ = 0;
  bool stop_early_ = false;
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

TrainReport train(Session& session, const RankContext& where, const fs::path& out_dir, bool resume, const std::function<void()>& first_step_done) {
  StopOnSignal stop;
  Run run(session, where, out_dir);
  return run.run(resume, first_step_done);
}

}  // namespace loom::core
