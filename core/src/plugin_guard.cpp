#include "plugin_guard.hpp"

#include "loom/tensor_parallel.hpp"

namespace loom::core {
namespace {

// Each wrapper owns the plugin's object and forwards every call through guarded(); the host only
// ever holds these, so no call into a plugin goes unguarded.

// Whether the plugin was built at SDK minor `minor` or later. A virtual that minor appended lies
// past the end of an older plugin's vtable, so for such a plugin the guard answers with the SDK's
// default instead of calling it (every virtual marked "SDK 2.N" in the headers: Registry's
// GuardsForwardEveryVirtualFromItsMinor checks each guard against them).
bool since(const LoadedPlugin& plugin, int minor) { return plugin.sdk.minor >= minor; }

class GuardedLoadedModel final : public LoadedModel {
 public:
  GuardedLoadedModel(std::unique_ptr<LoadedModel> inner, const LoadedPlugin& plugin) : inner_(std::move(inner)), plugin_(plugin) {}
  std::size_t block_count() const override { return guarded(plugin_, "block_count", [&] { return inner_->block_count(); }); }
  void forward(std::size_t index, ForwardState& state) override {
    guarded(plugin_, "forward", [&] { inner_->forward(index, state); });
  }
  at::Tensor loss_sum(const at::Tensor& head_output, const at::Tensor& labels) override {
    return guarded(plugin_, "loss_sum", [&] { return inner_->loss_sum(head_output, labels); });
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
    if (!since(plugin_, 1)) return LoadedModel::shard_dim(name);
    return guarded(plugin_, "shard_dim", [&] { return inner_->shard_dim(name); });
  }

 private:
  std::unique_ptr<LoadedModel> inner_;
  const LoadedPlugin& plugin_;
};

class GuardedModel final : public Model {
 public:
  GuardedModel(std::unique_ptr<Model> inner, const LoadedPlugin& plugin) : inner_(std::move(inner)), plugin_(plugin) {}
  ModelStructure structure() const override { return guarded(plugin_, "structure", [&] { return inner_->structure(); }); }
  std::unique_ptr<LoadedModel> load(const LoadRequest& request) const override {
    auto loaded = guarded(plugin_, "load", [&] { return inner_->load(request); });
    if (!loaded) throw PluginFault(plugin_, "load", "it returned no model");
    return std::make_unique<GuardedLoadedModel>(std::move(loaded), plugin_);
  }
  TensorParallelSupport tensor_parallel(int tensor) const override {
    if (!since(plugin_, 1)) return Model::tensor_parallel(tensor);
    return guarded(plugin_, "tensor_parallel", [&] { return inner_->tensor_parallel(tensor); });
  }

 private:
  std::unique_ptr<Model> inner_;
  const LoadedPlugin& plugin_;
};

class GuardedTokenizer final : public Tokenizer {
 public:
  GuardedTokenizer(std::unique_ptr<Tokenizer> inner, const LoadedPlugin& plugin) : inner_(std::move(inner)), plugin_(plugin) {}
  Encoding encode(std::string_view text, Specials specials) const override {
    return guarded(plugin_, "encode", [&] { return inner_->encode(text, specials); });
  }
  std::string decode(const std::vector<std::int64_t>& ids, bool skip_special) const override {
    return guarded(plugin_, "decode", [&] { return inner_->decode(ids, skip_special); });
  }
  std::int64_t vocab_size() const override { return guarded(plugin_, "vocab_size", [&] { return inner_->vocab_size(); }); }
  SpecialTokens special_tokens() const override { return guarded(plugin_, "special_tokens", [&] { return inner_->special_tokens(); }); }
  bool pad_left() const override { return guarded(plugin_, "pad_left", [&] { return inner_->pad_left(); }); }

 private:
  std::unique_ptr<Tokenizer> inner_;
  const LoadedPlugin& plugin_;
};

class GuardedAdapter final : public Adapter {
 public:
  GuardedAdapter(std::unique_ptr<Adapter> inner, const LoadedPlugin& plugin) : inner_(std::move(inner)), plugin_(plugin) {}
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
    if (!since(plugin_, 1)) return Adapter::shard_dim(model, name);
    return guarded(plugin_, "shard_dim", [&] { return inner_->shard_dim(model, name); });
  }
  std::shared_ptr<LinearWeight> base_weight(const LinearInfo& linear, const at::TensorOptions& options) const override {
    if (!since(plugin_, 1)) return Adapter::base_weight(linear, options);
    return guarded(plugin_, "base_weight", [&] { return inner_->base_weight(linear, options); });
  }
  BaseStorage base_storage(const ModelStructure& model, DType dtype) const override {
    if (!since(plugin_, 1)) return Adapter::base_storage(model, dtype);
    return guarded(plugin_, "base_storage", [&] { return inner_->base_storage(model, dtype); });
  }

 private:
  std::unique_ptr<Adapter> inner_;
  const LoadedPlugin& plugin_;
};

class GuardedCollator final : public Collator {
 public:
  GuardedCollator(std::unique_ptr<Collator> inner, const LoadedPlugin& plugin) : inner_(std::move(inner)), plugin_(plugin) {}
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

class GuardedPlacement final : public Placement {
 public:
  GuardedPlacement(std::unique_ptr<Placement> inner, const LoadedPlugin& plugin) : inner_(std::move(inner)), plugin_(plugin) {}
  Plan plan(const PlacementRequest& request) const override { return guarded(plugin_, "plan", [&] { return inner_->plan(request); }); }

 private:
  std::unique_ptr<Placement> inner_;
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

}  // namespace

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

}  // namespace loom::core
