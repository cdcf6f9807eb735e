// A model plugin written against the SDK's contract alone, as a third party might: no kit and no
// capability. tests/CMakeLists.txt pins its descriptor to minor 0 of the SDK's major, so whatever
// minor the host has reached, this is a plugin of the oldest minor it must still load and run
// (Registry.APluginOfTheMajorsFirstMinorTrainsWithoutCapabilities): it plans, trains with LoRA on
// its one linear and generates, and a tensor mesh is refused, as it offers no TensorParallelModel.
//
// The model: each token's embedding, plus a tanh of one linear of it, then a head. Every position
// depends on its own token only, so generation needs no cache.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "loom/error.hpp"
#include "loom/layers.hpp"
#include "loom/model.hpp"
#include "loom/plugin.hpp"
#include "next_token_loss.hpp"

namespace {

constexpr std::size_t kEmbed = 0, kLayer = 1, kHead = 2;
const char* const kLinear = "model.layers.0.mlp.up_proj";

std::vector<loom::OptionSpec> options() {
  return {loom::OptionSpec::integer("vocab_size", 259, "tokens").at_least(2).at_most(1 << 20),
          loom::OptionSpec::integer("hidden_size", 32, "width").at_least(1).at_most(1 << 14)};
}

class Loaded final : public loom::LoadedModel {
 public:
  Loaded(const loom::LoadRequest& request, std::int64_t vocab, std::int64_t hidden) : devices_(request.block_devices) {
    const auto gen = at::detail::createCPUGenerator(request.seed);
    const auto on = [&](std::size_t block) { return at::TensorOptions().dtype(loom::scalar_type(request.dtype)).device(*devices_[block]); };
    const auto draw = [&](std::int64_t rows, std::int64_t cols, std::size_t block) {
      return (at::randn({rows, cols}, gen, at::kFloat) * 0.02).to(on(block)).set_requires_grad(true);
    };
    // Drawn whole in a fixed order, so a block's values do not depend on which blocks a rank holds.
    const at::Tensor embed = draw(vocab, hidden, kEmbed), up = draw(hidden, hidden, kLayer), head = draw(vocab, hidden, kHead);
    if (devices_[kEmbed]) embed_ = embed;
    if (devices_[kLayer]) {
      up_ = std::make_shared<loom::AdaptableLinear>(hidden, hidden, false, on(kLayer));
      at::NoGradGuard no_grad;
      up_->base().stored().front().second.copy_(up);
    }
    if (devices_[kHead]) head_ = head;
#ifdef TEST_FORGETS_SUM
    if (devices_[kLayer]) scale_ = at::ones({hidden}, on(kLayer)).set_requires_grad(true);
    if (request.parallel != nullptr) {
      tensor_rank_ = request.parallel->tensor().rank();
      tensor_ranks_ = request.parallel->tensor().size();
    }
#endif
  }

  std::size_t block_count() const override { return 3; }
  void forward(std::size_t index, loom::ForwardState& state) override {
    if (index == kEmbed) state.hidden = at::embedding(embed_, state.hidden);
#ifdef TEST_FORGETS_SUM
    // The bug this variant is: each tensor rank takes its channels' share of the whole `scale`
    // (the rest detached), and nothing sums the parts of its gradient over the group.
    if (index == kLayer) {
      const std::int64_t share = scale_.size(0) / tensor_ranks_;
      at::Tensor own = at::zeros_like(scale_);
      own.narrow(0, tensor_rank_ * share, share).fill_(1);
      const at::Tensor used = scale_ * own + scale_.detach() * (1 - own);
      state.hidden = state.hidden + at::tanh(up_->forward(state.hidden) * used);
    }
#else
    if (index == kLayer) state.hidden = state.hidden + at::tanh(up_->forward(state.hidden));
#endif
    if (index == kHead) state.hidden = at::linear(state.hidden, head_);
  }
  at::Tensor loss_sum(const at::Tensor& logits, const at::Tensor& labels) override { return loom_test_plugins::next_token_loss_sum(logits, labels); }
  at::Tensor logits(const at::Tensor& head_output) override { return head_output; }
  std::vector<loom::NamedParameter> parameters() override {
    std::vector<loom::NamedParameter> out;
    if (embed_.defined()) out.push_back({"model.embed_tokens.weight", kEmbed, embed_});
    if (up_) out.push_back({std::string(kLinear) + ".weight", kLayer, up_->stored().front().second});
    if (head_.defined()) out.push_back({"lm_head.weight", kHead, head_});
#ifdef TEST_FORGETS_SUM
    if (scale_.defined()) out.push_back({"model.layers.0.mlp.scale", kLayer, scale_});
#endif
    return out;
  }
  std::vector<loom::NamedLinear> linears() override { return {{kLinear, kLayer, up_.get()}}; }
  void set_training(bool training) override {
    if (up_) up_->train(training);
  }
  void save_pretrained(const std::filesystem::path&) override {
    throw loom::UserError("the contract-model test plugin keeps no checkpoint format; train it with an adapter");
  }

