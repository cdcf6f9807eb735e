#include "plugins/plugin_guard.hpp"

#include <type_traits>

namespace loom::core {
namespace {

// The plugin's object as capability C, which capability<C>() saw it offer before the host could
// ask the guard.
template <class C, class Interface>
auto& offered(Interface& object) {
  using As = std::conditional_t<std::is_const_v<Interface>, const C, C>;  // const as the object is
  auto* c = dynamic_cast<As*>(&object);
  if (!c) throw std::logic_error("asked a plugin for a capability it does not offer (the host must ask capability<C>() first)");
  return *c;
}

// Each wrapper owns the plugin's object and forwards every call through guarded(); the host only
// ever holds these, so no call into a plugin goes unguarded. A wrapper derives from every
// capability of its kind and forwards it too, but capability<C>() hands it out only where the
// plugin's own object has C (Registry's GuardsForwardEveryVirtual checks the forwarders).

class GuardedLoadedModel final : public LoadedModel, public StaticCacheDecoding, public AuxiliaryLoss, public ExpertWeights, public ExpertShards,
                                 public HeadTokenLogps, public Guard {
 public:
  GuardedLoadedModel(std::unique_ptr<LoadedModel> inner, const LoadedPlugin& plugin) : inner_(std::move(inner)), plugin_(plugin) {}
  const void* guarded_object() const override { return inner_.get(); }
  std::size_t block_count() const override { return guarded(plugin_, "block_count", [&] { return inner_->block_count(); }); }
  void forward(std::size_t index, ForwardState& state) override {
    guarded(plugin_, "forward", [&] { inner_->forward(index, state); });
  }
  at::Tensor loss_sum(const at::Tensor& head_output, const at::Tensor& labels) override {
    return guarded(plugin_, "loss_sum", [&] { return inner_->loss_sum(head_output, labels); });
  }
  at::Tensor token_logps(const at::Tensor& head_output, const at::Tensor& labels, double temperature) override {
    return guarded(plugin_, "token_logps", [&] { return offered<HeadTokenLogps>(*inner_).token_logps(head_output, labels, temperature); });
  }
  at::Tensor logits(const at::Tensor& head_output) override {
    return guarded(plugin_, "logits", [&] { return inner_->logits(head_output); });
  }
  std::vector<NamedParameter> parameters() override { return guarded(plugin_, "parameters", [&] { return inner_->parameters(); }); }
  std::vector<NamedLinear> linears() override { return guarded(plugin_, "linears", [&] { return inner_->linears(); }); }
  void set_training(bool training) override {
    guarded(plugin_, "set_training", [&] { inner_->set_training(training); });
  }
  void save_pretrained(const std::filesystem::path& dir) override {
    guarded(plugin_, "save_pretrained", [&] { inner_->save_pretrained(dir); });
  }
  int shard_dim(const std::string& name) const override {
    return guarded(plugin_, "shard_dim", [&] { return inner_->shard_dim(name); });
  }
  void forward_cached(std::size_t index, ForwardState& state, CachedPass& pass) override {
    guarded(plugin_, "forward_cached", [&] { offered<StaticCacheDecoding>(*inner_).forward_cached(index, state, pass); });
  }
  std::string auxiliary_loss_name() const override {
    return guarded(plugin_, "auxiliary_loss_name", [&] { return offered<AuxiliaryLoss>(*inner_).auxiliary_loss_name(); });
  }
  double auxiliary_loss_weight() const override {
    return guarded(plugin_, "auxiliary_loss_weight", [&] { return offered<AuxiliaryLoss>(*inner_).auxiliary_loss_weight(); });
  }
  // An adapter (a plugin too) asks the model it is handed, whose guard always derives from this:
  // a model without experts has none.
  std::vector<NamedExperts> expert_weights() override {
    return guarded(plugin_, "expert_weights", [&] {
      return dynamic_cast<ExpertWeights*>(inner_.get()) ? offered<ExpertWeights>(*inner_).expert_weights() : std::vector<NamedExperts>{};
    });
  }
  // A model that does not share out its experts holds them all: total 0 tells the host so.
  ExpertsHeld experts_held(const std::string& name) const override {
    return guarded(plugin_, "experts_held", [&] {
      return dynamic_cast<const ExpertShards*>(inner_.get()) ? offered<ExpertShards>(*inner_).experts_held(name) : ExpertsHeld{};
    });
  }
  at::Tensor auxiliary_loss(const ForwardState& state) override {
    return guarded(plugin_, "auxiliary_loss", [&] { return offered<AuxiliaryLoss>(*inner_).auxiliary_loss(state); });
  }

 private:
  std::unique_ptr<LoadedModel> inner_;
  const LoadedPlugin& plugin_;
};

class GuardedModel final : public Model, public TensorParallelModel, public StaticCacheSizing, public StaticCacheWindow, public PackedSequences,
                           public FrozenHeadWorkingSet, public ExpertStructure, public TokenCountedMemory, public Guard {
 public:
  GuardedModel(std::unique_ptr<Model> inner, const LoadedPlugin& plugin) : inner_(std::move(inner)), plugin_(plugin) {}
  const void* guarded_object() const override { return inner_.get(); }
  ModelStructure structure() const override { return guarded(plugin_, "structure", [&] { return inner_->structure(); }); }
  std::unique_ptr<LoadedModel> load(const LoadRequest& request) const override {
    auto loaded = guarded(plugin_, "load", [&] { return inner_->load(request); });
    if (!loaded) throw PluginFault(plugin_, "load", "it returned no model");
    return std::make_unique<GuardedLoadedModel>(std::move(loaded), plugin_);
  }
  TensorParallelSupport tensor_parallel(int tensor) const override {
    return guarded(plugin_, "tensor_parallel", [&] { return offered<TensorParallelModel>(*inner_).tensor_parallel(tensor); });
  }
  std::uint64_t cache_values_per_position(std::size_t index, int tensor) const override {
    return guarded(plugin_, "cache_values_per_position", [&] { return offered<StaticCacheSizing>(*inner_).cache_values_per_position(index, tensor); });
  }
  std::int64_t cache_window(std::size_t index) const override {
    return guarded(plugin_, "cache_window", [&] { return offered<StaticCacheWindow>(*inner_).cache_window(index); });
  }
  std::vector<ExpertsInfo> experts_info() const override {
    return guarded(plugin_, "experts_info", [&] { return offered<ExpertStructure>(*inner_).experts_info(); });
  }
  std::uint64_t frozen_head_working_values_per_token(std::uint64_t tokens, DType dtype) const override {
    return guarded(plugin_, "frozen_head_working_values_per_token",
                   [&] { return offered<FrozenHeadWorkingSet>(*inner_).frozen_head_working_values_per_token(tokens, dtype); });
  }
  Values block_values_per_token(std::size_t block, std::uint64_t tokens, DType dtype) const override {
    return guarded(plugin_, "block_values_per_token", [&] { return offered<TokenCountedMemory>(*inner_).block_values_per_token(block, tokens, dtype); });
  }

 private:
  std::unique_ptr<Model> inner_;
  const LoadedPlugin& plugin_;
};

class GuardedTokenizer final : public Tokenizer, public ChatTemplateSource, public Guard {
 public:
  GuardedTokenizer(std::unique_ptr<Tokenizer> inner, const LoadedPlugin& plugin) : inner_(std::move(inner)), plugin_(plugin) {}
  const void* guarded_object() const override { return inner_.get(); }
  Encoding encode(std::string_view text, Specials specials) const override {
    return guarded(plugin_, "encode", [&] { return inner_->encode(text, specials); });
  }
  std::string decode(const std::vector<std::int64_t>& ids, bool skip_special) const override {
    return guarded(plugin_, "decode", [&] { return inner_->decode(ids, skip_special); });
  }
  std::int64_t vocab_size() const override { return guarded(plugin_, "vocab_size", [&] { return inner_->vocab_size(); }); }
  SpecialTokens special_tokens() const override { return guarded(plugin_, "special_tokens", [&] { return inner_->special_tokens(); }); }
  bool pad_left() const override { return guarded(plugin_, "pad_left", [&] { return inner_->pad_left(); }); }
  std::vector<std::string> chat_template_names() const override {
    return guarded(plugin_, "chat_template_names", [&] { return offered<ChatTemplateSource>(*inner_).chat_template_names(); });
  }
  std::string chat_template(const std::string& name) const override {
    return guarded(plugin_, "chat_template", [&] { return offered<ChatTemplateSource>(*inner_).chat_template(name); });
  }
  std::string chat_template_variables() const override {
    return guarded(plugin_, "chat_template_variables", [&] { return offered<ChatTemplateSource>(*inner_).chat_template_variables(); });
  }

