// The trainer's parts alone: AdamW against the update written out by hand, every optimizer and
// schedule against its reference implementation (torch, transformers, timm), the learning-rate
// schedules at their edges, fp16 loss scaling, optimizer state saved and read by name, the
// metrics file, the checkpointer and the evaluator.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <mutex>
#include <random>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "distributed/data_parallel.hpp"
#include "distributed/distributed.hpp"
#include "loom/collator.hpp"
#include "loom/error.hpp"
#include "loom/kit/blocks.hpp"
#include "loom/kit/quantize.hpp"
#include "loom/kit/safetensors.hpp"
#include "loom/kit/torch_compat.hpp"
#include "loom/tokenizer.hpp"
#include "plugins/plugin_guard.hpp"
#include "runtime/checkpointer.hpp"
#include "runtime/evaluator.hpp"
#include "generation/generate.hpp"
#include "runtime/metrics_sink.hpp"
#include "runtime/optimizer.hpp"
#include "runtime/micro_batches.hpp"
#include "runtime/packing.hpp"
#include "runtime/rank_runtime.hpp"
#include "test_support.hpp"

namespace loom::test {
namespace {
using core::Optimizer;
using core::OptimizerSettings;
using core::LearningRate;
using core::LossScaler;

// Two AdamW steps with weight decay, computed here in double from the published update rule
// (Loshchilov & Hutter): w <- w (1 - lr wd); m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2;
// w <- w - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps).
TEST(AdamW, MatchesTheUpdateRuleByHand) {
  const OptimizerSettings s{core::OptimizerKind::kAdamW, 0.01, 0.9, 0.999, 1e-8};
  const std::vector<double> w0 = {1.0, -2.0, 0.25}, g1 = {0.5, 0.1, -3.0}, g2 = {-0.2, 0.4, 1.0};
  const double lr1 = 0.1, lr2 = 0.05;
  at::Tensor w = at::tensor(std::vector<float>(w0.begin(), w0.end())).requires_grad_(true);
  Optimizer adam({{"w", 0, w}}, s);
  w.mutable_grad() = at::tensor(std::vector<float>(g1.begin(), g1.end()));
  adam.step(lr1);
  w.mutable_grad() = at::tensor(std::vector<float>(g2.begin(), g2.end()));
  adam.step(lr2);
  for (std::size_t i = 0; i < w0.size(); ++i) {
    double x = w0[i], m = 0, v = 0;
    int t = 0;
    for (const auto& [g, lr] : {std::pair{g1[i], lr1}, std::pair{g2[i], lr2}}) {
      ++t;
      x *= 1 - lr * s.weight_decay;
      m = s.beta1 * m + (1 - s.beta1) * g;
      v = s.beta2 * v + (1 - s.beta2) * g * g;
      x -= lr * (m / (1 - std::pow(s.beta1, t))) / (std::sqrt(v / (1 - std::pow(s.beta2, t))) + s.eps);
    }
    EXPECT_NEAR(w[static_cast<std::int64_t>(i)].item<double>(), x, 1e-6) << "element " << i;
  }
  EXPECT_EQ(adam.steps_taken(), 2);
}

// A bf16 weight keeps an fp32 master: updates smaller than bf16's spacing add up there and reach
// the weight once they cross a rounding boundary, instead of being lost every step.
TEST(AdamW, Bf16WeightsKeepSmallUpdatesInTheirMasterCopy) {
  at::Tensor w = at::ones({1}, at::kBFloat16).requires_grad_(true);
  Optimizer adam({{"w", 0, w}}, {});
  for (int i = 0; i < 40; ++i) {
    w.mutable_grad() = at::ones({1}, at::kBFloat16);
    adam.step(1e-4);  // each step moves the master by ~1e-4, far below bf16's 2^-8 near 1
  }
  std::vector<std::pair<std::string, at::Tensor>> state;
  adam.save(state);
  ASSERT_EQ(state[0].first, "param/w");
  EXPECT_EQ(state[0].second.scalar_type(), at::kFloat);
  EXPECT_NEAR(state[0].second.item<double>(), 1.0 - 40 * 1e-4, 1e-5);
  EXPECT_EQ(w.item<float>(), at::tensor(1.0f - 40 * 1e-4f).to(at::kBFloat16).item<float>());
  EXPECT_LT(w.item<float>(), 1.0f);
}

// Gradient norm and scaling see every gradient; zero_grad drops them.
TEST(AdamW, NormScaleAndZero) {
  at::Tensor a = at::zeros({2}).requires_grad_(true), b = at::zeros({1}).requires_grad_(true);
  Optimizer adam({{"a", 0, a}, {"b", 1, b}}, {});
  a.mutable_grad() = at::tensor({3.0f, 0.0f});
  b.mutable_grad() = at::tensor({4.0f});
  EXPECT_NEAR(adam.grad_norm(), 5.0, 1e-6);
  adam.scale_grads(0.5);
  EXPECT_NEAR(adam.grad_norm(), 2.5, 1e-6);
  adam.zero_grad();
  EXPECT_FALSE(a.grad().defined());
  EXPECT_EQ(adam.grad_norm(), 0.0);
}

// The lists step() updates may be built early (while the device still runs the backward pass):
// the update equals one built at the step, after the gradients were scaled in place; after
// zero_grad() and new gradients, the new ones count.
TEST(AdamW, AStepPreparedEarlyEqualsOneBuiltAtTheStep) {
  at::manual_seed(3);
  const auto make = [] {
    return std::vector<at::Tensor>{at::randn({3, 4}).to(at::kBFloat16).requires_grad_(true), at::randn({5}).requires_grad_(true),
                                   at::randn({2, 2}).to(at::kBFloat16).requires_grad_(true)};
  };
  at::manual_seed(4);
  auto early = make();
  at::manual_seed(4);
  auto late = make();
  Optimizer a({{"x", 0, early[0]}, {"y", 1, early[1]}, {"z", 2, early[2]}}, {core::OptimizerKind::kAdamW, 0.01, 0.9, 0.999, 1e-8});
  Optimizer b({{"x", 0, late[0]}, {"y", 1, late[1]}, {"z", 2, late[2]}}, {core::OptimizerKind::kAdamW, 0.01, 0.9, 0.999, 1e-8});
  for (int step = 0; step < 3; ++step) {
    for (std::size_t i = 0; i < early.size(); ++i) {
      const at::Tensor g = at::randn(early[i].sizes()).to(early[i].scalar_type());
      early[i].mutable_grad() = g.clone();
      late[i].mutable_grad() = g.clone();
    }
    a.prepare_step();
    if (step == 1) {
      // Gradients dropped and made anew after the lists were built.
      a.zero_grad();
      b.zero_grad();
      for (std::size_t i = 0; i < early.size(); ++i) {
        const at::Tensor g = at::randn(early[i].sizes()).to(early[i].scalar_type());
        early[i].mutable_grad() = g.clone();
        late[i].mutable_grad() = g.clone();
      }
    }
    a.scale_grads(0.5);
    b.scale_grads(0.5);
    a.step(1e-2);
    b.step(1e-2);
    for (std::size_t i = 0; i < early.size(); ++i) EXPECT_TRUE(at::equal(early[i], late[i])) << "step " << step << ", tensor " << i;
  }
}

// State is saved and read by parameter name: a checkpoint of another model is refused naming the
// parameter it lacks, and a matching one restores weights and moments exactly.
TEST(AdamW, StateRoundTripsByName) {
  const auto dir = temp_dir();
  at::Tensor w = at::tensor({1.0f, 2.0f}).requires_grad_(true);
  Optimizer adam({{"layers.0.w", 0, w}}, {});
  w.mutable_grad() = at::tensor({0.5f, -0.5f});
  adam.step(0.1);
  std::vector<std::pair<std::string, at::Tensor>> state;
  adam.save(state);
  kit::write_safetensors(dir / "opt.safetensors", state);

  at::Tensor w2 = at::zeros({2}).requires_grad_(true);
  Optimizer again({{"layers.0.w", 0, w2}}, {});
  again.load(kit::SafetensorsFile(dir / "opt.safetensors"), 1);
  EXPECT_TRUE(at::equal(w2, w));
  // The next step from the restored state equals the next step of the original.
  w.mutable_grad() = at::tensor({0.25f, 0.25f});
  w2.mutable_grad() = at::tensor({0.25f, 0.25f});
  adam.step(0.1);
  again.step(0.1);
  EXPECT_TRUE(at::equal(w2, w));

  at::Tensor other = at::zeros({2}).requires_grad_(true);
  Optimizer wrong({{"layers.1.w", 0, other}}, {});
  try {
    wrong.load(kit::SafetensorsFile(dir / "opt.safetensors"), 1);
    FAIL() << "loaded state of another parameter";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("no optimizer state for parameter layers.1.w"), std::string::npos) << e.what();
  }
}

// Splits an event file into its TFRecords' data, checking each record's framing and CRCs.
std::vector<std::string> event_records(const std::filesystem::path& file) {
  const std::string bytes = read_file(file);
  std::vector<std::string> out;
  const auto u32 = [&](std::size_t at) {
    std::uint32_t v = 0;
    for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(bytes.at(at + static_cast<std::size_t>(i)));
    return v;
  };
  std::size_t at = 0;
  while (at < bytes.size()) {
    const std::uint64_t length = u32(at) | (static_cast<std::uint64_t>(u32(at + 4)) << 32);
    EXPECT_EQ(u32(at + 8), formats::tensorboard::masked_crc(formats::tensorboard::crc32c(bytes.substr(at, 8))));
    const std::string data = bytes.substr(at + 12, length);
    EXPECT_EQ(u32(at + 12 + length), formats::tensorboard::masked_crc(formats::tensorboard::crc32c(data)));
    out.push_back(data);
    at += 16 + length;
  }
  return out;
}

TEST(TensorBoard, ChecksumsAreCrc32cAndEventsEncodeAsProtobuf) {
  // CRC-32C's check value (RFC 3720's polynomial) and TFRecord's mask of it.
  EXPECT_EQ(formats::tensorboard::crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(formats::tensorboard::crc32c(""), 0u);
  // Event{wall_time: 1.5, step: 3, summary {value {tag: "a" simple_value: 2}}}, encoded by hand from
  // the .proto field numbers: 09 <double> 10 03 2a 0a 0a 08 0a 01 'a' 15 <float 2.0>.
  const std::string record = formats::tensorboard::scalars_event(1.5, 3, {{"a", 2.0f}});
  const std::string expected_event("\x09\x00\x00\x00\x00\x00\x00\xf8\x3f\x10\x03\x2a\x0a\x0a\x08\x0a\x01" "a" "\x15\x00\x00\x00\x40", 23);
  ASSERT_EQ(record.size(), 16 + expected_event.size());
  EXPECT_EQ(record.substr(12, expected_event.size()), expected_event);
  // A negative step is int64's ten-byte varint.
  EXPECT_EQ(formats::tensorboard::scalars_event(1, -1, {}).size(), 16u + 9 + 1 + 10 + 2);
  // Fields at proto3's default are left out, as protobuf itself writes them.
  EXPECT_EQ(formats::tensorboard::scalars_event(0, 0, {}).size(), 16u + 2);
}

TEST(TensorBoard, RowsBecomeGroupedTags) {
  const auto scalars = core::metric_scalars({{"step", 4}, {"time", 1.7e9}, {"loss", 0.5}, {"lr", 1e-3}, {"peak_memory_bytes", {{"cuda:0", 1073741824}}}});
  ASSERT_EQ(scalars.size(), 3u);
  EXPECT_EQ(scalars[0], (std::pair<std::string, float>("train/loss", 0.5f)));
  EXPECT_EQ(scalars[1], (std::pair<std::string, float>("train/lr", 1e-3f)));
  EXPECT_EQ(scalars[2], (std::pair<std::string, float>("train/peak_memory_gib/cuda:0", 1.0f)));
  const auto eval = core::metric_scalars({{"step", 4}, {"eval", true}, {"eval_loss", 0.25}, {"exact_match", 0.5}});
  ASSERT_EQ(eval.size(), 2u);
  EXPECT_EQ(eval[0].first, "eval/loss");
  EXPECT_EQ(eval[1].first, "eval/exact_match");
}

// metrics.jsonl and its event file as a resume leaves them: the rows through the checkpoint's
// step, nothing past a torn line, the events rebuilt from the kept rows; a file that is not there
// starts empty, and one that cannot be written is one clear error.
TEST(MetricsSink, KeepsTheRowsThroughTheCheckpointsStep) {
  const std::filesystem::path dir = temp_dir();
  const core::MetricsSink sink(dir);
  sink.start_empty();
  ASSERT_EQ(event_records(sink.events_file()).size(), 1u);  // the file version
  for (int step = 1; step <= 5; ++step) sink.append({{"step", step}, {"time", 100.0 + step}, {"loss", 1.0 / step}});
  sink.append({{"step", 5}, {"eval", true}, {"eval_loss", 0.1}});
  EXPECT_EQ(metrics_rows(sink.file(), false).size(), 6u);
  const auto appended = event_records(sink.events_file());
  ASSERT_EQ(appended.size(), 7u);
  sink.keep_through(3);
  auto rows = metrics_rows(sink.file(), false);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows.back()["step"], 3);
  const auto rebuilt = event_records(sink.events_file());
  ASSERT_EQ(rebuilt.size(), 4u);
  for (std::size_t i = 1; i < rebuilt.size(); ++i) EXPECT_EQ(rebuilt[i], appended[i]) << "event " << i;

  // A kill mid-line: the torn line goes.
  write_file(sink.file(), read_file(sink.file()) + "{\"step\": 4, \"lo");
  sink.keep_through(9);
  EXPECT_EQ(metrics_rows(sink.file(), false).size(), 3u);
  EXPECT_EQ(event_records(sink.events_file()).size(), 4u);

  // A blank line (or any line that is no row) after row 1 costs no row after it: the resumed run
  // keeps every row through its checkpoint, as `loom report` reads them.
  const std::string three = read_file(sink.file());
  const auto first_end = three.find('\n') + 1;
  write_file(sink.file(), three.substr(0, first_end) + "\n   \n[1, 2]\n" + three.substr(first_end) + "{\"step\": 4, \"loss\": 0.25}\n");
  sink.keep_through(3);
  rows = metrics_rows(sink.file(), false);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows.back()["step"], 3);
  EXPECT_EQ(event_records(sink.events_file()).size(), 4u);

