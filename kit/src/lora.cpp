// LoRA with PEFT's semantics and file format, so an adapter trained here loads with
// PeftModel.from_pretrained and a PEFT adapter loads here: the code of the `lora` and `qlora`
// plugins.
#include "loom/kit/lora.hpp"

#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <typeinfo>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/error.hpp"
#include "loom/kit/atomic_file.hpp"
#include "loom/kit/json.hpp"
#include "loom/kit/moe.hpp"
#include "loom/kit/quantize.hpp"
#include "loom/kit/regex.hpp"
#include "loom/kit/safetensors.hpp"
#include "loom/kit/tensor_parallel.hpp"
#include "loom/layers.hpp"
#include "loom/plugin.hpp"

namespace loom::kit {
namespace fs = std::filesystem;
// Not in an anonymous namespace: LoraAdapter::Impl holds these (hidden outside the SDK anyway).
namespace lora_detail {

constexpr const char* kPrefix = "base_model.model.";  // PEFT's key prefix for a causal LM

std::vector<OptionSpec> options_of_lora() {
  return {
      OptionSpec::integer("r", 8, "rank of the update").at_least(1).at_most(65536),
      OptionSpec::real("alpha", 16.0, "scale numerator: the update is scaled by alpha/r (alpha/sqrt(r) with rslora)").at_least(0),
      OptionSpec::real("dropout", 0.0, "dropout on the adapter's input while training").at_least(0).at_most(0.99),
      OptionSpec::any_of("target_modules", kString | kStringList, OptionValue{StringList{"q_proj", "v_proj"}},
                         "module names or suffixes to adapt; a string is a regex over full names; \"all-linear\" = every linear but the head"),
      OptionSpec::boolean("rslora", false, "rank-stabilised scaling alpha/sqrt(r)"),
      OptionSpec::string_list("modules_to_save", StringList{},
                              "modules trained in full and saved with the adapter, by name or suffix, e.g. [\"lm_head\"] or [\"down_proj\"]"),
      OptionSpec::string("bias", "none", "which biases to train (PEFT's bias); only \"none\"").one_of({"none"}),
      OptionSpec::string_list("target_parameters", StringList{},
                              "stacked expert weights to adapt, by name or suffix (PEFT's target_parameters), e.g. [\"mlp.experts.gate_up_proj\", "
                              "\"mlp.experts.down_proj\"]: each expert its own A and B"),
  };
}

struct Settings {
  std::int64_t r = 8;
  double alpha = 16;
  double dropout = 0;
  bool rslora = false;
  OptionValue targets;  // see Targets
  StringList modules_to_save;
  StringList target_parameters;
  double scale() const { return rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / static_cast<double>(r); }
};

// Real target_modules regexes are tens of characters; module names are short, so any sane
// pattern matches one within a small budget (a catastrophic one is refused at the first name).
constexpr std::size_t kMaxPatternBytes = 4096;
constexpr std::uint32_t kMatchBudget = 20'000;

// PEFT's matching: a list entry matches a module named exactly so or ending in ".entry"; a string
// is a regex the whole name must match; "all-linear" is every linear layer but the output head.
class Targets {
 public:
  explicit Targets(OptionValue targets) : targets_(std::move(targets)) {
    const auto* pattern = std::get_if<std::string>(&targets_);
    if (!pattern || *pattern == "all-linear") return;
    if (pattern->size() > kMaxPatternBytes)
      throw UserError("target_modules: a regular expression of " + std::to_string(pattern->size()) + " bytes is longer than the " +
                      std::to_string(kMaxPatternBytes) + " allowed; list the module names instead");
    try {
      regex_ = std::make_shared<Regex>(*pattern, kMatchBudget);
    } catch (const UserError& e) {
      throw UserError(std::string("target_modules: ") + e.what());
    }
  }
  bool match(const std::string& module) const {
    if (const auto* list = std::get_if<StringList>(&targets_)) {
      for (const auto& key : *list)
        if (module == key || (module.size() > key.size() && module.compare(module.size() - key.size() - 1, key.size() + 1, "." + key) == 0))
          return true;
      return false;
    }
    if (!regex_) return module != "lm_head";  // all-linear
    try {
      return regex_->full_match(module);
    } catch (const UserError& e) {
      throw UserError(std::string("target_modules: ") + e.what());
    }
  }
  // For messages: the list, or the pattern cut short.
  std::string shown() const {
    std::string text = format_option_value(targets_);
    return text.size() > 80 ? text.substr(0, 77) + "..." : text;
  }