 private:
  std::unique_ptr<Tokenizer> inner_;
  const LoadedPlugin& plugin_;
};

class GuardedAdapter final : public Adapter, public BaseStoringAdapter, public ExpertAdapterSizing, public Guard {
 public:
  GuardedAdapter(std::unique_ptr<Adapter> inner, const LoadedPlugin& plugin) : inner_(std::move(inner)), plugin_(plugin) {}
  const void* guarded_object() const override { return inner_.get(); }
  std::vector<std::uint64_t> trainable_parameters(const ModelStructure& model) const override {
    return guarded(plugin_, "trainable_parameters", [&] { return inner_->trainable_parameters(model); });
  }
  std::vector<NamedParameter> attach(LoadedModel& model, std::uint64_t seed) override {
    return guarded(plugin_, "attach", [&] { return inner_->attach(model, seed); });
  }
  std::vector<NamedParameter> load(LoadedModel& model, const std::filesystem::path& dir) override {
    return guarded(plugin_, "load", [&] { return inner_->load(model, dir); });
  }
  std::vector<std::pair<std::string, at::Tensor>> saved_tensors(LoadedModel& model) const override {
    return guarded(plugin_, "saved_tensors", [&] { return inner_->saved_tensors(model); });
  }
  void write(const std::vector<std::pair<std::string, at::Tensor>>& tensors, const std::filesystem::path& dir) const override {
    guarded(plugin_, "write", [&] { inner_->write(tensors, dir); });
  }
  void merge(LoadedModel& model) override {
    guarded(plugin_, "merge", [&] { inner_->merge(model); });
  }
  int shard_dim(LoadedModel& model, const std::string& name) const override {
    return guarded(plugin_, "shard_dim", [&] { return inner_->shard_dim(model, name); });
  }
  std::shared_ptr<LinearWeight> base_weight(const LinearInfo& linear, const at::TensorOptions& options) const override {
    return guarded(plugin_, "base_weight", [&] { return offered<BaseStoringAdapter>(*inner_).base_weight(linear, options); });
  }
  std::vector<std::uint64_t> expert_trainable_parameters(const ModelStructure& model, const std::vector<ExpertsInfo>& experts) const override {
    return guarded(plugin_, "expert_trainable_parameters",
                   [&] { return offered<ExpertAdapterSizing>(*inner_).expert_trainable_parameters(model, experts); });
  }
  BaseStorage base_storage(const ModelStructure& model, DType dtype) const override {
    return guarded(plugin_, "base_storage", [&] { return offered<BaseStoringAdapter>(*inner_).base_storage(model, dtype); });
  }

