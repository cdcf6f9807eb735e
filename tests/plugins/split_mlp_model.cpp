// A model plugin of the SDK alone (no kit) that tensor parallelism splits from outside: it declares
// how each linear splits (up by column, down by row, in its structure's LinearInfo) and offers no
// TensorParallelModel, so the host loads it whole on every tensor rank and cuts its linears
// (runtime/host_split.hpp). It holds no sharding code and calls no collective.
//
// The model: each token's embedding, then `layers` residual MLPs x + down(gelu(up(x))) with biases,
// then a head. Every position depends on its own token only, so generation needs no cache.
#include <fstream>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include "loom/error.hpp"
#include "loom/layers.hpp"
#include "loom/model.hpp"
#include "loom/plugin.hpp"
#include "next_token_loss.hpp"

namespace {

std::vector<loom::OptionSpec> options() {
  return {loom::OptionSpec::integer("vocab_size", 259, "tokens").at_least(2).at_most(1 << 20),
          loom::OptionSpec::integer("hidden_size", 32, "width").at_least(1).at_most(1 << 14),
          loom::OptionSpec::integer("intermediate_size", 64, "the MLP's units").at_least(1).at_most(1 << 16),
          loom::OptionSpec::integer("num_hidden_layers", 2, "layers").at_least(1).at_most(64)};
}

struct Shape {
  std::int64_t vocab, hidden, units, layers;
  std::string up(std::int64_t i) const { return "model.layers." + std::to_string(i) + ".mlp.up_proj"; }
  std::string down(std::int64_t i) const { return "model.layers." + std::to_string(i) + ".mlp.down_proj"; }
  std::size_t head() const { return static_cast<std::size_t>(layers) + 1; }
};

class Loaded final : public loom::LoadedModel {
 public:
  Loaded(const loom::LoadRequest& request, Shape shape) : shape_(shape), devices_(request.block_devices) {
    const auto gen = at::detail::createCPUGenerator(request.seed);
    const auto on = [&](std::size_t block) { return at::TensorOptions().dtype(loom::scalar_type(request.dtype)).device(*devices_[block]); };
    // Drawn whole in a fixed order, so a block's values do not depend on which blocks a rank holds.
    const auto draw = [&](std::int64_t rows, std::int64_t cols) { return at::randn({rows, cols}, gen, at::kFloat) * 0.1; };
    const at::Tensor embed = draw(shape.vocab, shape.hidden);
    if (devices_[0]) embed_ = embed.to(on(0)).set_requires_grad(true);
    at::NoGradGuard no_grad;
    for (std::int64_t i = 0; i < shape.layers; ++i) {
      const std::size_t block = static_cast<std::size_t>(i) + 1;
      const at::Tensor up = draw(shape.units, shape.hidden), down = draw(shape.hidden, shape.units), up_bias = draw(1, shape.units),
                       down_bias = draw(1, shape.hidden);
      if (!devices_[block]) {
        ups_.push_back(nullptr);
        downs_.push_back(nullptr);
        continue;
      }
      ups_.push_back(linear(request, shape.up(i), up, up_bias.view({-1}), loom::ParallelStyle::kColumn, on(block)));
      downs_.push_back(linear(request, shape.down(i), down, down_bias.view({-1}), loom::ParallelStyle::kRow, on(block)));
    }
    if (devices_[shape.head()]) head_ = draw(shape.vocab, shape.hidden).to(on(shape.head())).set_requires_grad(true);
  }

  // A linear holding `weight` and `bias`: over the adapter's storage of its base where it gives one
  // (a 4-bit base), else dense.
  static std::shared_ptr<loom::AdaptableLinear> linear(const loom::LoadRequest& request, const std::string& name, const at::Tensor& weight,
                                                       const at::Tensor& bias, loom::ParallelStyle style, const at::TensorOptions& options) {
    const std::int64_t out = weight.size(0), in = weight.size(1);
    std::shared_ptr<loom::AdaptableLinear> made;
    if (request.base_weight)
      if (auto stored = request.base_weight(loom::LinearInfo{name, in, out, style}, options)) {
        stored->assign("weight", weight);
        stored->finish_load(name);
        made = std::make_shared<loom::AdaptableLinear>(std::move(stored), in, out, bias.to(options));
      }
    if (!made) {
      made = std::make_shared<loom::AdaptableLinear>(in, out, true, options);
      made->base().assign("weight", weight);
      made->bias.copy_(bias);
    }
    return made;
  }