 private:
  OptionValue targets_;
  std::shared_ptr<const Regex> regex_;
};

std::string short_name(const std::string& module) {
  const auto dot = module.rfind('.');
  return dot == std::string::npos ? module : module.substr(dot + 1);
}

// B scaled ([out, r]) rather than the [tokens, out] product: one pass over the largest tensor
// fewer, forward and backward.
at::Tensor scaled(const at::Tensor& b, double scale) { return scale == 1.0 ? b : b * scale; }

// base(x) + (x A^T)(scale B)^T over a frozen base as one autograd node. Backward makes the input's
// gradient once: dy W from the base's dense matrix (a fresh dequantized copy for a 4-bit base, as
// its own backward makes), LoRA's (dy scale B) A accumulated into it by the product, where
// autograd would make the two [tokens, in] gradients apart and sum them.
struct LoraProduct : public torch::autograd::Function<LoraProduct> {
  static LinearWeight& base_of(torch::autograd::AutogradContext* ctx) {
    return *reinterpret_cast<LinearWeight*>(static_cast<std::intptr_t>(ctx->saved_data["base"].toInt()));
  }
  // `base`: the LinearWeight's address, which lives as long as the model and so the graph.
  // `bias` (frozen, or undefined) by address: an undefined tensor is no input autograd takes.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, std::int64_t base,
                            double scale, const at::Tensor* bias) {
    ctx->saved_data["base"] = base;
    ctx->saved_data["scale"] = scale;
    const at::Tensor u = at::mm(x, a.t());
    at::Tensor y = base_of(ctx).forward(x, *bias);
    y.addmm_(u, scaled(b, scale).t());
    ctx->save_for_backward({x, u, a, b});
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &u = saved[1], &a = saved[2], &b = saved[3], &dy = grads[0];
    const double scale = ctx->saved_data["scale"].toDouble();
    const at::Tensor du = at::mm(dy, scaled(b, scale));
    at::Tensor dx, da, db;
    if (ctx->needs_input_grad(0)) {
      at::Tensor w = base_of(ctx).dense();
      dx = at::mm(dy, w.scalar_type() == dy.scalar_type() ? w : w.to(dy.scalar_type()));
      w = at::Tensor();  // a dequantized copy goes before the next product
      dx.addmm_(du, a);
    }
    if (ctx->needs_input_grad(1)) da = at::mm(du.t(), x);
    if (ctx->needs_input_grad(2)) {
      db = at::mm(dy.t(), u);
      if (scale != 1.0) db.mul_(scale);
    }
    return {dx, da, db, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// PEFT's init of a LoRA A of `rows` x `in`: kaiming-uniform(a=sqrt(5)), i.e. U(-1/sqrt(in),
// 1/sqrt(in)), in fp32, drawn on the CPU from the seed of the adapter's `index`-th target: the same
// on any device or rank.
at::Tensor peft_initial_a(std::int64_t rows, std::int64_t in, std::uint64_t seed, std::uint64_t index) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 1000003 + index);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  return at::empty({rows, in}, at::kFloat).uniform_(-bound, bound, gen);
}

// Whether LoraProduct knows how to take `base`'s input gradient: a plain dense weight (not a tensor
// shard, whose gradient is summed over its group) or a 4-bit one, frozen, in x's dtype.
bool product_knows(LinearWeight& base, const at::Tensor& x) {
  if (typeid(base) == typeid(DenseWeight)) {
    if (static_cast<DenseWeight&>(base).weight.requires_grad()) return false;
  } else if (const auto* q = dynamic_cast<const QuantizedWeight*>(&base)) {
    if (q->compute_dtype() != x.scalar_type()) return false;
  } else {
    return false;
  }
  return base.options().dtype() == x.dtype() && base.options().device() == x.device();
}

// On a tensor-parallel base (Megatron's LoRA split): a column-parallel layer keeps A whole and
// its rows of B, the [tokens, r] product x A^T summed over the group in backward; a row-parallel
// layer keeps its columns of A and B whole, x A^T summed over the group forward. Every rank then
// computes exactly its part of what one device computes.
class LoraLinear final : public LinearAdapter, public DeltaAddedInPlace, public WholeProduct, public FoldableDelta {
 public:
  LoraLinear(at::Tensor a, at::Tensor b, double scale, double dropout, TensorShard shard, std::vector<std::int64_t> pieces, std::int64_t in_features,
             std::int64_t out_features)
      : in_features(in_features), out_features(out_features), pieces(std::move(pieces)), scale_(scale), dropout_(dropout), shard_(shard) {
    A = register_parameter("lora_A", std::move(a));
    B = register_parameter("lora_B", std::move(b));
  }
  at::Tensor delta(const at::Tensor& x) override { return at::linear(low_rank(x), scaled_b()); }
  // y += u B^T as the second product's accumulate: no [tokens, out] delta made, read and summed
  // (two passes over the layer's output fewer, per projection, forward). Only into a [tokens, out]
  // y itself: into a view of it, autograd would copy the whole gradient in backward.
  void add_delta_to(at::Tensor& y, const at::Tensor& x) override {
    const at::Tensor u = low_rank(x);
    if (y.dim() != 2 || u.dim() != 2 || !y.is_contiguous() || y.size(1) != B.size(0) || y.scalar_type() != u.scalar_type()) {
      y = y + at::linear(u, scaled_b());
      return;
    }
    y.addmm_(u, scaled_b().t());
  }
  // With gradients over a frozen dense or 4-bit base, unsplit and without dropout: one node for the
  // whole layer (LoraProduct), one [tokens, in] gradient of x.
  at::Tensor forward_with(LinearWeight& base, const at::Tensor& x, const at::Tensor& bias) override {
    const bool grad = at::GradMode::is_enabled() && (x.requires_grad() || A.requires_grad() || B.requires_grad());
    if (!grad || shard_.split() || (dropout_ > 0 && is_training()) || (bias.defined() && bias.requires_grad())) return {};
    if (x.dim() != 2 || x.scalar_type() != A.scalar_type() || x.scalar_type() != B.scalar_type() || !product_knows(base, x)) return {};
    return LoraProduct::apply(x, A, B, static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(&base)), scale_, &bias);
  }
  // scale B A: this rank's rows (B's) or columns (A's) of the whole layer's, as base() holds them.
  at::Tensor folded_delta() const override { return at::matmul(B.to(at::kFloat), A.to(at::kFloat)).mul_(scale_); }
  const TensorShard& shard() const { return shard_; }
  at::Tensor A;  // [r, in] (a row-parallel layer: its columns)
  at::Tensor B;  // [out, r] (a column-parallel layer: its rows)
  const std::int64_t in_features, out_features;  // the whole layer's
  const std::vector<std::int64_t> pieces;         // a fused layer's output pieces (column_pieces): B's rows split by them