  std::filesystem::create_directories(dir / "none");
  const core::MetricsSink absent(dir / "none");
  absent.keep_through(3);
  EXPECT_EQ(read_file(absent.file()), "");

  std::filesystem::create_directories(dir / "folder" / "metrics.jsonl");
  EXPECT_THROW(core::MetricsSink(dir / "folder").keep_through(1), UserError);
  try {
    core::MetricsSink(dir / "missing").append({{"step", 1}});
    ADD_FAILURE() << "no error";
  } catch (const UserError& e) {
    EXPECT_TRUE(contains(e.what(), "cannot write " + (dir / "missing" / "metrics.jsonl").string())) << e.what();
  }
}

TEST(LearningRate, WarmupThenEachScheduleAtItsEdges) {
  const std::int64_t total = 110;
  for (const char* scheduler : {"cosine", "linear", "constant"}) {
    SCOPED_TRACE(scheduler);
    const LearningRate lr{1.0, 10, scheduler};
    EXPECT_DOUBLE_EQ(lr.at(0, total), 0.1);  // the first step already learns
    EXPECT_DOUBLE_EQ(lr.at(4, total), 0.5);
    EXPECT_DOUBLE_EQ(lr.at(9, total), 1.0);
    EXPECT_DOUBLE_EQ(lr.at(10, total), 1.0);  // decay starts from the peak
  }
  const LearningRate cosine{1.0, 10, "cosine"}, linear{1.0, 10, "linear"}, constant{1.0, 10, "constant"};
  EXPECT_NEAR(cosine.at(60, total), 0.5, 1e-12);  // half way
  EXPECT_NEAR(cosine.at(110, total), 0.0, 1e-12);
  EXPECT_NEAR(linear.at(60, total), 0.5, 1e-12);
  EXPECT_NEAR(linear.at(109, total), 0.01, 1e-12);
  EXPECT_DOUBLE_EQ(constant.at(109, total), 1.0);
  // No warm-up, and a run no longer than its warm-up.
  EXPECT_DOUBLE_EQ((LearningRate{2.0, 0, "cosine"}).at(0, 5), 2.0);
  EXPECT_DOUBLE_EQ((LearningRate{2.0, 10, "linear"}).at(4, 5), 1.0);
}

nlohmann::json optimizer_reference() {
  return nlohmann::json::parse(read_file(source_dir() / "tests/fixtures/optimizers/reference.json"));
}