  std::size_t block_count() const override { return shape_.head() + 1; }
  void forward(std::size_t index, loom::ForwardState& state) override {
    if (index == 0) state.hidden = at::embedding(embed_, state.hidden);
    else if (index == shape_.head()) state.hidden = at::linear(state.hidden, head_);
    else state.hidden = state.hidden + downs_[index - 1]->forward(at::gelu(ups_[index - 1]->forward(state.hidden)));
  }
  at::Tensor loss_sum(const at::Tensor& logits, const at::Tensor& labels) override { return loom_test_plugins::next_token_loss_sum(logits, labels); }
  at::Tensor logits(const at::Tensor& head_output) override { return head_output; }
  std::vector<loom::NamedParameter> parameters() override {
    std::vector<loom::NamedParameter> out;
    if (embed_.defined()) out.push_back({"model.embed_tokens.weight", 0, embed_});
    for (std::int64_t i = 0; i < shape_.layers; ++i) {
      const auto block = static_cast<std::size_t>(i) + 1;
      if (!ups_[static_cast<std::size_t>(i)]) continue;
      for (const auto& [suffix, t] : ups_[static_cast<std::size_t>(i)]->stored()) out.push_back({shape_.up(i) + "." + suffix, block, t});
      for (const auto& [suffix, t] : downs_[static_cast<std::size_t>(i)]->stored()) out.push_back({shape_.down(i) + "." + suffix, block, t});
    }
    if (head_.defined()) out.push_back({"lm_head.weight", shape_.head(), head_});
    return out;
  }
  std::vector<loom::NamedLinear> linears() override {
    std::vector<loom::NamedLinear> out;
    for (std::int64_t i = 0; i < shape_.layers; ++i) {
      const auto at = static_cast<std::size_t>(i);
      out.push_back({shape_.up(i), at + 1, ups_[at].get()});
      out.push_back({shape_.down(i), at + 1, downs_[at].get()});
    }
    return out;
  }
  void set_training(bool training) override {
    for (auto* list : {&ups_, &downs_})
      for (auto& l : *list)
        if (l) l->train(training);
  }
  // Every weight's values in one JSON file (this test model's own format), written whole then renamed.
  void save_pretrained(const std::filesystem::path& dir) override {
    nlohmann::json out = nlohmann::json::object();
    for (const auto& p : parameters()) {
      const at::Tensor flat = p.tensor.detach().to(at::kCPU, at::kDouble).contiguous().view({-1});
      out[p.name] = {{"shape", p.tensor.sizes().vec()}, {"values", std::vector<double>(flat.data_ptr<double>(), flat.data_ptr<double>() + flat.numel())}};
    }
    std::filesystem::create_directories(dir);
    {
      std::ofstream file(dir / "weights.json.partial");
      file << out.dump();
      if (!file) throw loom::UserError((dir / "weights.json").string() + ": cannot write");
    }
    std::filesystem::rename(dir / "weights.json.partial", dir / "weights.json");
  }

 private:
  Shape shape_;
  std::vector<std::optional<c10::Device>> devices_;
  at::Tensor embed_, head_;
  std::vector<std::shared_ptr<loom::AdaptableLinear>> ups_, downs_;
};

class SplitMlpModel final : public loom::Model {
 public:
  explicit SplitMlpModel(Shape shape) : shape_(shape) {}
  loom::ModelStructure structure() const override {
    loom::ModelStructure s;
    s.architecture = "split-mlp";
    s.vocab_size = shape_.vocab;
    s.hidden_size = shape_.hidden;
    s.max_positions = 4096;
    const auto h = static_cast<std::uint64_t>(shape_.hidden), v = static_cast<std::uint64_t>(shape_.vocab), u = static_cast<std::uint64_t>(shape_.units);
    s.blocks.push_back({"embed", loom::BlockKind::kEmbedding, v * h, h, h, 0, "", {}, 0});
    for (std::int64_t i = 0; i < shape_.layers; ++i)
      s.blocks.push_back({"layers." + std::to_string(i), loom::BlockKind::kDecoderLayer, 2 * h * u + u + h, 2 * h + 2 * u, 2 * u + h, 4 * h * u, "",
                          {{shape_.up(i), shape_.hidden, shape_.units, loom::ParallelStyle::kColumn},
                           {shape_.down(i), shape_.units, shape_.hidden, loom::ParallelStyle::kRow}},
                          0});
    s.blocks.push_back({"head", loom::BlockKind::kHead, v * h, v, 2 * v, 2 * v * h, "", {}, 0});
    return s;
  }
  std::unique_ptr<loom::LoadedModel> load(const loom::LoadRequest& request) const override {
    if (request.block_devices.size() != shape_.head() + 1) throw loom::UserError("the split-mlp model has " + std::to_string(shape_.head() + 1) + " blocks");
    return std::make_unique<Loaded>(request, shape_);
  }

 private:
  Shape shape_;
};

std::unique_ptr<loom::Plugin> create(const loom::Options& o) {
  return std::make_unique<SplitMlpModel>(Shape{o.get_int("vocab_size"), o.get_int("hidden_size"), o.get_int("intermediate_size"), o.get_int("num_hidden_layers")});
}

}  // namespace

LOOM_PLUGIN(loom::kKindModel, "split-mlp", "0.1.0", "a model of the SDK alone whose linears the host splits (test plugin)", options, create)