 private:
  // Dropout on the input. On a row-parallel layer the mask is drawn for the whole input and this
  // rank's columns kept: the ranks (which draw alike) mask as one device masks the whole input.
  at::Tensor dropped(const at::Tensor& x) const {
    if (!(dropout_ > 0 && is_training())) return x;
    if (shard_.weight_dim() != 1) return at::dropout(x, dropout_, true);
    auto shape = x.sizes().vec();
    shape.back() = in_features;
    const auto cols = shard_range(in_features, shard_.rank(), shard_.size());
    const at::Tensor keep = at::empty(shape, x.options()).bernoulli_(1 - dropout_).narrow(-1, cols.start, cols.length);
    return x * keep / (1 - dropout_);
  }

  // x A^T, summed or copied over the tensor group as the layer's split needs.
  at::Tensor low_rank(const at::Tensor& x) const {
    at::Tensor u = at::linear(dropped(x), A);
    if (shard_.split()) u = shard_.style == ParallelStyle::kColumn ? copy_to_tensor_region(u, shard_.group) : reduce_from_tensor_region(u, shard_.group);
    return u;
  }
  at::Tensor scaled_b() const { return scaled(B, scale_); }

  double scale_, dropout_;
  TensorShard shard_;
};

// This rank's part of a whole LoRA tensor ([r, in] A or [out, r] B) of a layer split by `shard`
// (a fused layer's B by its output's pieces).
at::Tensor part_of(const at::Tensor& whole, const TensorShard& shard, bool is_a, const std::vector<std::int64_t>& pieces = {}) {
  const int dim = is_a ? (shard.weight_dim() == 1 ? 1 : -1) : (shard.weight_dim() == 0 ? 0 : -1);
  if (dim < 0) return whole;
  return part_of_pieces(whole, dim, is_a ? std::vector<std::int64_t>{} : pieces, shard.rank(), shard.size());
}

// The output pieces of the linear whose weight is parameter `name` (modules_to_save), if fused.
std::vector<std::int64_t> weight_pieces(LoadedModel& model, const std::string& name) {
  for (const auto& l : model.linears())
    if (l.layer && name == l.name + ".weight") return column_pieces(l.layer->base());
  return {};
}

}  // namespace lora_detail
using namespace lora_detail;

class LoraAdapter::Impl final : public Adapter {
 public:
  explicit Impl(Settings s) : s_(std::move(s)), targets_(s_.targets) {}
  bool adapts(const std::string& linear) const { return targets_.match(linear); }

  std::vector<std::uint64_t> trainable_parameters(const ModelStructure& model) const override {
    std::vector<std::uint64_t> out;
    std::size_t matched = 0;
    std::set<std::string> names;
    for (const auto& block : model.blocks) {
      std::uint64_t n = 0;
      for (const auto& l : block.linears) {
        names.insert(short_name(l.name));
        if (!targets_.match(l.name)) continue;
        ++matched;
        n += static_cast<std::uint64_t>(s_.r) * static_cast<std::uint64_t>(l.in_features + l.out_features);
      }
      for (const auto& m : s_.modules_to_save) {
        if (saves_block(m, block)) n += block.parameters;
        for (const auto& l : block.linears)
          if (matches(l.name, m)) n += static_cast<std::uint64_t>(l.in_features * l.out_features);
      }
      out.push_back(n);
    }
    if (matched == 0 && s_.target_parameters.empty()) {  // LoRA on experts alone: expert_trainable_parameters checks its targets
      std::string known;
      for (const auto& n : names) known += (known.empty() ? "" : ", ") + n;
      throw UserError("target_modules " + targets_.shown() + " matches no linear layer of this model (its linears: " + known + ")");
    }
    return out;
  }