// transformers' schedules of the same names (tests/fixtures/optimizers/make_reference.py) step for
// step after warm-up; loom's warm-up is theirs one step earlier (its first step learns: (s + 1) / w
// where theirs is s / w; WSD's rises from min_lr_ratio, loom's from 0).
TEST(LearningRate, SchedulesMatchTransformers) {
  const auto ref = optimizer_reference()["lr_schedules"];
  const std::int64_t total = ref["total"], warmup = ref["warmup"];
  for (const auto& [name, c] : ref["schedules"].items()) {
    SCOPED_TRACE(name);
    LearningRate lr{1.0, warmup, name.rfind("wsd", 0) == 0 ? "wsd" : name == "cosine_min_lr" ? "cosine" : name};
    lr.min_ratio = c.value("min_lr_ratio", 0.0);
    lr.cycles = c.value("cycles", 1);
    lr.decay_ratio = c.value("decay_ratio", 0.1);
    lr.decay_shape = c.value("decay_shape", std::string("cosine"));
    const std::vector<double> theirs = c["factors"];
    ASSERT_EQ(theirs.size(), static_cast<std::size_t>(total));
    for (std::int64_t s = 0; s < total; ++s) {
      if (s < warmup && lr.scheduler != "wsd") {
        EXPECT_NEAR(lr.at(s, total), theirs[static_cast<std::size_t>(s + 1)], 1e-12) << "warm-up step " << s;
      }
      if (s >= warmup) {
        EXPECT_NEAR(lr.at(s, total), theirs[static_cast<std::size_t>(s)], 1e-12) << "step " << s;
      }
    }
  }
  // warmup_ratio is ceil(ratio x steps), as TrainingArguments counts it.
  core::RunConfig c;
  c.lr = 1;
  c.scheduler = "constant";
  c.warmup_ratio = 0.03;
  EXPECT_EQ(core::learning_rate(c, 100).warmup, 3);
  EXPECT_EQ(core::learning_rate(c, 101).warmup, 4);
}

// Every optimizer against its reference implementation over five steps of float32 parameters (a
// matrix, a vector, a stack of matrices) with the fixture's gradients and learning rates:
// torch.optim.AdamW and SGD (with and without Nesterov), transformers' Adafactor as its Trainer
// builds it, timm's Lion.
TEST(Optimizers, FollowTheirReferenceImplementations) {
  const auto ref = optimizer_reference();
  const std::vector<std::string> order = {"matrix", "vector", "stack"};
  std::vector<std::string> seen;
  for (const auto& [name, c] : ref["optimizers"].items()) {
    SCOPED_TRACE(name);
    seen.push_back(name);
    OptimizerSettings s;
    s.kind = core::parse_optimizer(name.rfind("sgd", 0) == 0 ? "sgd" : name);
    const auto& set = c["settings"];
    s.weight_decay = set.value("weight_decay", 0.0);
    s.beta1 = set.value("beta1", 0.9);
    s.beta2 = set.value("beta2", 0.999);
    s.eps = set.value("eps", 1e-8);
    s.momentum = set.value("momentum", 0.0);
    s.nesterov = set.value("nesterov", false);
    std::vector<NamedParameter> params;
    for (std::size_t i = 0; i < order.size(); ++i) {
      const std::vector<float> values = ref["params"][order[i]];
      const std::vector<std::int64_t> shape = ref["shapes"][order[i]];
      params.push_back({order[i], i, at::tensor(values).view(shape).requires_grad_(true)});
    }
    Optimizer opt(params, s);
    for (std::size_t step = 0; step < ref["lrs"].size(); ++step) {
      for (auto& p : params) {
        const std::vector<float> g = ref["grads"][step][p.name];
        p.tensor.mutable_grad() = at::tensor(g).view(p.tensor.sizes());
      }
      opt.step(ref["lrs"][step].get<double>());
      opt.zero_grad();
      for (const auto& p : params) {
        const std::vector<float> theirs = c["after"][step][p.name];
        const at::Tensor expected = at::tensor(theirs);
        const double gap = (p.tensor.detach().flatten() - expected).abs().max().item<double>();
        EXPECT_LT(gap, 2e-6) << p.name << " after step " << step + 1;
      }
    }
  }
  EXPECT_EQ(seen, (std::vector<std::string>{"adafactor", "adamw", "lion", "sgd", "sgd_nesterov"}));
}

// 8-bit AdamW: moments as one byte a value (bitsandbytes' dynamic maps) plus a float32 maximum a
// block of 256 for
// tensors of 4096 values or more (float32 below), and a trajectory on a noisy quadratic that stays
// within 2% of float32 AdamW's.
TEST(Optimizers, EightBitAdamWQuantizesItsMomentsAndFollowsAdamW) {
  at::manual_seed(5);
  const at::Tensor target = at::randn({64, 96});
  at::Tensor big8 = at::zeros({64, 96}).requires_grad_(true), big32 = big8.detach().clone().requires_grad_(true);
  at::Tensor small8 = at::zeros({100}).requires_grad_(true);
  OptimizerSettings eight;
  eight.kind = core::OptimizerKind::kAdamW8bit;
  eight.weight_decay = 0.01;
  OptimizerSettings full = eight;
  full.kind = core::OptimizerKind::kAdamW;
  Optimizer q({{"big", 0, big8}, {"small", 1, small8}}, eight), f({{"big", 0, big32}}, full);
  // Codes and maxima for the big tensor (6144 values: 24 blocks), float32 moments for the small one.
  EXPECT_EQ(q.state_bytes(), 6144u * 2 + 24u * 4 * 2 + 100u * 8);
  for (int step = 0; step < 200; ++step) {
    const at::Tensor noise = at::randn({64, 96}) * 0.1;
    big8.mutable_grad() = (big8.detach() - target) + noise;
    big32.mutable_grad() = (big32.detach() - target) + noise;
    small8.mutable_grad() = at::ones({100});
    q.step(0.02);
    f.step(0.02);
  }
  const double distance = (big8 - target).norm().item<double>() / target.norm().item<double>();
  const double apart = (big8 - big32).norm().item<double>() / target.norm().item<double>();
  EXPECT_LT(distance, 0.1);  // it learned: from 1.0
  EXPECT_LT(apart, 0.02) << "8-bit AdamW left float32 AdamW's path";
  std::vector<std::pair<std::string, at::Tensor>> state;
  q.save(state);
  std::map<std::string, at::Tensor> by_name(state.begin(), state.end());
  ASSERT_TRUE(by_name.count("adam8_m/big") && by_name.count("adam8_v_absmax/big") && by_name.count("adam_m/small")) << state.size();
  EXPECT_EQ(by_name["adam8_m/big"].scalar_type(), at::kByte);
  EXPECT_EQ(by_name["adam8_m/big"].numel(), 6144);
  EXPECT_EQ(by_name["adam8_m_absmax/big"].numel(), 24);
  // The second moments' map: bitsandbytes' unsigned dynamic map, 256 ascending values from 0 to 1
  // with 2^(i+1) of them in each decade [0.1, 1) x 10^(i-6).
  const auto& map = kit::dynamic_map_8bit_unsigned();
  EXPECT_TRUE(std::is_sorted(map.begin(), map.end()));
  EXPECT_EQ(std::adjacent_find(map.begin(), map.end()), map.end());
  EXPECT_EQ(map.front(), 0.0f);
  EXPECT_EQ(map.back(), 1.0f);
  for (int i = 0; i < 7; ++i) {
    const double lo = 0.1 * std::pow(10.0, i - 6), hi = std::pow(10.0, i - 6);
    EXPECT_EQ(std::count_if(map.begin(), map.end(), [&](float x) { return x > lo && x < hi; }), 1 << (i + 1)) << "decade " << i;
  }
}

// 8-bit AdamW's step: the CUDA kernel gives the CPU loop's bits (weights, codes, block maxima) over
// three steps, from float32, bfloat16 and (on the GPU alone) float16 gradients, with a last block
// of 5000 values that is not full; a block of zeros keeps the zero code and a zero maximum.
LOOM_GPU_TEST(Optimizers, EightBitStepOnTheGpuGivesTheCpuBits) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const auto& signed_map = kit::dynamic_map_8bit();
  const std::uint8_t zero = static_cast<std::uint8_t>(std::find(signed_map.begin(), signed_map.end(), 0.0f) - signed_map.begin());
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    at::manual_seed(3);
    at::Tensor w = at::randn({5000});
    w.narrow(0, 0, 256).zero_();
    at::Tensor m = at::full({20 * 256}, zero, at::kByte), v = at::zeros({20 * 256}, at::kByte);
    at::Tensor m_max = at::zeros({20}), v_max = at::zeros({20});
    std::vector<at::Tensor> gpu = {w.cuda(), m.cuda(), m_max.cuda(), v.cuda(), v_max.cuda()};
    for (int step = 1; step <= 3; ++step) {
      at::Tensor g = (at::randn({5000}) * 0.1).to(dtype);
      g.narrow(0, 0, 256).zero_();
      const kit::AdamW8bitStep s{1e-2, 0.9, 0.999, 1e-8, 0.01, step};
      kit::adamw_8bit_step(w, g, m, m_max, v, v_max, s);
      kit::adamw_8bit_step(gpu[0], g.cuda(), gpu[1], gpu[2], gpu[3], gpu[4], s);
    }
    EXPECT_TRUE(at::equal(gpu[0].cpu(), w));
    EXPECT_TRUE(at::equal(gpu[1].cpu(), m));
    EXPECT_TRUE(at::equal(gpu[2].cpu(), m_max));
    EXPECT_TRUE(at::equal(gpu[3].cpu(), v));
    EXPECT_TRUE(at::equal(gpu[4].cpu(), v_max));
    EXPECT_EQ(m_max[0].item<float>(), 0.0f);
    EXPECT_EQ(m[0].item<int>(), zero);
    EXPECT_GT(m_max[1].item<float>(), 0.0f);
  }
  // A float16 gradient on the GPU reads as its float32 value does.
  at::manual_seed(4);
  const at::Tensor w = at::randn({300}, at::kCUDA), g = (at::randn({300}) * 0.1).to(at::kHalf).cuda();
  std::vector<at::Tensor> a = {w.clone(), at::full({512}, zero, at::kByte).cuda(), at::zeros({2}).cuda(), at::zeros({512}, at::kByte).cuda(), at::zeros({2}).cuda()};
  std::vector<at::Tensor> b = {w.clone(), a[1].clone(), a[2].clone(), a[3].clone(), a[4].clone()};
  kit::adamw_8bit_step(a[0], g, a[1], a[2], a[3], a[4], {});
  kit::adamw_8bit_step(b[0], g.to(at::kFloat), b[1], b[2], b[3], b[4], {});
  for (std::size_t k = 0; k < a.size(); ++k) EXPECT_TRUE(at::equal(a[k], b[k])) << k;
}