 private:
  std::vector<std::optional<c10::Device>> devices_;
  at::Tensor embed_, head_;
  std::shared_ptr<loom::AdaptableLinear> up_;
#ifdef TEST_FORGETS_SUM
  at::Tensor scale_;
  std::int64_t tensor_rank_ = 0, tensor_ranks_ = 1;
#endif
};

class ContractModel final : public loom::Model
#ifdef TEST_FORGETS_SUM
    ,
                            public loom::TensorParallelModel
#endif
{
 public:
#ifdef TEST_FORGETS_SUM
  loom::TensorParallelSupport tensor_parallel(int) const override { return {}; }  // "splits" by sharing the use of `scale`
#endif
  ContractModel(std::int64_t vocab, std::int64_t hidden) : vocab_(vocab), hidden_(hidden) {}
  loom::ModelStructure structure() const override {
    loom::ModelStructure s;
    s.architecture = "contract-model";
    s.vocab_size = vocab_;
    s.hidden_size = hidden_;
    s.max_positions = 4096;
    const auto h = static_cast<std::uint64_t>(hidden_), v = static_cast<std::uint64_t>(vocab_);
    s.blocks.push_back({"embed", loom::BlockKind::kEmbedding, v * h, h, h, 0, "", {}, 0});
    s.blocks.push_back({"layers.0", loom::BlockKind::kDecoderLayer, h * h, 3 * h, 2 * h, 2 * h * h, "", {{kLinear, hidden_, hidden_}}, 0});
    s.blocks.push_back({"head", loom::BlockKind::kHead, v * h, v, 2 * v, 2 * v * h, "", {}, 0});
    return s;
  }
  std::unique_ptr<loom::LoadedModel> load(const loom::LoadRequest& request) const override {
    if (request.block_devices.size() != 3) throw loom::UserError("the contract model has 3 blocks");
    return std::make_unique<Loaded>(request, vocab_, hidden_);
  }

 private:
  std::int64_t vocab_, hidden_;
};

std::unique_ptr<loom::Plugin> create(const loom::Options& o) { return std::make_unique<ContractModel>(o.get_int("vocab_size"), o.get_int("hidden_size")); }

}  // namespace

#if defined(TEST_FORGETS_SUM)
LOOM_PLUGIN(loom::kKindModel, "forgets-sum", "0.1.0", "a model whose tensor ranks each use part of a whole weight and never sum its gradient (test plugin)",
            options, create)
#elif defined(TEST_CLAIMS_LLAMA)
// A second plugin that says it reads Llama folders: a [model] section naming none is ambiguous.
std::vector<std::string> model_types() { return {"llama", "contract"}; }
LOOM_MODEL_PLUGIN("llama-claimant", "0.1.0", "a model of the contract that claims Llama's model_type (test plugin)", options, create, model_types)
#else
#ifdef TEST_SDK_MINOR
#undef LOOM_SDK_VERSION_MINOR
#define LOOM_SDK_VERSION_MINOR TEST_SDK_MINOR
#endif
LOOM_PLUGIN(loom::kKindModel, "contract-model", "0.1.0", "a model of the SDK's contract alone (test plugin)", options, create)
#endif