  std::vector<std::uint64_t> expert_trainable_parameters(const ModelStructure& model, const std::vector<ExpertsInfo>& experts) const {
    std::vector<std::uint64_t> out(model.blocks.size(), 0);
    if (s_.target_parameters.empty()) return out;
    bool any = false;
    for (const auto& e : experts)
      for (const auto& target : s_.target_parameters)
        if (matches(e.name, target) && e.block < out.size()) {
          out[e.block] += static_cast<std::uint64_t>(s_.r) * static_cast<std::uint64_t>(e.experts) * static_cast<std::uint64_t>(e.in_features + e.out_features);
          any = true;
          break;
        }
    if (!any) throw UserError(no_expert_target());
    return out;
  }
  std::string no_expert_target() const {
    return "target_parameters " + format_option_value(OptionValue{s_.target_parameters}) +
           " names no stacked experts weight of this model (a mixture of experts' \"mlp.experts.gate_up_proj\" and \"mlp.experts.down_proj\")";
  }

  std::vector<NamedParameter> attach(LoadedModel& model, std::uint64_t seed) override {
    for (const auto& l : model.linears())
      for (const auto& m : s_.modules_to_save)
        if (matches(l.name, m) && targets_.match(l.name))
          throw UserError(l.name + " is both a LoRA target and in modules_to_save; take it out of one of them");
    std::vector<NamedParameter> trainable;
    std::uint64_t index = 0;
    torch::NoGradGuard no_grad;
    for (const auto& l : model.linears()) {
      if (!targets_.match(l.name)) continue;
      if (!l.layer) {  // held by another rank: numbered all the same
        ++index;
        continue;
      }
      const auto options = l.layer->options();
      // B = 0, so step 0 is the base model. A drawn whole and cut, so a tensor-parallel rank holds
      // its part of what one device draws.
      const TensorShard shard = l.layer->base().shard();
      at::Tensor a = part_of(peft_initial_a(s_.r, l.layer->in_features, seed, index++), shard, true).to(options).contiguous();
      at::Tensor b = part_of(at::zeros({l.layer->out_features, s_.r}, options), shard, false, column_pieces(l.layer->base())).clone();
      add(l, a, b, l.block, trainable);
    }
    for (const auto& [e, key] : expert_targets(model)) {
      if (e.delta == nullptr) {  // another rank's
        ++index;
        continue;
      }
      check_expert_target(model, e);
      const std::int64_t experts = e.weight.size(0), out = e.weight.size(1), in = e.weight.size(2);
      // PEFT's init of its [E * r, in] lora_A, as of a linear's A, and B = 0: drawn for every
      // expert, so a rank holding some of them (ExpertShards) keeps what one process would.
      const ExpertsHeld held = experts_held(model, e);
      const at::Tensor a = peft_initial_a(held.total * s_.r, in, seed, index++).view({held.total, s_.r, in}).narrow(0, held.first, experts);
      add_experts(e, key, held, a.to(e.weight.options()).clone(), at::zeros({experts, out, s_.r}, e.weight.options()), trainable);  // its own rows only
    }
    save_modules(model, trainable);
    return trainable;
  }

  // The stacked experts weights target_parameters names, each with its adapter's key in PEFT's file
  // (without ".lora_A.weight"): PEFT wraps a module once per targeted parameter, in the order the
  // module registers them, so each but the last is under one more "base_layer." than the next.
  std::vector<std::pair<NamedExperts, std::string>> expert_targets(LoadedModel& model) const {
    std::vector<std::pair<NamedExperts, std::string>> out;
    if (s_.target_parameters.empty()) return out;
    auto* experts = dynamic_cast<ExpertWeights*>(&model);
    if (experts != nullptr)
      for (const auto& e : experts->expert_weights())
        for (const auto& target : s_.target_parameters)
          if (matches(e.name, target)) {
            out.emplace_back(e, e.name.substr(0, e.name.rfind('.')));
            break;
          }
    if (out.empty()) throw UserError(no_expert_target());
    for (std::size_t i = 0; i < out.size(); ++i) {
      std::size_t later = 0;
      for (std::size_t j = i + 1; j < out.size(); ++j) later += out[j].second == out[i].second ? 1 : 0;
      std::string key = kPrefix + out[i].second;
      for (std::size_t n = 0; n < later; ++n) key += ".base_layer";
      out[i].second = key;
    }
    return out;
  }

  void check_expert_target(LoadedModel& model, const NamedExperts& e) const {
    if (model.shard_dim(e.name) >= 0)
      throw UserError(e.name + ": LoRA on experts split over tensor ranks is not supported yet; leave [parallel] tensor at 1 or drop target_parameters");
    if (s_.dropout > 0)
      throw UserError("target_parameters: PEFT's LoRA on a parameter has no dropout (PEFT refuses it too); set [adapter] dropout = 0.0");
  }

  // Which of a stacked weight's experts this rank holds: all, unless the model shares them out.
  static ExpertsHeld experts_held(LoadedModel& model, const NamedExperts& e) {
    ExpertsHeld held = shared_experts(model, e.name);
    if (held.group == nullptr) held = {0, e.weight.size(0), nullptr};
    return held;
  }

  void add_experts(const NamedExperts& e, const std::string& key, const ExpertsHeld& held, at::Tensor a, at::Tensor b,
                   std::vector<NamedParameter>& trainable) {
    a.set_requires_grad(true);
    b.set_requires_grad(true);
    *e.delta = ExpertsDelta{a, b, s_.scale()};
    expert_adapters_[e.name] = ExpertLora{a, b, key, held};
    trainable.push_back({key + ".lora_A.weight", e.block, a});
    trainable.push_back({key + ".lora_B.weight", e.block, b});
  }