// Every optimizer's state comes back from a checkpoint bit for bit: three steps, saved, two more,
// equal the same two steps from the saved state loaded into a fresh optimizer (bf16 parameters,
// so the master copies travel too; a tensor large enough for 8-bit codes).
TEST(Optimizers, ResumeBitExactFromSavedState) {
  const auto dir = temp_dir();
  for (const char* name : {"adamw", "adamw_8bit", "lion", "adafactor", "sgd"}) {
    SCOPED_TRACE(name);
    OptimizerSettings s;
    s.kind = core::parse_optimizer(name);
    s.weight_decay = 0.01;
    const auto make = [] { return std::vector<at::Tensor>{at::randn({80, 64}).to(at::kBFloat16).requires_grad_(true), at::randn({9}).requires_grad_(true)}; };
    at::manual_seed(8);
    auto a = make();
    auto b = std::vector<at::Tensor>{at::zeros({80, 64}, at::kBFloat16).requires_grad_(true), at::zeros({9}).requires_grad_(true)};
    Optimizer first({{"w", 0, a[0]}, {"v", 1, a[1]}}, s);
    const auto grads = [](int step) {
      at::manual_seed(100 + step);
      return std::vector<at::Tensor>{at::randn({80, 64}).to(at::kBFloat16), at::randn({9})};
    };
    for (int step = 0; step < 3; ++step) {
      const auto g = grads(step);
      a[0].mutable_grad() = g[0];
      a[1].mutable_grad() = g[1];
      first.step(1e-2);
      first.zero_grad();
    }
    std::vector<std::pair<std::string, at::Tensor>> state;
    first.save(state);
    const auto file = dir / (std::string(name) + ".safetensors");
    kit::write_safetensors(file, state);
    Optimizer second({{"w", 0, b[0]}, {"v", 1, b[1]}}, s);
    second.load(kit::SafetensorsFile(file), first.steps_taken());
    for (int step = 3; step < 5; ++step) {
      const auto g = grads(step);
      for (auto* pair : {&a, &b}) {
        (*pair)[0].mutable_grad() = g[0].clone();
        (*pair)[1].mutable_grad() = g[1].clone();
      }
      first.step(1e-2);
      second.step(1e-2);
    }
    EXPECT_TRUE(at::equal(a[0], b[0]) && at::equal(a[1], b[1]));
    // A state written by another optimizer is refused, naming what is missing.
    OptimizerSettings other = s;
    other.kind = s.kind == core::OptimizerKind::kLion ? core::OptimizerKind::kSgd : core::OptimizerKind::kLion;
    Optimizer wrong({{"w", 0, b[0]}, {"v", 1, b[1]}}, other);
    try {
      wrong.load(kit::SafetensorsFile(file), 3);
      ADD_FAILURE() << "loaded another optimizer's state";
    } catch (const UserError& e) {
      EXPECT_TRUE(contains(e.what(), "no optimizer state for parameter w (")) << e.what();
    }
  }
}

TEST(LossScaler, HalvesOnOverflowAndDoublesAfter2000GoodSteps) {
  LossScaler off(false);
  EXPECT_EQ(off.scale(), 1.0);
  EXPECT_TRUE(off.update(true));
  EXPECT_FALSE(off.update(false));  // not finite without scaling: the caller fails the step
  EXPECT_EQ(off.scale(), 1.0);

  LossScaler fp16(true);
  EXPECT_EQ(fp16.scale(), 65536.0);
  EXPECT_FALSE(fp16.update(false));
  EXPECT_EQ(fp16.scale(), 32768.0);
  for (int i = 0; i < 1999; ++i) EXPECT_TRUE(fp16.update(true));
  EXPECT_EQ(fp16.scale(), 32768.0);
  EXPECT_TRUE(fp16.update(true));
  EXPECT_EQ(fp16.scale(), 65536.0);
  EXPECT_FALSE(fp16.update(false));  // an overflow restarts the count
  EXPECT_EQ(fp16.good_steps(), 0);
  fp16.restore(1024.0, 1999);
  EXPECT_TRUE(fp16.update(true));
  EXPECT_EQ(fp16.scale(), 2048.0);
}

// A checkpoint brings back what the run held at its step: the optimizer's state (weights
// included) and the random stream, with the step and cursor; the folder holds only complete
// checkpoints, and one that cannot be written leaves the previous one named.
TEST(Checkpointer, RestoresTheOptimizerAndRandomStreamItSaved) {
  namespace fs = std::filesystem;
  const fs::path dir = temp_dir() / "checkpoints";
  fs::create_directories(dir);
  auto parallel = core::single_process();
  const c10::Device cpu(c10::kCPU);
  const core::RunShape shape{10, 1, 4};
  at::Tensor w = at::tensor({1.0f, 2.0f}).requires_grad_(true);
  Optimizer adam({{"layers.0.w", 0, w}}, {});
  core::Checkpointer checkpointer(dir, *parallel, {}, cpu);
  EXPECT_FALSE(checkpointer.restore(shape, adam).has_value()) << "no checkpoint yet";
  w.mutable_grad() = at::tensor({0.5f, -0.5f});
  adam.step(0.1);
  core::CheckpointState state;
  state.step = 3;
  state.optimizer_steps = 1;
  state.index = 3;
  state.last_loss = 2.5;
  state.total_steps = 10;
  checkpointer.save(state, adam, [](const fs::path& checkpoint) {
    const fs::path adapter = checkpoint / "adapter";
    fs::create_directories(adapter);
    write_file(adapter / "adapter_config.json", "{}");
  });
  const at::Tensor weights = w.detach().clone();
  const at::Tensor drawn = at::rand({4});  // what the run draws after the checkpoint
  EXPECT_EQ(read_file(dir / "latest"), "step-00000003\n");
  EXPECT_TRUE(fs::exists(dir / "step-00000003/adapter/adapter_config.json"));
  EXPECT_EQ(checkpointer.last(), "step-00000003");
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step-00000003"}));

  // The run goes on, and a new process resumes from the checkpoint.
  w.mutable_grad() = at::tensor({1.0f, 1.0f});
  adam.step(0.1);
  at::Tensor w2 = at::zeros({2}).requires_grad_(true);
  Optimizer fresh({{"layers.0.w", 0, w2}}, {});
  core::Checkpointer again(dir, *parallel, {}, cpu);
  const auto restored = again.restore(shape, fresh);
  ASSERT_TRUE(restored.has_value());
  EXPECT_EQ(restored->step, 3);
  EXPECT_EQ(restored->index, 3u);
  EXPECT_EQ(restored->optimizer_steps, 1);
  EXPECT_DOUBLE_EQ(restored->last_loss, 2.5);
  EXPECT_TRUE(at::equal(w2, weights));
  EXPECT_EQ(fresh.steps_taken(), 1);
  EXPECT_TRUE(at::equal(at::rand({4}), drawn)) << "the random stream does not repeat";
  EXPECT_EQ(again.last(), "step-00000003");

  // A part that cannot be written (a full disk) fails the checkpoint and names the intact one.
  state.step = 5;
  try {
    again.save(state, fresh, [](const fs::path&) { throw std::runtime_error("No space left on device"); });
    FAIL() << "a failed write was taken for a checkpoint";
  } catch (const UserError& e) {
    EXPECT_TRUE(contains(e.what(), "cannot write the checkpoint at step 5 (No space left on device); the checkpoint step-00000003 is intact"))
        << e.what();
  }
  EXPECT_EQ(read_file(dir / "latest"), "step-00000003\n");
  EXPECT_FALSE(fs::exists(dir / ".step-00000005.tmp"));
  EXPECT_FALSE(fs::exists(dir / "step-00000005"));

  // A checkpoint of another mesh is refused, not half restored.
  auto json = nlohmann::json::parse(read_file(dir / "step-00000003/trainer.json"));
  json["mesh"]["data"] = 2;
  write_file(dir / "step-00000003/trainer.json", json.dump());
  try {
    again.restore(shape, fresh);
    FAIL() << "restored a checkpoint of another mesh";
  } catch (const UserError& e) {
    EXPECT_TRUE(contains(e.what(), "resume on the same mesh")) << e.what();
  }
}