 private:
  std::unique_ptr<Adapter> inner_;
  const LoadedPlugin& plugin_;
};

class GuardedCollator final : public Collator, public Guard {
 public:
  GuardedCollator(std::unique_ptr<Collator> inner, const LoadedPlugin& plugin) : inner_(std::move(inner)), plugin_(plugin) {}
  const void* guarded_object() const override { return inner_.get(); }
  Batch collate(const std::vector<std::string>& samples, const Tokenizer& tokenizer, const CollateSettings& settings) const override {
    return guarded(plugin_, "collate", [&] { return inner_->collate(samples, tokenizer, settings); });
  }
  std::optional<PromptSplit> split_for_generation(const std::string& sample) const override {
    return guarded(plugin_, "split_for_generation", [&] { return inner_->split_for_generation(sample); });
  }

 private:
  std::unique_ptr<Collator> inner_;
  const LoadedPlugin& plugin_;
};

class GuardedPlacement final : public Placement, public Guard {
 public:
  GuardedPlacement(std::unique_ptr<Placement> inner, const LoadedPlugin& plugin) : inner_(std::move(inner)), plugin_(plugin) {}
  const void* guarded_object() const override { return inner_.get(); }
  Plan plan(const PlacementRequest& request) const override { return guarded(plugin_, "plan", [&] { return inner_->plan(request); }); }