  std::vector<NamedParameter> load(LoadedModel& model, const fs::path& dir) override {
    read_config(dir);
    SafetensorsFile file(dir / "adapter_model.safetensors");
    std::vector<NamedParameter> trainable;
    std::set<std::string> used;
    torch::NoGradGuard no_grad;
    bool holds_all = true;
    for (const auto& l : model.linears()) {
      const std::string a_key = kPrefix + l.name + ".lora_A.weight", b_key = kPrefix + l.name + ".lora_B.weight";
      if (!l.layer) {  // another rank's
        holds_all = false;
        used.insert(a_key);
        used.insert(b_key);
        continue;
      }
      const bool has_a = file.find(a_key) != nullptr, has_b = file.find(b_key) != nullptr;
      if (!has_a && !has_b) continue;
      refuse_patterns_naming(l.name, file.path());
      if (has_a != has_b) throw UserError(file.path().string() + ": " + (has_a ? b_key : a_key) + " is missing (A and B come in pairs)");
      const at::Tensor a = file.tensor(a_key), b = file.tensor(b_key);
      const auto options = l.layer->options();
      if (a.dim() != 2 || b.dim() != 2 || a.size(0) != s_.r || a.size(1) != l.layer->in_features || b.size(0) != l.layer->out_features ||
          b.size(1) != s_.r)
        throw UserError(file.path().string() + ": " + l.name + " has lora_A " + shape(a) + " and lora_B " + shape(b) + "; expected [" +
                        std::to_string(s_.r) + ", " + std::to_string(l.layer->in_features) + "] and [" +
                        std::to_string(l.layer->out_features) + ", " + std::to_string(s_.r) + "]");
      const TensorShard shard = l.layer->base().shard();  // a tensor-parallel rank reads its part
      // Copies: a tensor of the file maps its pages, which training must not write to.
      add(l, part_of(a, shard, true).to(options).clone(at::MemoryFormat::Contiguous),
          part_of(b, shard, false, column_pieces(l.layer->base())).to(options).clone(at::MemoryFormat::Contiguous), l.block,
          trainable);
      used.insert(a_key);
      used.insert(b_key);
    }
    for (const auto& [e, key] : expert_targets(model)) {
      const std::string a_key = key + ".lora_A.weight", b_key = key + ".lora_B.weight";
      used.insert(a_key);
      used.insert(b_key);
      if (e.delta == nullptr) {
        holds_all = false;
        continue;
      }
      check_expert_target(model, e);
      refuse_patterns_naming(e.name, file.path());
      if (file.find(a_key) == nullptr || file.find(b_key) == nullptr)
        throw UserError(file.path().string() + ": target_parameters names " + e.name + ", but " + (file.find(a_key) ? b_key : a_key) + " is missing");
      const at::Tensor a = file.tensor(a_key), b = file.tensor(b_key);
      const ExpertsHeld held = experts_held(model, e);
      const std::int64_t experts = held.total, out = e.weight.size(1), in = e.weight.size(2);
      if (a.dim() != 2 || b.dim() != 2 || a.size(0) != experts * s_.r || a.size(1) != in || b.size(0) != out || b.size(1) != experts * s_.r)
        throw UserError(file.path().string() + ": " + e.name + " has lora_A " + shape(a) + " and lora_B " + shape(b) + "; expected [" +
                        std::to_string(experts * s_.r) + ", " + std::to_string(in) + "] and [" + std::to_string(out) + ", " +
                        std::to_string(experts * s_.r) + "] (PEFT 0.20 and later's layout)");
      const ExpertsDelta d = experts_low_rank_from_peft(a, b, experts, s_.scale());  // this rank's experts of them
      const std::int64_t here = e.weight.size(0);
      add_experts(e, key, held, d.a.narrow(0, held.first, here).to(e.weight.options()).clone(at::MemoryFormat::Contiguous),
                  d.b.narrow(0, held.first, here).to(e.weight.options()).clone(at::MemoryFormat::Contiguous), trainable);
    }
    for (const auto& p : model.parameters()) {
      const std::string key = kPrefix + p.name;
      if (file.find(key) == nullptr) continue;
      if (!saved_module(p.name)) throw UserError(file.path().string() + ": holds " + key + " but modules_to_save does not name it");
      at::Tensor t = file.tensor(key);
      if (const int dim = model.shard_dim(p.name); dim >= 0 && t.dim() > dim) {  // this rank's rows
        const Communicator& group = tensor_group(model);
        t = part_of_pieces(t, dim, weight_pieces(model, p.name), group.rank(), group.size());
      } else if (const ExpertsHeld held = shared_experts(model, p.name); held.group != nullptr && t.dim() == p.tensor.dim() && t.size(0) == held.total) {
        t = t.narrow(0, held.first, p.tensor.size(0));  // this rank's experts
      }
      if (t.sizes() != p.tensor.sizes()) throw UserError(file.path().string() + ": " + key + " has shape " + shape(t) + ", the model " + shape(p.tensor));
      p.tensor.copy_(t);
      used.insert(key);
    }
    save_modules(model, trainable);
    for (const auto& info : file.tensors())
      if (!used.count(info.name))
        throw UserError(file.path().string() + ": tensor '" + info.name + "' matches no module of this model (a LoRA for another architecture?)");
    if (adapters_.empty() && expert_adapters_.empty() && holds_all) throw UserError(dir.string() + ": the adapter holds no LoRA weights for this model");
    return trainable;
  }

