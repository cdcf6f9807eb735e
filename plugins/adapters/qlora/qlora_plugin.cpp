// Adapter plugin `qlora`: LoRA (the kit's, loom/kit/lora.hpp: the same options, training and PEFT
// output as `lora`) on a frozen base whose linears are stored 4-bit (loom/kit/quantize.hpp: NF4 or FP4
// in blocks, optionally double-quantized, in bitsandbytes' layout). The base is quantized while it
// loads, one matrix at a time, so a model needs its 4-bit size plus one matrix in full precision. A
// mixture of experts' stacked experts are stored 4-bit too, each as the matrix of its experts' rows.
#include "loom/error.hpp"
#include "loom/kit/kernels.hpp"
#include "loom/kit/lora.hpp"
#include "loom/kit/quantize.hpp"
#include "loom/kit/torch_compat.hpp"
#include "loom/kit/tensor_parallel.hpp"
#include "loom/layers.hpp"
#include "loom/plugin.hpp"

namespace loom::qlora {
namespace {

std::vector<OptionSpec> options() {
  auto o = kit::lora_options();
  o.push_back(OptionSpec::string("quant_type", "nf4", "4-bit data type of the base: \"nf4\" (QLoRA's NormalFloat) or \"fp4\"").one_of({"nf4", "fp4"}));
  o.push_back(OptionSpec::boolean("double_quant", true, "quantize the block scales too (8-bit blocks of 256): about 0.37 bits less per parameter"));
  o.push_back(OptionSpec::integer("blocksize", 64, "weights per scale (QLoRA and bitsandbytes use 64)").at_least(16).at_most(4096));
  o.push_back(OptionSpec::string("compute_dtype", "", "dtype the 4-bit weights are dequantized to for each product; empty: the run's [run] dtype")
                  .one_of({"", "bf16", "fp16", "fp32"}));
  // QLoRA as the paper and bitsandbytes do it: every linear but the head 4-bit, whatever LoRA adapts
  // (a q,k,v,o adapter over a 70B would otherwise keep 114.7 GiB of MLP weights in bf16).
  o.push_back(OptionSpec::string("quantize", "all-linear",
                                 "which linears are stored 4-bit: \"all-linear\" (every linear but the head) or \"targets\" (only those target_modules adapts)")
                  .one_of({"all-linear", "targets"}));
  return o;
}

class QLora final : public kit::LoraAdapter, public BaseStoringAdapter {
 public:
  explicit QLora(const Options& o)
      : kit::LoraAdapter(o),
        type_(kit::parse_quant_type(o.get_string("quant_type"))),
        double_quant_(o.get_bool("double_quant")),
        blocksize_(o.get_int("blocksize")),
        compute_(o.get_string("compute_dtype")),
        all_linear_(o.get_string("quantize") == "all-linear") {}

  bool quantized(const std::string& linear) const { return all_linear_ || adapts(linear); }

  std::shared_ptr<LinearWeight> base_weight(const LinearInfo& linear, const at::TensorOptions& options) const override {
    if (!quantized(linear.name)) return nullptr;
    const auto compute = compute_.empty() ? options.dtype().toScalarType() : scalar_type(parse_dtype(compute_));
    if (compute == at::kHalf && !options.device().is_cuda())
      throw UserError("[adapter] compute_dtype = \"fp16\": " + linear.name + " is on " + options.device().str() +
                      ", where fp16 products are not supported; use \"bf16\" or \"fp32\" there (or leave compute_dtype empty for the run's dtype)");
    // The run's own bf16 is refused on such a device before the adapter is asked ([run] dtype).
    if (compute == at::kBFloat16 && !compute_.empty() && options.device().is_cuda()) {
      const int index = options.device().has_index() ? options.device().index() : 0;
      if (index < kit::compat::cuda_device_count() && kit::compat::cuda_device_capability(index) < 80)
        throw UserError("[adapter] compute_dtype = \"bf16\": cuda:" + std::to_string(index) + " has compute capability " +
                        kit::capability_name(kit::compat::cuda_device_capability(index)) +
                        ", which computes no bfloat16; use \"fp16\" (or leave compute_dtype empty for the run's dtype)");
    }
    return std::make_shared<kit::QuantizedWeight>(linear.in_features, linear.out_features, type_, blocksize_, double_quant_, options, compute);
  }

  BaseStorage base_storage(const ModelStructure& model, DType dtype) const override {
    BaseStorage s;
    const auto bytes = dtype_bytes(compute_.empty() ? dtype : parse_dtype(compute_));
    for (const auto& block : model.blocks) {
      std::uint64_t whole = block.weight_bytes > 0 ? block.weight_bytes : block.parameters * dtype_bytes(dtype);
      for (const auto& l : block.linears) {
        if (!quantized(l.name)) continue;
        const auto n = static_cast<std::uint64_t>(l.in_features) * static_cast<std::uint64_t>(l.out_features);
        whole = whole - n * dtype_bytes(dtype) + kit::quantized_bytes(l.in_features, l.out_features, blocksize_, double_quant_);
        // A product dequantizes one matrix at a time; backward recomputes it.
        s.transient_bytes = std::max(s.transient_bytes, n * bytes);
      }
      s.weight_bytes.push_back(whole);
    }
    return s;
  }

  // The merged model is written in the compute dtype: each 4-bit base becomes a dense copy first.
  // Stacked experts stored 4-bit have no such copy (the model keeps no dense tensor for them).
  void merge(LoadedModel& model) override {
    if (auto* experts = dynamic_cast<ExpertWeights*>(&model))
      for (const auto& e : experts->expert_weights())
        if (e.weight.defined() && quantized(e.name))
          throw UserError("merging into experts stored 4-bit (" + e.name + ") is not supported; set [adapter] merge = false and merge the "
                          "saved adapter into the full-precision model with `loom export` (an [adapter] plugin = \"lora\" pipeline)");
    for (const auto& l : model.linears()) {
      if (!l.layer || !dynamic_cast<kit::QuantizedWeight*>(&kit::held_weight(l.layer->base()))) continue;
      // A tensor rank's part is replaced by a dense copy of that part.
      const at::Tensor values = l.layer->base().dense();
      auto dense = std::make_shared<DenseWeight>(values.size(1), values.size(0), l.layer->options());
      dense->weight.detach().copy_(values);
      if (auto* split = dynamic_cast<kit::SplitWeight*>(&l.layer->base())) split->replace_part(dense);
      else l.layer->replace_base(dense);
    }
    kit::LoraAdapter::merge(model);
  }

 private:
  kit::QuantType type_;
  bool double_quant_;
  std::int64_t blocksize_;
  std::string compute_;
  bool all_linear_;
};

std::unique_ptr<Plugin> create(const Options& o) { return std::make_unique<QLora>(o); }

}  // namespace
}  // namespace loom::qlora

LOOM_PLUGIN(loom::kKindAdapter, "qlora", "0.1.0", "LoRA on a 4-bit base (NF4/FP4, double quantization), quantized while loading; PEFT output",
            loom::qlora::options, loom::qlora::create)