 private:
  std::unique_ptr<Placement> inner_;
  const LoadedPlugin& plugin_;
};

class GuardedObjective final : public Objective, public Guard {
 public:
  GuardedObjective(std::unique_ptr<Objective> inner, const LoadedPlugin& plugin) : inner_(std::move(inner)), plugin_(plugin) {}
  const void* guarded_object() const override { return inner_.get(); }
  ObjectiveNeeds needs() const override { return guarded(plugin_, "needs", [&] { return inner_->needs(); }); }
  ObjectiveLoss loss(const ObjectiveRows& rows) const override { return guarded(plugin_, "loss", [&] { return inner_->loss(rows); }); }
  at::Tensor advantages(const at::Tensor& rewards) const override {
    return guarded(plugin_, "advantages", [&] { return inner_->advantages(rewards); });
  }

 private:
  std::unique_ptr<Objective> inner_;
  const LoadedPlugin& plugin_;
};

class GuardedReward final : public Reward, public Guard {
 public:
  GuardedReward(std::unique_ptr<Reward> inner, const LoadedPlugin& plugin) : inner_(std::move(inner)), plugin_(plugin) {}
  const void* guarded_object() const override { return inner_.get(); }
  std::vector<double> score(const std::vector<Scored>& completions) const override {
    return guarded(plugin_, "score", [&] { return inner_->score(completions); });
  }

 private:
  std::unique_ptr<Reward> inner_;
  const LoadedPlugin& plugin_;
};

template <class Interface>
struct GuardOf;
template <>
struct GuardOf<Model> {
  using type = GuardedModel;
};
template <>
struct GuardOf<Tokenizer> {
  using type = GuardedTokenizer;
};
template <>
struct GuardOf<Adapter> {
  using type = GuardedAdapter;
};
template <>
struct GuardOf<Collator> {
  using type = GuardedCollator;
};
template <>
struct GuardOf<Placement> {
  using type = GuardedPlacement;
};
template <>
struct GuardOf<Objective> {
  using type = GuardedObjective;
};
template <>
struct GuardOf<Reward> {
  using type = GuardedReward;
};

}  // namespace

Guard::~Guard() = default;

PluginFault::PluginFault(const LoadedPlugin& plugin, const std::string& call, const std::string& what)
    : std::runtime_error(plugin.kind + " plugin '" + plugin.name + "' " + plugin.version + " (" + plugin.file.string() + ") failed in " +
                         (call == "create" ? std::string("its factory") : call + "()") + ": " + what) {}

template <class Interface>
std::unique_ptr<Interface> create_guarded(const PluginRegistry& registry, const LoadedPlugin& plugin, const Options& options) {
  auto object = registry.create(plugin, options);
  auto* typed = dynamic_cast<Interface*>(object.get());
  if (!typed) throw PluginFault(plugin, "create", "it returned an object that does not implement the " + plugin.kind + " interface");
  object.release();
  return std::make_unique<typename GuardOf<Interface>::type>(std::unique_ptr<Interface>(typed), plugin);
}

template std::unique_ptr<Model> create_guarded(const PluginRegistry&, const LoadedPlugin&, const Options&);
template std::unique_ptr<Tokenizer> create_guarded(const PluginRegistry&, const LoadedPlugin&, const Options&);
template std::unique_ptr<Adapter> create_guarded(const PluginRegistry&, const LoadedPlugin&, const Options&);
template std::unique_ptr<Collator> create_guarded(const PluginRegistry&, const LoadedPlugin&, const Options&);
template std::unique_ptr<Placement> create_guarded(const PluginRegistry&, const LoadedPlugin&, const Options&);
template std::unique_ptr<Objective> create_guarded(const PluginRegistry&, const LoadedPlugin&, const Options&);
template std::unique_ptr<Reward> create_guarded(const PluginRegistry&, const LoadedPlugin&, const Options&);

}  // namespace loom::core