  std::vector<std::pair<std::string, at::Tensor>> saved_tensors(LoadedModel& model) const override {
    // Whole tensors: a tensor-parallel rank's parts gathered over its group (every rank calls this).
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& [name, lora] : adapters_) {
      const TensorShard& shard = lora->shard();
      tensors.emplace_back(kPrefix + name + ".lora_A.weight", shard.weight_dim() == 1 ? gather_shards(lora->A, 1, lora->in_features, *shard.group) : lora->A);
      tensors.emplace_back(kPrefix + name + ".lora_B.weight", shard.weight_dim() == 0 ? gather_pieces(lora->B, 0, lora->pieces, *shard.group) : lora->B);
    }
    for (const auto& [name, lora] : expert_adapters_) {
      // Every expert's: a rank holding some of them gathers the others' over its expert group.
      const ExpertsHeld& held = lora.held;  // a structured binding a lambda may not capture (C++17)
      const auto whole = [&](const at::Tensor& t) { return held.group ? gather_shards(t, 0, held.total, *held.group) : t; };
      const auto [a, b] = experts_low_rank_to_peft(ExpertsDelta{whole(lora.a), whole(lora.b), 1});
      tensors.emplace_back(lora.key + ".lora_A.weight", a.contiguous());
      tensors.emplace_back(lora.key + ".lora_B.weight", b.contiguous());
    }
    for (const auto& p : model.parameters()) {
      if (!saved_module(p.name)) continue;
      const int dim = model.shard_dim(p.name);
      const ExpertsHeld held = shared_experts(model, p.name);
      tensors.emplace_back(kPrefix + p.name, dim >= 0               ? gather_pieces(p.tensor, dim, weight_pieces(model, p.name), tensor_group(model))
                                             : held.group != nullptr ? gather_shards(p.tensor, 0, held.total, *held.group)
                                                                     : p.tensor);
    }
    return tensors;
  }

  int shard_dim(LoadedModel& model, const std::string& name) const override {
    for (const char* suffix : {".lora_A.weight", ".lora_B.weight"}) {
      const std::string tail = suffix;
      if (name.size() <= tail.size() + std::string(kPrefix).size() || name.compare(name.size() - tail.size(), tail.size(), tail) != 0) continue;
      const auto it = adapters_.find(name.substr(std::string(kPrefix).size(), name.size() - tail.size() - std::string(kPrefix).size()));
      if (it == adapters_.end()) return -1;
      const int dim = it->second->shard().weight_dim();
      return tail == ".lora_A.weight" ? (dim == 1 ? 1 : -1) : (dim == 0 ? 0 : -1);
    }
    return name.compare(0, std::string(kPrefix).size(), kPrefix) == 0 ? model.shard_dim(name.substr(std::string(kPrefix).size())) : -1;
  }

  void write(const std::vector<std::pair<std::string, at::Tensor>>& tensors, const fs::path& dir) const override {
    fs::create_directories(dir);
    // target_modules names what the tensors adapt, whichever ranks held them.
    std::set<std::string> targets;
    const std::string prefix = kPrefix, a_suffix = ".lora_A.weight";
    for (const auto& [key, tensor] : tensors)
      if (key.size() > prefix.size() + a_suffix.size() && key.compare(key.size() - a_suffix.size(), a_suffix.size(), a_suffix) == 0) {
        const std::string module = key.substr(prefix.size(), key.size() - prefix.size() - a_suffix.size());
        // An experts weight's A is [E * r, in], a linear's [r, in].
        if (tensor.dim() != 2 || tensor.size(0) == s_.r) targets.insert(short_name(module));
      }
    write_safetensors(dir / "adapter_model.safetensors", tensors, {{"format", "pt"}});
    nlohmann::json modules_to_save = nullptr;
    if (!s_.modules_to_save.empty()) modules_to_save = s_.modules_to_save;
    const nlohmann::json config = {{"peft_type", "LORA"},
                                   {"task_type", "CAUSAL_LM"},
                                   {"r", s_.r},
                                   {"lora_alpha", s_.alpha},
                                   {"lora_dropout", s_.dropout},
                                   {"use_rslora", s_.rslora},
                                   {"target_modules", std::vector<std::string>(targets.begin(), targets.end())},
                                   {"modules_to_save", modules_to_save},
                                   {"target_parameters", s_.target_parameters.empty() ? nlohmann::json(nullptr) : nlohmann::json(s_.target_parameters)},
                                   {"bias", "none"},
                                   {"fan_in_fan_out", false},
                                   {"init_lora_weights", true},
                                   {"inference_mode", true},
                                   {"use_dora", false},
                                   {"rank_pattern", nlohmann::json::object()},
                                   {"alpha_pattern", nlohmann::json::object()},
                                   {"layers_to_transform", nullptr},
                                   {"layers_pattern", nullptr},
                                   {"base_model_name_or_path", nullptr},
                                   {"revision", nullptr}};
    write_file_atomically(dir / "adapter_config.json", config.dump(2) + "\n");
  }

  void merge(LoadedModel& model) override {
    torch::NoGradGuard no_grad;
    for (const auto& l : model.linears()) {
      if (!l.layer) continue;
      auto it = adapters_.find(l.name);
      if (it == adapters_.end()) continue;
      // W' = W + scale * B A, accumulated in fp32 so a bf16 base loses no more than one rounding.
      l.layer->base().add_(it->second->folded_delta());
      l.layer->detach();
    }
    adapters_.clear();
    if (auto* experts = dynamic_cast<ExpertWeights*>(&model); experts != nullptr && !expert_adapters_.empty())
      for (const auto& e : experts->expert_weights()) {
        const auto it = expert_adapters_.find(e.name);
        if (it == expert_adapters_.end() || e.delta == nullptr) continue;
        // Each expert's W + scale B A, summed in fp32.
        e.weight.add_((at::matmul(it->second.b.to(at::kFloat), it->second.a.to(at::kFloat)) * s_.scale()).to(e.weight.scalar_type()));
        *e.delta = ExpertsDelta{};
      }
    expert_adapters_.clear();
  }

  // Reads PEFT's adapter_config.json and takes its settings over the pipeline's, refusing
  // features this plugin does not implement rather than loading them wrong.
  void read_config(const fs::path& dir) {
    const fs::path path = dir / "adapter_config.json";
    std::error_code ec;
    if (!fs::exists(path, ec)) throw UserError(path.string() + ": missing; an adapter folder holds adapter_config.json and adapter_model.safetensors");
    const auto root = json::read_file(path, 16u << 20, "adapter config");
    const json::Value j(root, path.string());
    j.object();
    const auto unsupported = [&](const std::string& what) { return UserError(path.string() + ": " + what + " is not supported by loom's lora plugin"); };
    if (j["peft_type"].string_or("") != "LORA") j["peft_type"].expected("\"LORA\"");
    if (j["use_dora"].boolean_or(false)) throw unsupported("use_dora");
    if (j["fan_in_fan_out"].boolean_or(false)) throw unsupported("fan_in_fan_out");
    if (const auto bias = j["bias"].string_or("none"); bias != "none") throw unsupported("bias = \"" + bias + "\"");
    // Per-module ranks and alphas loom does not give: refused where a key names a module the file
    // adapts (load() checks), passed over where it names none (PEFT writes them so too).
    // Each key compiled once as PEFT matches it: the name ends in ".KEY" or is KEY.
    patterns_.clear();
    for (const char* what : {"rank_pattern", "alpha_pattern"})
      if (j.has(what))
        for (const auto& [key, value] : j[what].object().items()) {
          if (key.size() > kMaxPatternBytes) throw UserError(path.string() + ": " + what + " key of " + std::to_string(key.size()) + " bytes");
          patterns_.push_back({what, key, std::make_shared<Regex>("(.*\\.)?(" + key + ")", kMatchBudget)});
        }
    s_.r = j["r"].integer(1, 65536);
    s_.alpha = j["lora_alpha"].number();
    s_.rslora = j["use_rslora"].boolean_or(false);
    s_.dropout = j["lora_dropout"].number_or(0);
    if (!(s_.dropout >= 0 && s_.dropout < 1)) j["lora_dropout"].fail("must be at least 0 and below 1");
    s_.target_parameters.clear();
    if (j.has("target_parameters"))
      for (std::size_t i = 0; i < j["target_parameters"].array().size(); ++i) s_.target_parameters.push_back(j["target_parameters"][i].string());
    s_.modules_to_save.clear();
    if (j.has("modules_to_save"))
      for (std::size_t i = 0; i < j["modules_to_save"].array().size(); ++i) s_.modules_to_save.push_back(j["modules_to_save"][i].string());
  }

 private:
  void add(const NamedLinear& l, at::Tensor a, at::Tensor b, std::size_t block, std::vector<NamedParameter>& trainable) {
    auto lora = std::make_shared<LoraLinear>(a.set_requires_grad(true), b.set_requires_grad(true), s_.scale(), s_.dropout, l.layer->base().shard(),
                                             column_pieces(l.layer->base()), l.layer->in_features, l.layer->out_features);
    l.layer->attach("lora", lora);
    adapters_[l.name] = lora;
    trainable.push_back({kPrefix + l.name + ".lora_A.weight", block, lora->A});
    trainable.push_back({kPrefix + l.name + ".lora_B.weight", block, lora->B});
  }

  void save_modules(LoadedModel& model, std::vector<NamedParameter>& trainable) {
    for (auto& p : model.parameters()) {
      if (!saved_module(p.name)) continue;
      p.tensor.set_requires_grad(true);
      trainable.push_back({kPrefix + p.name, p.block, p.tensor});
    }
  }

  // A module name matches an entry equal to it or ending in ".entry", as PEFT matches them:
  // "lm_head", "embed_tokens", "down_proj", "mlp.down_proj".
  static bool matches(const std::string& module, const std::string& entry) {
    return module == entry ||
           (module.size() > entry.size() && module.compare(module.size() - entry.size() - 1, entry.size() + 1, "." + entry) == 0);
  }

  bool saved_module(const std::string& parameter) const {
    const auto dot = parameter.rfind('.');
    const std::string module = dot == std::string::npos ? parameter : parameter.substr(0, dot);
    for (const auto& m : s_.modules_to_save)
      if (matches(module, m)) return true;
    return false;
  }

  static bool saves_block(const std::string& module, const BlockInfo& block) {
    return (module == "lm_head" && block.kind == BlockKind::kHead) || (module == "embed_tokens" && block.kind == BlockKind::kEmbedding);
  }

  // Which experts of a stacked experts parameter this rank holds where the model shares them out
  // (group null otherwise, and for any other parameter).
  static ExpertsHeld shared_experts(LoadedModel& model, const std::string& name) {
    const auto* shards = dynamic_cast<ExpertShards*>(&model);
    return shards != nullptr ? shards->experts_held(name) : ExpertsHeld{};
  }

  // The group a tensor-parallel model is split over: any split linear's.
  static Communicator& tensor_group(LoadedModel& model) {
    for (const auto& l : model.linears())
      if (l.layer && l.layer->base().shard().split()) return *l.layer->base().shard().group;
    throw std::logic_error("lora: the model reports a split parameter but no split linear");
  }

  static std::string shape(const at::Tensor& t) {
    std::string out = "[";
    for (std::int64_t i = 0; i < t.dim(); ++i) out += (i ? ", " : "") + std::to_string(t.size(i));
    return out + "]";
  }

  // LoRA on one stacked experts weight: A [E, r, in] and B [E, out, r] (loom's layout; PEFT's in its
  // file); the model reads them through the weight's ExpertsDelta.
  struct ExpertLora {
    at::Tensor a, b;
    std::string key;  // in PEFT's file, less ".lora_A.weight"
    ExpertsHeld held;  // which of the weight's experts this rank holds (a, b: theirs)
  };

  // A rank_pattern or alpha_pattern key naming a module the file adapts: one error; keys naming
  // none pass.
  void refuse_patterns_naming(const std::string& adapted, const fs::path& file) const {
    for (const auto& p : patterns_)
      if (p.regex->full_match(adapted))
        throw UserError(file.parent_path().string() + "/adapter_config.json: " + p.what + " \"" + p.key + "\" gives " + adapted +
                        " its own rank or alpha, which loom's lora plugin does not (one r and lora_alpha for every module)");
  }

  Settings s_;
  struct RankPattern {
    std::string what, key;  // rank_pattern or alpha_pattern, and the key as PEFT wrote it
    std::shared_ptr<Regex> regex;
  };
  std::vector<RankPattern> patterns_;
  Targets targets_;
  std::map<std::string, std::shared_ptr<LoraLinear>> adapters_;
  std::map<std::string, ExpertLora> expert_adapters_;  // by the stacked weight's name
};