// A tiny random Llama over the bytes tokenizer's 259 ids, whole on the CPU.
std::unique_ptr<core::Executor> tiny_llama() {
  auto model = make_plugin<Model>("model", "llama",
                                  {{"init", std::string("random")}, {"hidden_size", std::int64_t{32}}, {"intermediate_size", std::int64_t{64}},
                                   {"num_hidden_layers", std::int64_t{2}}, {"num_attention_heads", std::int64_t{4}},
                                   {"num_key_value_heads", std::int64_t{2}}, {"vocab_size", std::int64_t{259}}});
  Plan plan;
  for (const auto& b : model->structure().blocks) plan.blocks.push_back({b.name, "cpu"});
  return core::load_executor(*model, plan, DType::kFloat32, 3, false);
}

// The model as a plugin built before SDK 3.2 offers it: every call forwarded, no
// StaticCacheDecoding, so the runtime runs each row's whole written prefix again per token.
class WithoutCachedDecoding final : public LoadedModel {
 public:
  explicit WithoutCachedDecoding(LoadedModel& inner) : inner_(inner) {}
  std::size_t block_count() const override { return inner_.block_count(); }
  void forward(std::size_t index, ForwardState& state) override { inner_.forward(index, state); }
  at::Tensor loss_sum(const at::Tensor& head_output, const at::Tensor& labels) override { return inner_.loss_sum(head_output, labels); }
  at::Tensor logits(const at::Tensor& head_output) override { return inner_.logits(head_output); }
  std::vector<NamedParameter> parameters() override { return inner_.parameters(); }
  std::vector<NamedLinear> linears() override { return inner_.linears(); }
  void set_training(bool training) override { inner_.set_training(training); }
  void save_pretrained(const std::filesystem::path& dir) override { inner_.save_pretrained(dir); }

 private:
  LoadedModel& inner_;
};

// One sample's ids as a collator's batch of one row, every token labelled.
Batch one_sample(const std::vector<std::int64_t>& ids) {
  const auto n = static_cast<std::int64_t>(ids.size());
  return Batch{1, n, ids, std::vector<std::int64_t>(ids.size(), 1), ids, 0};
}

// The packers lay samples end to end in rows of at most the row length: first-fit-decreasing puts
// each (longest first) into the first row with room, greedy keeps the drawn order. Every token
// lands once, the mask numbers the samples of each row, each sample's first token loses its label
// (it would be predicted from the sample before it), and positions restart with each sample.
TEST(Packing, PackersFillRowsAndMarkEachSample) {
  std::vector<Batch> samples;
  std::int64_t next = 10;
  for (const std::int64_t length : {5, 3, 4, 2, 6}) {
    std::vector<std::int64_t> ids;
    for (std::int64_t t = 0; t < length; ++t) ids.push_back(next++);
    samples.push_back(one_sample(ids));
  }
  const Batch ffd = core::pack_samples(samples, 8, core::Packer::kFirstFitDecreasing, 0);
  // Longest first: 6 | 5 | 4, then 3 joins the 5 and 2 the 6.
  ASSERT_EQ(ffd.rows, 3);
  ASSERT_EQ(ffd.cols, 8);
  EXPECT_EQ(std::vector<std::int64_t>(ffd.input_ids.begin(), ffd.input_ids.begin() + 8), (std::vector<std::int64_t>{24, 25, 26, 27, 28, 29, 22, 23}));
  EXPECT_EQ(std::vector<std::int64_t>(ffd.attention_mask.begin(), ffd.attention_mask.begin() + 8), (std::vector<std::int64_t>{1, 1, 1, 1, 1, 1, 2, 2}));
  EXPECT_EQ(std::vector<std::int64_t>(ffd.labels.begin(), ffd.labels.begin() + 8), (std::vector<std::int64_t>{-100, 25, 26, 27, 28, 29, -100, 23}));
  // The third row: the 4 tokens and padding.
  EXPECT_EQ(std::vector<std::int64_t>(ffd.attention_mask.begin() + 16, ffd.attention_mask.end()), (std::vector<std::int64_t>{1, 1, 1, 1, 0, 0, 0, 0}));
  EXPECT_EQ(std::vector<std::int64_t>(ffd.labels.begin() + 20, ffd.labels.end()), (std::vector<std::int64_t>(4, -100)));
  const core::MicroBatch t = core::to_micro_batch(ffd);
  EXPECT_TRUE(at::equal(t.positions[0], at::tensor(std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 0, 1})));
  EXPECT_TRUE(at::equal(t.positions[1], at::tensor(std::vector<std::int64_t>{0, 1, 2, 3, 4, 0, 1, 2})));
  EXPECT_EQ(core::label_count(t), 4 + 3 + 2 + 1 + 5);  // every token but each sample's first
  // Greedy: 5 and 3 | 4 and 2 | 6.
  const Batch greedy = core::pack_samples(samples, 8, core::Packer::kGreedy, 0);
  ASSERT_EQ(greedy.rows, 3);
  EXPECT_EQ(std::vector<std::int64_t>(greedy.input_ids.begin(), greedy.input_ids.begin() + 8), (std::vector<std::int64_t>{10, 11, 12, 13, 14, 15, 16, 17}));
  EXPECT_EQ(std::vector<std::int64_t>(greedy.attention_mask.begin() + 8, greedy.attention_mask.begin() + 16),
            (std::vector<std::int64_t>{1, 1, 1, 1, 2, 2, 0, 0}));
  for (const Batch& b : {ffd, greedy}) {
    std::vector<std::int64_t> seen;
    for (std::size_t i = 0; i < b.input_ids.size(); ++i)
      if (b.attention_mask[i] > 0) seen.push_back(b.input_ids[i]);
    std::sort(seen.begin(), seen.end());
    std::vector<std::int64_t> all(20);
    std::iota(all.begin(), all.end(), 10);
    EXPECT_EQ(seen, all);
  }
  EXPECT_THROW(core::parse_packer("best_fit"), UserError);
}

