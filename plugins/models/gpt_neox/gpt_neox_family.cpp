// Model plugin `gpt_neox` (Pythia, GPT-NeoX-20B): LayerNorms with biases, one fused qkv whose rows
// are each head's q, k and v together, rotary over the first quarter of a head, a plain GELU MLP
// with biases, and attention and the MLP both reading the layer's input (parallel residual) unless
// use_parallel_residual is false. Reads transformers 4's keys (rotary_pct, rotary_emb_base) and 5's.
#include "loom/kit/decoder_block.hpp"
#include "loom/layers.hpp"

namespace gpt_neox {

using namespace loom::kit;
using loom::ParallelStyle;

class Block final : public DecoderBlock {
 public:
  explicit Block(BlockBuilder& b) : head_dim_(b.config().head_dim), activation_(b.config().activation) {
    const DecoderConfig& c = b.config();
    const std::int64_t h = c.hidden_size, width = c.num_attention_heads * c.head_dim;
    input_norm_ = b.norm("input_layernorm", NormForm::kLayer);
    mlp_norm_ = b.norm("post_attention_layernorm", NormForm::kLayer);
    // Cut by whole heads under tensor parallelism: each head's q, k and v rows are adjacent.
    qkv_ = b.linear("attention.query_key_value", h, 3 * width, c.attention_bias, ParallelStyle::kColumn);
    dense_ = b.linear("attention.dense", width, h, c.attention_bias, ParallelStyle::kRow);
    up_ = b.linear("mlp.dense_h_to_4h", h, c.intermediate_size, true, ParallelStyle::kColumn);
    down_ = b.linear("mlp.dense_4h_to_h", c.intermediate_size, h, true, ParallelStyle::kRow);
    parallel_ = c.family.value("use_parallel_residual", true);
  }
  at::Tensor forward(const at::Tensor& x, LayerPass& pass) override {
    const auto qkv = qkv_->forward(input_norm_(x)).view({x.size(0), x.size(1), -1, 3 * head_dim_}).split(head_dim_, -1);
    const at::Tensor attention = dense_->forward(attend(pass, qkv[0], qkv[1], qkv[2]));
    const auto rows = [this](const at::Tensor& in) { return down_->forward(activate(activation_, up_->forward(mlp_norm_(in)))); };
    const auto mlp = [&](const at::Tensor& in) { return mlp_over_row_chunks(in, up_->out_features, {up_.get(), down_.get()}, rows); };
    if (parallel_) return mlp(x) + attention + x;
    const at::Tensor mid = attention + x;
    return mlp(mid) + mid;
  }

 private:
  std::int64_t head_dim_;
  Activation activation_;
  Norm input_norm_, mlp_norm_;
  std::shared_ptr<loom::AdaptableLinear> qkv_, dense_, up_, down_;
  bool parallel_ = true;
};

const DecoderFamily& family() {
  static const DecoderFamily f = [] {
    DecoderFamily f = decoder_family("gpt_neox", {"gpt_neox"}, "GPTNeoXForCausalLM");
    f.norm_form = NormForm::kLayer;
    f.names.embed = "gpt_neox.embed_in.weight";
    f.names.layers = "gpt_neox.layers.";
    f.names.final_norm = "gpt_neox.final_layer_norm.weight";
    f.names.head = "embed_out.weight";
    f.ignored = {"attention.bias", "attention.masked_bias"};  // older folders' causal-mask buffers
    f.configure = [](DecoderConfig& c, const loom::kit::json::Value* file) {
      c.attention_bias = file == nullptr || (*file)["attention_bias"].opt_boolean().value_or(true);
      c.family["use_parallel_residual"] = file == nullptr || (*file)["use_parallel_residual"].opt_boolean().value_or(true);
      if (file == nullptr) return;
      c.rms_norm_eps = (*file)["layer_norm_eps"].opt_number().value_or(1e-5);
      if (const auto pct = (*file)["rotary_pct"].opt_number()) c.partial_rotary_factor = *pct;
      if (const auto base = (*file)["rotary_emb_base"].opt_number()) c.rope.theta = *base;
    };
    f.write_config = [](const DecoderConfig& c, nlohmann::json& out) {
      out["layer_norm_eps"] = c.rms_norm_eps;
      out["use_parallel_residual"] = c.family.value("use_parallel_residual", true);
      out["rotary_pct"] = c.partial_rotary_factor;  // transformers 4's spellings beside 5's
      out["rotary_emb_base"] = c.rope.theta;
    };
    f.block = [](BlockBuilder& b) { return std::make_shared<Block>(b); };
    return f;
  }();
  return f;
}

}  // namespace gpt_neox

LOOM_DECODER_FAMILY_PLUGIN("gpt_neox", "0.1.0", "GPT-NeoX (Pythia) decoder family from an HF folder or a random init", gpt_neox::family)
