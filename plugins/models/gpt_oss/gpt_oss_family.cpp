// Model plugin `gpt_oss` (gpt-oss-20b, gpt-oss-120b): a pre-norm layer of RMSNorms (the weight
// applied in fp32), grouped-query attention with biases and a learned sink logit a head that takes
// its share of the softmax, sliding layers between global ones, and a mixture of experts in every
// layer: the router's top-k logits (with its bias) softmaxed, each expert's gate and up rows
// interleaved, both products biased, and a clamped SwiGLU between them (gate at most swiglu_limit,
// up within it, gate * sigmoid(1.702 gate) * (up + 1)). The experts are saved stacked as [E, in, out];
// the released checkpoints' MXFP4 experts are dequantized as they load.
#include "loom/kit/decoder_block.hpp"
#include "loom/layers.hpp"

namespace gpt_oss {

using namespace loom::kit;
using loom::ParallelStyle;

constexpr double kSwigluLimit = 7.0, kSwigluAlpha = 1.702;  // GptOssExperts' constants

class Block final : public DecoderBlock {
 public:
  explicit Block(BlockBuilder& b) : c_(b.config()), attention_(grouped_query_attention(b, "self_attn.", c_.attention_bias, c_.attention_bias)) {
    input_norm_ = b.norm("input_layernorm", NormForm::kScaleInFloat);
    mlp_norm_ = b.norm("post_attention_layernorm", NormForm::kScaleInFloat);
    scores_.extras.sinks = b.weight("self_attn.sinks", {c_.num_attention_heads}, 0.0f, ParallelStyle::kColumn);
    experts_ = b.experts(ExpertActivation{true, c_.family.value("swiglu_limit", kSwigluLimit), kSwigluAlpha}, /*biases=*/true);
    const at::Tensor bias = b.weight("mlp.router.bias", {c_.moe.num_experts}, 0.0f);
    const std::int64_t top_k = c_.moe.top_k;
    experts_->route_with = [bias, top_k](const at::Tensor& x, const at::Tensor& router) { return route_top_k_softmax(x, router, bias, top_k); };
  }

  at::Tensor forward(const at::Tensor& x, LayerPass& pass) override {
    const at::Tensor mid = x + attention_(input_norm_(x), pass, scores_);
    return mid + experts_->forward(mlp_norm_(mid), pass);
  }

 private:
  const DecoderConfig& c_;
  GroupedQueryAttention attention_;
  Norm input_norm_, mlp_norm_;
  AttendOptions scores_;
  std::shared_ptr<Experts> experts_;
};

const DecoderFamily& family() {
  static const DecoderFamily f = [] {
    DecoderFamily f = decoder_family("gpt_oss", {"gpt_oss"}, "GptOssForCausalLM");
    f.norm_form = NormForm::kScaleInFloat;
    f.names.router = "mlp.router";
    f.moe.enabled = true;
    f.moe.disk_router = "mlp.router";
    f.moe.expert_size_key = "intermediate_size";
    f.moe.default_top_k = 4;
    f.moe.stacked_transposed = true;
    f.configure = [](DecoderConfig& c, const json::Value* file) {
      if (file == nullptr) {  // GptOssConfig's defaults
        c.attention_bias = true;
        return;
      }
      if (!(*file)["attention_bias"].present()) c.attention_bias = true;
      if (const auto limit = (*file)["swiglu_limit"].opt_number()) {
        if (!(*limit > 0)) (*file)["swiglu_limit"].fail("is not above 0: the experts clamp gate and up to it");
        c.family["swiglu_limit"] = *limit;
      }
      alternate_sliding_layers(c);  // where layer_types is absent
    };
    f.write_config = [](const DecoderConfig& c, nlohmann::json& out) {
      if (c.family.contains("swiglu_limit")) out["swiglu_limit"] = c.family["swiglu_limit"];
    };
    f.block = [](BlockBuilder& b) { return std::make_shared<Block>(b); };
    return f;
  }();
  return f;
}

}  // namespace gpt_oss

LOOM_DECODER_FAMILY_PLUGIN("gpt_oss", "0.1.0", "gpt-oss (attention sinks, biased experts with a clamped SwiGLU, MXFP4 checkpoints) from an HF folder or a random init",
                           gpt_oss::family)