// The planner sizes activations for the run's largest micro-batch (largest_micro_batch): exactly the
// largest the trainer's own draws and collation make over every step and data rank, packed or
// padded, with the collator's drops and truncation; packed, it is below batch_size rows of max_length.
TEST(Packing, TheLargestMicroBatchIsTheTrainersOwn) {
  auto tokenizer = make_plugin<Tokenizer>("tokenizer", "bytes", {{"pad_token", std::string("eos")}});
  auto collator = make_plugin<Collator>("collator", "completion-only", {{"response_template", std::string(" A:")}});
  core::Dataset data;
  std::mt19937 rng(11);
  for (int i = 0; i < 40; ++i) {
    // Mostly short; every tenth longer than max_length (truncated, or dropped).
    const int q = 1 + static_cast<int>(rng() % 14) + (i % 10 == 3 ? 40 : 0), a = 1 + static_cast<int>(rng() % 8);
    data.samples.push_back("Q:" + std::string(static_cast<std::size_t>(q), 'q') + " A:" + std::string(static_cast<std::size_t>(a), 'a'));
  }
  data.samples.push_back("no template here");  // dropped by the collator
  for (const bool packing : {true, false}) {
    for (const int ranks : {1, 2}) {
      for (const Truncation truncation : {Truncation::kRight, Truncation::kDrop}) {
        SCOPED_TRACE(std::string(packing ? "packed" : "padded") + ", " + std::to_string(ranks) + " ranks" +
                     (truncation == Truncation::kDrop ? ", long samples dropped" : ""));
        core::RunConfig c;
        c.seed = 5;
        c.batch_size = 6;
        c.grad_accum = 2;
        c.epochs = 3;
        c.packing = packing;
        c.collate.max_length = 40;
        c.collate.truncation = truncation;
        std::int64_t rows = 0, cols = 0;
        core::SampleDraws draws(data.samples.size(), c.seed, c.shuffle);
        for (std::int64_t m = 0; m < core::run_steps(c, data.samples.size(), ranks) * c.grad_accum; ++m) {
          std::vector<std::string> drawn;
          for (const std::size_t i : draws.next(static_cast<std::size_t>(c.batch_size * ranks))) drawn.push_back(data.samples[i]);
          for (int r = 0; r < ranks; ++r) {
            const Batch b = core::collate_micro_batch(core::share_of(drawn, r, ranks), *collator, *tokenizer, c);
            if (b.rows * b.cols > rows * cols) {
              rows = b.rows;
              cols = b.cols;
            }
          }
        }
        const auto largest = core::largest_micro_batch(data, *collator, *tokenizer, c, ranks);
        EXPECT_EQ(largest.rows, rows);
        EXPECT_EQ(largest.cols, cols);
        // The evaluator's batches (its first eval_samples, strided over the ranks, batch_size at a
        // time, padded) are never larger than largest_eval_batch, which is as wide as the widest.
        c.eval_samples = 23;
        std::int64_t eval_tokens = 0, eval_cols = 0;
        for (int r = 0; r < ranks; ++r) {
          std::vector<std::string> mine;
          for (std::size_t i = static_cast<std::size_t>(r); i < 23; i += static_cast<std::size_t>(ranks)) mine.push_back(data.samples[i]);
          for (std::size_t i = 0; i < mine.size(); i += static_cast<std::size_t>(c.batch_size)) {
            const std::vector<std::string> part(mine.begin() + static_cast<std::ptrdiff_t>(i),
                                                mine.begin() + static_cast<std::ptrdiff_t>(std::min(mine.size(), i + static_cast<std::size_t>(c.batch_size))));
            const Batch b = collator->collate(part, *tokenizer, c.collate);
            eval_tokens = std::max(eval_tokens, b.rows * b.cols);
            eval_cols = std::max(eval_cols, b.cols);
          }
        }
        const auto eval = core::largest_eval_batch(data, *collator, *tokenizer, c, ranks);
        EXPECT_LE(eval_tokens, eval.rows * eval.cols);
        EXPECT_EQ(eval.cols, eval_cols);
        EXPECT_LE(largest.rows * largest.cols, c.batch_size * c.collate.max_length);
        if (packing) {
          EXPECT_LT(largest.rows * largest.cols, c.batch_size * c.collate.max_length);
        }
        EXPECT_GT(rows * cols, 0);
      }
    }
  }
}

// A packed row is its samples side by side: each token's logits equal those of its sample run
// alone (padded to the longest, positions from 0), and the summed loss and every parameter's
// gradient equal the padded batch's. Without attention kept inside each sample, or without
// positions restarting, the second sample of a row reads the first and its logits move.
TEST(Packing, PackedRowsGiveEachSamplesLogitsLossAndGradients) {
  auto model = make_plugin<Model>("model", "llama",
                                  {{"init", std::string("random")}, {"hidden_size", std::int64_t{32}}, {"intermediate_size", std::int64_t{64}},
                                   {"num_hidden_layers", std::int64_t{2}}, {"num_attention_heads", std::int64_t{4}},
                                   {"num_key_value_heads", std::int64_t{2}}, {"vocab_size", std::int64_t{259}}});
  ASSERT_NE(core::capability<PackedSequences>(*model), nullptr);
  Plan plan;
  for (const auto& b : model->structure().blocks) plan.blocks.push_back({b.name, "cpu"});
  auto executor = core::load_executor(*model, plan, DType::kFloat32, 5, false);
  executor->model().set_training(false);
  core::RankRuntime runtime(*executor);
  std::vector<at::Tensor> params;
  for (auto& p : executor->model().parameters()) params.push_back(p.tensor.set_requires_grad(true));
  at::manual_seed(3);
  const std::vector<std::int64_t> lengths = {9, 5, 4};
  std::vector<Batch> samples;
  for (const auto length : lengths) {
    const at::Tensor ids = at::randint(3, 259, {length}, at::kLong);
    samples.push_back(one_sample(std::vector<std::int64_t>(ids.data_ptr<std::int64_t>(), ids.data_ptr<std::int64_t>() + length)));
  }
  // Padded: a row a sample, right-padded to 9.
  Batch padded{3, 9, {}, {}, {}, 0};
  for (const auto& s : samples) {
    for (std::int64_t t = 0; t < 9; ++t) {
      const bool real = t < s.cols;
      padded.input_ids.push_back(real ? s.input_ids[static_cast<std::size_t>(t)] : 0);
      padded.attention_mask.push_back(real ? 1 : 0);
      padded.labels.push_back(real ? s.labels[static_cast<std::size_t>(t)] : -100);
    }
  }
  // Packed in rows of 12: the 9 alone, then the 5 and the 4 side by side.
  const Batch packed = core::pack_samples(samples, 12, core::Packer::kFirstFitDecreasing, 0);
  ASSERT_EQ(packed.rows, 2);
  ASSERT_EQ(packed.attention_mask[12 + 5], 2);
  const auto run = [&](const Batch& b) {
    const core::MicroBatch t = core::to_micro_batch(b);
    const at::Tensor logits = runtime.forward(t.ids, t.positions, t.mask);
    const at::Tensor loss = executor->loss_sum(logits, t.labels);
    return std::make_pair(logits, loss);
  };
  const auto [padded_logits, padded_loss] = run(padded);
  const auto [packed_logits, packed_loss] = run(packed);
  // Where each sample sits: (row, first column) in the packed batch.
  const std::vector<std::pair<std::int64_t, std::int64_t>> at_packed = {{0, 0}, {1, 0}, {1, 5}};
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const auto [row, col] = at_packed[i];
    const at::Tensor alone = padded_logits[static_cast<std::int64_t>(i)].narrow(0, 0, lengths[i]);
    const at::Tensor inside = packed_logits[row].narrow(0, col, lengths[i]);
    EXPECT_TRUE(at::allclose(inside, alone, 1e-5, 1e-5)) << "sample " << i << ": max difference " << (inside - alone).abs().max().item<double>();
  }
  EXPECT_NEAR(packed_loss.item<double>(), padded_loss.item<double>(), 1e-4);
  const auto padded_grads = torch::autograd::grad({padded_loss}, params, {}, /*retain_graph=*/false, false, /*allow_unused=*/true);
  const auto packed_grads = torch::autograd::grad({packed_loss}, params, {}, false, false, true);
  int compared = 0;
  for (std::size_t p = 0; p < params.size(); ++p) {
    if (!padded_grads[p].defined()) continue;
    ASSERT_TRUE(packed_grads[p].defined());
    EXPECT_TRUE(at::allclose(packed_grads[p], padded_grads[p], 1e-4, 1e-5)) << "parameter " << p;
    ++compared;
  }
  EXPECT_GT(compared, 10);
}


// Training with a frozen head, the decoder's head block hands the loss its input: the loss makes
// the logits a slice of rows at a time (next_token_loss_sum_from_hidden). Loss and
// every trainable gradient equal the composite's (the head learning too, so its product is made in
// the forward), and logits() applies the head to such an output.
TEST(Loss, AFrozenHeadLeavesItsProductToTheLoss) {
  auto executor = tiny_llama();
  executor->model().set_training(false);
  core::RankRuntime runtime(*executor);
  std::vector<at::Tensor> trainable;
  at::Tensor head;
  for (auto& p : executor->model().parameters()) {
    if (p.name == "lm_head.weight") head = p.tensor.set_requires_grad(false);  // as an adapter freezes the base
    else trainable.push_back(p.tensor.set_requires_grad(true));
  }
  ASSERT_TRUE(head.defined());
  at::manual_seed(4);
  Batch batch{2, 7, {}, {}, {}, 0};
  for (std::int64_t i = 0; i < 14; ++i) {
    batch.input_ids.push_back(at::randint(3, 259, {1}, at::kLong).item<std::int64_t>());
    batch.attention_mask.push_back(i < 12 ? 1 : 0);  // the second row ends padded
    batch.labels.push_back(i % 7 < 2 || i >= 12 ? -100 : batch.input_ids.back());
  }
  const core::MicroBatch t = core::to_micro_batch(batch);
  const at::Tensor out = runtime.forward(t.ids, t.positions, t.mask);
  ASSERT_EQ(out.size(2), 32) << "the head's input, not its logits";
  const at::Tensor loss = executor->loss_sum(out, t.labels);
  const auto grads = torch::autograd::grad({loss}, trainable, {}, false, false, /*allow_unused=*/true);
  head.set_requires_grad(true);
  const at::Tensor logits = runtime.forward(t.ids, t.positions, t.mask);
  ASSERT_EQ(logits.size(2), 259);
  EXPECT_TRUE(at::allclose(executor->logits(out), logits, 1e-5, 1e-5));
  const at::Tensor want = executor->loss_sum(logits, t.labels);
  EXPECT_NEAR(loss.item<double>(), want.item<double>(), 1e-5 * std::abs(want.item<double>()));
  const auto want_grads = torch::autograd::grad({want}, trainable, {}, false, false, true);
  int compared = 0;
  for (std::size_t p = 0; p < trainable.size(); ++p) {
    if (!want_grads[p].defined()) continue;
    ASSERT_TRUE(grads[p].defined()) << "parameter " << p;
    EXPECT_TRUE(at::allclose(grads[p], want_grads[p], 1e-4, 1e-6)) << "parameter " << p;
    ++compared;
  }
  EXPECT_GT(compared, 10);
}