std::vector<OptionSpec> lora_options() { return options_of_lora(); }

namespace {
Settings settings_of(const Options& o) {
  Settings s;
  s.r = o.get_int("r");
  s.alpha = o.get_float("alpha");
  s.dropout = o.get_float("dropout");
  s.rslora = o.get_bool("rslora");
  s.targets = o.get("target_modules");
  s.modules_to_save = o.get_string_list("modules_to_save");
  s.target_parameters = o.get_string_list("target_parameters");
  return s;
}
}  // namespace

LoraAdapter::LoraAdapter(const Options& options) : impl_(std::make_unique<Impl>(settings_of(options))) {}
LoraAdapter::~LoraAdapter() = default;
bool LoraAdapter::adapts(const std::string& linear) const { return impl_->adapts(linear); }
std::vector<std::uint64_t> LoraAdapter::trainable_parameters(const ModelStructure& model) const { return impl_->trainable_parameters(model); }
std::vector<NamedParameter> LoraAdapter::attach(LoadedModel& model, std::uint64_t seed) { return impl_->attach(model, seed); }
std::vector<NamedParameter> LoraAdapter::load(LoadedModel& model, const fs::path& dir) { return impl_->load(model, dir); }
std::vector<std::pair<std::string, at::Tensor>> LoraAdapter::saved_tensors(LoadedModel& model) const { return impl_->saved_tensors(model); }
void LoraAdapter::write(const std::vector<std::pair<std::string, at::Tensor>>& tensors, const fs::path& dir) const { impl_->write(tensors, dir); }
void LoraAdapter::merge(LoadedModel& model) { impl_->merge(model); }
std::vector<std::uint64_t> LoraAdapter::expert_trainable_parameters(const ModelStructure& model, const std::vector<ExpertsInfo>& experts) const {
  return impl_->expert_trainable_parameters(model, experts);
}
int LoraAdapter::shard_dim(LoadedModel& model, const std::string& name) const { return impl_->shard_dim(model, name); }

}  // namespace loom::kit