// A greedy decode step's bookkeeping in one kernel on a GPU leaves the rows as LibTorch's operations
// (generate.cpp's) leave them: argmax's first index on a tie, an ended row's draw in the spare last
// column, a row ending at its end of sequence or at max_new tokens, the cache column held at the
// last, the bad flag for a live row's infinite or NaN logit and not an ended row's. On the CPU it
// does not apply.
LOOM_GPU_TEST(Generation, GreedyStepKernelLeavesTheRowsAsLibTorchsOperationsDo) {
  // 5,000 logits a row: the kernel's threads take each several, 1,024 apart.
  const std::int64_t rows = 7, vocab = 5000, max_new = 5, capacity = 12, eos = 3;
  const auto make_rows = [&](const at::TensorOptions& on) {
    const auto longs = on.dtype(at::kLong);
    kit::GreedyStepRows s;
    s.last = at::tensor(std::vector<std::int64_t>{9, 8, 7, 6, 5, 4, 2}, longs);
    s.position = at::tensor(std::vector<std::int64_t>{11, 7, 8, 9, 10, 3, 4}, longs);
    s.column = at::tensor(std::vector<std::int64_t>{capacity - 1, 7, 8, 9, 10, 3, 4}, longs);  // row 0 at the cache's last column
    s.tokens = at::randint(0, vocab, {rows, max_new + 1}, longs);
    s.count = at::tensor(std::vector<std::int64_t>{1, 2, 3, 2, max_new - 1, 1, 1}, longs);     // row 4 reaches max_new
    s.done = at::tensor(std::vector<std::int64_t>{0, 0, 0, 1, 0, 0, 0}, longs).to(at::kBool);  // row 3 has ended
    s.bad = at::zeros({}, on.dtype(at::kBool));
    return s;
  };
  {
    kit::GreedyStepRows cpu = make_rows(at::TensorOptions());
    EXPECT_FALSE(kit::greedy_decode_step(at::randn({rows, vocab}), cpu, eos, max_new, capacity));
  }
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const auto reference = [&](const at::Tensor& logits, kit::GreedyStepRows& s) {
    const at::Tensor live = s.done.logical_not();
    s.bad.logical_or_((std::get<0>(logits.max(-1)).isfinite().logical_not() & live).any());
    const at::Tensor token = logits.to(at::kFloat).argmax(-1);
    s.tokens.scatter_(1, at::where(live, s.count, max_new).view({rows, 1}), token.view({rows, 1}));
    const at::Tensor step = live.to(at::kLong);
    s.count.add_(step);
    s.done.logical_or_(live & (token.eq(eos) | s.count.ge(max_new)));
    s.last.copy_(token);
    s.position.add_(step);
    s.column.add_(step).clamp_max_(capacity - 1);
  };
  const auto same = [](const kit::GreedyStepRows& a, const kit::GreedyStepRows& b) {
    for (const auto member : {&kit::GreedyStepRows::last, &kit::GreedyStepRows::position, &kit::GreedyStepRows::column, &kit::GreedyStepRows::tokens,
                              &kit::GreedyStepRows::count, &kit::GreedyStepRows::done, &kit::GreedyStepRows::bad})
      EXPECT_TRUE(at::equal((a.*member).cpu(), (b.*member).cpu())) << (a.*member).cpu() << " against " << (b.*member).cpu();
  };
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  for (const auto dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    SCOPED_TRACE(c10::toString(dtype));
    at::manual_seed(5);
    // Rows of a wider tensor, as the logits narrowed to the tokenizer's vocabulary are.
    const at::Tensor wide = at::randn({rows, vocab + 24}, cuda.dtype(dtype));
    const at::Tensor logits = wide.narrow(1, 0, vocab);
    // Ties, the first index taken: in one thread's turns (50, 1,074), in one warp (300, 301) and
    // across warps (700).
    logits[0][1074] = 40;
    logits[0][50] = 40;
    logits[1][700] = 40;
    logits[1][301] = 40;
    logits[1][300] = 40;
    logits[5][eos] = 40;  // row 5 draws its end of sequence
    for (const bool infinite : {false, true}) {
      SCOPED_TRACE(infinite ? "an infinite logit" : "finite logits");
      if (infinite) {
        logits[2][10] = std::numeric_limits<float>::infinity();
        logits[6].fill_(-std::numeric_limits<float>::infinity());  // a row of -inf only: token 0, and bad
      }
      kit::GreedyStepRows want = make_rows(cuda), got = make_rows(cuda);
      got.tokens.copy_(want.tokens);
      reference(logits, want);
      ASSERT_TRUE(kit::greedy_decode_step(logits, got, eos, max_new, capacity));
      same(got, want);
      EXPECT_EQ(got.bad.item<bool>(), infinite);
      EXPECT_EQ(got.last[0].item<std::int64_t>(), 50);
      EXPECT_EQ(got.last[1].item<std::int64_t>(), 300);
      EXPECT_TRUE(got.done[5].item<bool>() && got.done[4].item<bool>() && !got.done[0].item<bool>());
    }
    // A NaN marks a live row bad, not an ended one. (LibTorch's argmax would take the NaN's index: a
    // live row's run stops at its next look, and an ended row's draw is never read.)
    for (const std::int64_t row : {3, 0}) {
      const at::Tensor with_nan = wide.clone().narrow(1, 0, vocab);
      with_nan[row][20] = std::numeric_limits<float>::quiet_NaN();
      with_nan[2][10] = 0;
      with_nan[6].normal_();
      kit::GreedyStepRows got = make_rows(cuda);
      ASSERT_TRUE(kit::greedy_decode_step(with_nan, got, eos, max_new, capacity));
      EXPECT_EQ(got.bad.item<bool>(), row == 0) << "NaN in row " << row;
    }
  }
}

// Generation through the cache made once (left-padded prompts of different lengths, rows that end
// refilled with waiting prompts, the host looking every few steps, long prompts in chunks) gives the tokens of a model that
// runs every position again per token, greedy and sampled; and on a GPU, replaying the decode step
// as a CUDA graph gives the tokens of running it op by op.
TEST(Generation, CachedDecodingGivesTheTokensOfRecomputingEveryPosition) {
  auto tokenizer = make_plugin<Tokenizer>("tokenizer", "bytes");
  const std::vector<std::string> prompts = {"Q:ab A:", "hello", "x", "a longer prompt than the others", "Q:z A:", "mm"};
  std::vector<std::string> devices = {"cpu"};
  if (at::hasCUDA()) devices.push_back("cuda:0");
  // Also with a sliding layer of 3 before a global one: its cache a ring of 3 slots, which the
  // prompts (up to 31 tokens), their chunks and refilled rows wrap many times.
  for (const auto& [device, window] : std::vector<std::pair<std::string, std::int64_t>>{{"cpu", 0}, {"cpu", 3}, {"cuda:0", 0}, {"cuda:0", 3}}) {
    if (std::find(devices.begin(), devices.end(), device) == devices.end()) continue;
    std::map<std::string, OptionValue> shape = {{"init", std::string("random")},        {"hidden_size", std::int64_t{32}},
                                                {"intermediate_size", std::int64_t{64}}, {"num_hidden_layers", std::int64_t{2}},
                                                {"num_attention_heads", std::int64_t{4}}, {"num_key_value_heads", std::int64_t{2}},
                                                {"vocab_size", std::int64_t{259}}};
    if (window > 0) {
      shape["sliding_window"] = window;
      shape["layer_types"] = StringList{"sliding_attention", "full_attention"};
    }
    auto model = make_plugin<Model>("model", "llama", shape);
    Plan plan;
    std::vector<std::optional<c10::Device>> block_devices;
    for (const auto& b : model->structure().blocks) {
      plan.blocks.push_back({b.name, device});
      block_devices.emplace_back(c10::Device(device));
    }
    auto executor = core::load_executor(*model, plan, DType::kFloat32, 3, false);
    executor->model().set_training(false);
    core::Executor uncached(std::make_unique<WithoutCachedDecoding>(executor->model()), block_devices);
    ASSERT_NE(executor->cached_decoding(), nullptr);
    ASSERT_EQ(uncached.cached_decoding(), nullptr);
    core::RankRuntime cached_runtime(*executor), uncached_runtime(uncached);
    const auto answers = [&](core::RankRuntime& runtime, double temperature, std::int64_t rows, bool graph, std::int64_t chunk = 4096) {
      core::GenerationSettings g;
      g.max_new_tokens = 12;
      g.temperature = temperature;
      g.top_p = 0.95;
      g.seed = 7;
      g.max_rows = rows;
      g.check_every = 3;
      g.cuda_graph = graph;
      g.prompt_chunk = chunk;
      return core::generate([&](const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& mask,
                                CachedPass& pass) { return runtime.last_logits(ids, positions, mask, pass); },
                            *tokenizer, prompts, g);
    };
    for (const double temperature : {0.0, 1.0}) {
      SCOPED_TRACE(device + ", window " + std::to_string(window) + ", temperature " + std::to_string(temperature));
      const auto reference = answers(uncached_runtime, temperature, 64, false);
      EXPECT_EQ(answers(cached_runtime, temperature, 64, false), reference);
      EXPECT_EQ(answers(cached_runtime, temperature, 2, false), reference);
      // Prompts in passes of 4 and 7 tokens, the padding of short ones spanning whole passes.
      EXPECT_EQ(answers(cached_runtime, temperature, 64, false, 4), reference);
      EXPECT_EQ(answers(cached_runtime, temperature, 3, false, 7), reference);
      EXPECT_EQ(answers(uncached_runtime, temperature, 3, false, 7), reference);
      if (device != "cpu") {
        EXPECT_EQ(answers(cached_runtime, temperature, 64, true), reference);
        EXPECT_EQ(answers(cached_runtime, temperature, 2, true), reference);
      }
    }
  }
}

// A mixture of experts' decode step in bf16 on a GPU, where its grouped products count each
// expert's rows on the device (compute capability 8.0 and up): recorded as a CUDA graph
// (graph_capturable says so) and replayed, it gives the tokens of running it op by op, greedy and
// sampled, with LoRA on its experts too. Below 8.0 (gpu-suite's 7.x modes) the experts' products
// read their counts on the host: the step is not capturable, and `loom generate` runs it eagerly.
LOOM_GPU_TEST(Generation, MixtureOfExpertsDecodeStepsReplayAsAGraph) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  auto tokenizer = make_plugin<Tokenizer>("tokenizer", "bytes");
  const std::vector<std::string> prompts = {"Q:ab A:", "hello", "x", "a longer prompt than the others", "Q:z A:", "mm"};
  auto model = make_plugin<Model>("model", "qwen3_moe",
                                  {{"init", std::string("random")}, {"hidden_size", std::int64_t{32}}, {"intermediate_size", std::int64_t{64}},
                                   {"moe_intermediate_size", std::int64_t{16}}, {"num_experts", std::int64_t{8}},
                                   {"num_experts_per_tok", std::int64_t{2}}, {"num_hidden_layers", std::int64_t{2}},
                                   {"num_attention_heads", std::int64_t{4}}, {"num_key_value_heads", std::int64_t{2}}, {"vocab_size", std::int64_t{259}}});
  Plan plan;
  for (const auto& b : model->structure().blocks) plan.blocks.push_back({b.name, "cuda:0"});
  auto executor = core::load_executor(*model, plan, DType::kBFloat16, 3, false);
  executor->model().set_training(false);
  core::RankRuntime runtime(*executor);
  auto parallel = core::single_process();
  const auto answers = [&](double temperature, bool graph) {
    core::GenerationSettings g;
    g.max_new_tokens = 12;
    g.temperature = temperature;
    g.top_p = 0.95;
    g.seed = 7;
    g.max_rows = 4;
    g.check_every = 3;
    g.cuda_graph = graph && runtime.graph_capturable(*parallel);  // as `loom generate` asks
    return core::generate([&](const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& mask,
                              CachedPass& pass) { return runtime.last_logits(ids, positions, mask, pass); },
                          *tokenizer, prompts, g);
  };
  for (const bool adapted : {false, true}) {
    if (adapted) {
      auto lora = make_plugin<Adapter>("adapter", "lora", {{"r", std::int64_t{8}}, {"target_modules", StringList{"q_proj"}},
                                                           {"target_parameters", StringList{"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}}});
      torch::NoGradGuard no_grad;
      for (auto& p : lora->attach(executor->model(), 0)) p.tensor.normal_(0.0, 0.05);
    }
    const bool grouped = kit::compat::cuda_device_capability(0) >= 80;
    ASSERT_EQ(runtime.graph_capturable(*parallel), grouped) << (grouped ? "the grouped products would read counts on the host" : "a 7.x step captured");
    for (const double temperature : {0.0, 1.0}) {
      SCOPED_TRACE(std::string(adapted ? "LoRA, " : "") + "temperature " + std::to_string(temperature));
      EXPECT_EQ(answers(temperature, true), answers(temperature, false));
    }
  }
}

// The evaluator's loss is the mean over every label token of the samples (whatever the batching
// and however many data ranks share them), and its exact-match counts the answers greedy
// generation gives.
TEST(Evaluator, LossOverEveryLabelTokenAndExactMatchOverRanks) {
  auto tokenizer = make_plugin<Tokenizer>("tokenizer", "bytes");
  auto collator = make_plugin<Collator>("collator", "completion-only", {{"response_template", std::string("A:")}});
  const std::vector<std::string> prompts = {"Q:abc A:", "Q:hello there A:"};
  const std::vector<std::string> texts = {"Q:ab A:ab", "Q:xyz A:x", "Q:hello A:hello hello", "Q:q A:qq", "Q:longer prompt here A:yes"};
  core::EvalSettings settings;
  settings.batch_size = 2;
  settings.max_new_tokens = 6;
  settings.collate.max_length = 64;
  std::mutex init;  // random init seeds the process's generator: rank threads take turns
  const auto load = [&] {
    std::lock_guard<std::mutex> lock(init);
    return tiny_llama();
  };

  auto executor = load();
  core::RankRuntime runtime(*executor);
  // The expected loss, one sample at a time.
  double loss_sum = 0;
  std::int64_t labels = 0;
  {
    torch::NoGradGuard no_grad;
    executor->model().set_training(false);
    for (const auto& text : texts) {
      const core::MicroBatch t = core::to_micro_batch(collator->collate({text}, *tokenizer, settings.collate));
      loss_sum += executor->loss_sum(executor->head_output(t.ids, t.positions, t.mask), t.labels).item<double>();
      labels += core::label_count(t);
    }
  }
  // Samples whose reference is the model's own greedy answer, and one whose reference is not.
  core::GenerationSettings g;
  g.max_new_tokens = settings.max_new_tokens;
  const auto answers = core::generate([&](const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& mask,
                                          CachedPass& pass) { return runtime.last_logits(ids, positions, mask, pass); },
                                      *tokenizer, prompts, g);
  const std::vector<std::string> answered = {prompts[0] + answers[0], prompts[1] + "not" + answers[1]};

  auto parallel = core::single_process();
  core::Evaluator one(runtime, *collator, *tokenizer, *parallel, c10::Device(c10::kCPU), settings);
  const core::EvalResult whole = one.evaluate(texts);
  EXPECT_NEAR(whole.loss, loss_sum / static_cast<double>(labels), 1e-5);
  EXPECT_EQ(whole.samples, 5);
  EXPECT_EQ(whole.prompts, 5);
  const core::EvalResult exact = one.evaluate(answered);
  EXPECT_EQ(exact.exact, 1);
  EXPECT_EQ(exact.prompts, 2);
  settings.max_samples = 3;
  EXPECT_EQ(core::Evaluator(runtime, *collator, *tokenizer, *parallel, c10::Device(c10::kCPU), settings).evaluate(texts).samples, 3);
  settings.max_samples = 0;

  // Three data ranks share the five samples unevenly and agree with one process.
  on_ranks(Mesh{3, 1, 1}, [&](Parallel& rank_parallel) {
    auto mine = load();
    core::RankRuntime rank_runtime(*mine);
    core::Evaluator shared(rank_runtime, *collator, *tokenizer, rank_parallel, c10::Device(c10::kCPU), settings);
    const core::EvalResult r = shared.evaluate(texts);
    EXPECT_NEAR(r.loss, whole.loss, 1e-5);
    EXPECT_EQ(r.samples, 5);
    EXPECT_EQ(r.prompts, 5);
    const core::EvalResult e = shared.evaluate(answered);
    EXPECT_EQ(e.exact, 1);
    EXPECT_EQ(e.prompts, 2);
  });
}

}  // namespace
}  // namespace loom::test
