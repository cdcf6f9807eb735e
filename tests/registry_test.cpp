#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "loom/adapter.hpp"
#include "loom/collator.hpp"
#include "loom/error.hpp"
#include "loom/kit/version.hpp"
#include "loom/model.hpp"
#include "loom/tokenizer.hpp"
#include "loom/version.hpp"
#include "plugins/plugin_guard.hpp"
#include "plugins/plugin_registry.hpp"
#include "test_support.hpp"

namespace loom::core {
namespace {
namespace fs = std::filesystem;
using test::contains;
using test::test_plugin_dir;

// Loads one test case's folder and returns the only refusal it produced.
std::string refusal_for(const std::string& test_case) {
  PluginRegistry registry;
  registry.scan_directory(test_plugin_dir(test_case), true);
  EXPECT_EQ(registry.refusals().size(), 1u) << test_case;
  EXPECT_TRUE(registry.plugins().empty()) << test_case;
  return registry.refusals().empty() ? "" : registry.refusals().front().str();
}

TEST(Registry, LoadsBuiltinPlugins) {
  PluginRegistry registry;
  registry.scan_directory(test::builtin_plugin_dir(), true);
  EXPECT_TRUE(registry.refusals().empty());
  ASSERT_NE(registry.find("model", "llama"), nullptr);
  ASSERT_NE(registry.find("tokenizer", "bytes"), nullptr);
  ASSERT_NE(registry.find("placement", "single"), nullptr);
  const auto* bytes = registry.find("tokenizer", "bytes");
  EXPECT_EQ(bytes->sdk.major, LOOM_SDK_VERSION_MAJOR);
  // Tokenizers get the common options from the SDK.
  std::vector<std::string> names;
  for (const auto& o : bytes->schema) names.push_back(o.name);
  EXPECT_EQ(names, (std::vector<std::string>{"add_bos", "add_eos", "padding_side", "pad_token"}));
}

// Commands find a plugin by the option it declares, never by a name core holds: `loom tokenize`'s
// reader of a path, `loom plan --freeze`'s placement taking a block map.
TEST(Registry, FindsPluginsByTheOptionTheyDeclare) {
  PluginRegistry registry;
  registry.scan_directory(test::builtin_plugin_dir(), true);
  const auto names = [](const std::vector<const LoadedPlugin*>& plugins) {
    std::vector<std::string> out;
    for (const auto* p : plugins) out.push_back(p->name);
    return out;
  };
  EXPECT_EQ(names(registry.declaring(kKindTokenizer, "path", kString)), std::vector<std::string>{"hf-json"});
  EXPECT_EQ(names(registry.declaring(kKindPlacement, "map", kStringMap)), std::vector<std::string>{"manual"});
  EXPECT_TRUE(registry.declaring(kKindPlacement, "map", kString).empty());  // the types must match too
  EXPECT_TRUE(registry.declaring(kKindModel, "map", kStringMap).empty());
}

TEST(Registry, RefusesJunkFile) {
  const fs::path dir = test::temp_dir();
  test::write_file(dir / "junk.so", "this is not an ELF file\n");
  PluginRegistry registry;
  registry.scan_directory(dir, true);
  ASSERT_EQ(registry.refusals().size(), 1u);
  const std::string msg = registry.refusals()[0].str();
  EXPECT_NE(msg.find((dir / "junk.so").string() + ": refused: not a loadable shared library"), std::string::npos) << msg;
}

TEST(Registry, RefusesLibraryWithoutDescriptor) {
  const std::string msg = refusal_for("no_descriptor");
  EXPECT_NE(msg.find("no_descriptor.so: refused: no loom plugin descriptor (symbol 'loom_plugin_descriptor' not found)"), std::string::npos) << msg;
}

TEST(Registry, RefusesSdkMajorMismatch) {
  const std::string msg = refusal_for("sdk_major");
  const std::string minor = std::to_string(LOOM_SDK_VERSION_MINOR), major = std::to_string(LOOM_SDK_VERSION_MAJOR);
  EXPECT_NE(msg.find("built against loom SDK 1." + minor + ", this loom provides SDK " + major + "." + minor +
                     " (major versions differ); rebuild the plugin against SDK " + major + ".x"),
            std::string::npos) << msg;
}

TEST(Registry, RefusesNewerSdkMinor) {
  const std::string msg = refusal_for("sdk_minor_newer");
  const std::string major = std::to_string(LOOM_SDK_VERSION_MAJOR), ours = major + "." + std::to_string(LOOM_SDK_VERSION_MINOR);
  const std::string ahead = major + "." + std::to_string(LOOM_SDK_VERSION_MINOR + 1);
  EXPECT_NE(msg.find("built against loom SDK " + ahead + ", newer than this loom's SDK " + ours + "; upgrade loom or rebuild the plugin against SDK " + ours),
            std::string::npos) << msg;
}

// A plugin records the kit it was built against (SDK 3.13): one older than the kit's layout minor
// would run against grown structs, one newer would miss what it calls; each refused naming both.
TEST(Registry, RefusesAKitItsLayoutsDoNotMatch) {
  const std::string major = std::to_string(LOOM_KIT_VERSION_MAJOR), ours = major + "." + std::to_string(LOOM_KIT_VERSION_MINOR);
  const std::string previous = refusal_for("kit_previous_major");
  EXPECT_NE(previous.find("built against loom kit " + std::to_string(LOOM_KIT_VERSION_MAJOR - 1) + ".8, this loom's kit is " + ours +
                          " (major versions differ); rebuild the plugin against kit " + major + ".x"),
            std::string::npos)
      << previous;
#if LOOM_KIT_LAYOUT_MINOR > 0  // a minor older than the last layout change exists only once a minor changed one
  const std::string older = refusal_for("kit_older");
  EXPECT_NE(older.find("test_plugin_kit_older.so: refused: built against loom kit " + major + "." + std::to_string(LOOM_KIT_LAYOUT_MINOR - 1) +
                       ", whose layouts kit " + major + "." + std::to_string(LOOM_KIT_LAYOUT_MINOR) + " changed (loom/kit/version.hpp); this loom's kit is " +
                       ours + ": rebuild the plugin against it"),
            std::string::npos)
      << older;
#endif
  const std::string newer = refusal_for("kit_newer");
  EXPECT_NE(newer.find("built against loom kit " + major + ".99, newer than this loom's kit " + ours + "; upgrade loom or rebuild the plugin against kit " + ours),
            std::string::npos)
      << newer;
  // Every built-in plugin records the kit it links (and a plugin without the kit records none).
  PluginRegistry registry;
  registry.scan_directory(test::builtin_plugin_dir(), true);
  EXPECT_TRUE(registry.refusals().empty());
  EXPECT_EQ(kit::kit_version().str(), ours + ".0");
}

TEST(Registry, RefusesTorchMismatch) {
  const std::string msg = refusal_for("torch_mismatch");
  const auto host = host_torch_version();
  EXPECT_NE(msg.find("built against LibTorch 9." + std::to_string(host.minor)), std::string::npos) << msg;
  EXPECT_NE(msg.find("this loom runs LibTorch " + host.str() + "; rebuild the plugin against LibTorch " + std::to_string(host.major) + "." +
                     std::to_string(host.minor)),
            std::string::npos) << msg;
}

TEST(Registry, RefusesTheOtherCxxAbi) {
  const std::string msg = refusal_for("other_abi");
  EXPECT_NE(msg.find("test_plugin_other_abi.so: refused: built with _GLIBCXX_USE_CXX11_ABI=0, this loom with _GLIBCXX_USE_CXX11_ABI=1 (its "
                     "LibTorch's); rebuild the plugin with _GLIBCXX_USE_CXX11_ABI=1"),
            std::string::npos)
      << msg;
}

// A descriptor that does not record its C++ ABI (one not made by LOOM_PLUGIN) cannot be checked, so
// it is refused.
TEST(Registry, RefusesADescriptorWithoutItsCxxAbi) {
  const std::string msg = refusal_for("no_flags");
  EXPECT_NE(msg.find("test_plugin_no_flags.so: refused: its descriptor does not record the C++ library ABI it was built with (one not made by "
                     "LOOM_PLUGIN); declare the plugin with LOOM_PLUGIN"),
            std::string::npos)
      << msg;
}

// The contract's headers (sdk/include/loom), by name, with their text.
std::vector<std::pair<std::string, std::string>> contract_headers() {
  std::vector<std::filesystem::path> paths;
  for (const auto& entry : std::filesystem::directory_iterator(test::source_dir() / "sdk/include/loom")) paths.push_back(entry.path());
  std::sort(paths.begin(), paths.end());
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& path : paths) out.emplace_back(path.filename().string(), test::read_file(path));
  return out;
}

// The classes of the contract's headers: name, bases and the virtuals each declares (destructors
// aside), in order.
struct ContractClass {
  std::string header, name, bases;
  std::vector<std::string> virtuals;
};
std::vector<ContractClass> contract_classes() {
  std::vector<ContractClass> out;
  const std::regex head(R"(class LOOM_API (\w+)(?: final)?(?:\s*:\s*([^{]+?))?\s*\{)");
  const std::regex virtual_call(R"(virtual\s+[^;{(]*?\b(\w+)\s*\()");
  for (const auto& [header, text] : contract_headers()) {
    for (auto it = std::sregex_iterator(text.begin(), text.end(), head); it != std::sregex_iterator(); ++it) {
      ContractClass c{header, (*it)[1], (*it)[2], {}};
      const auto from = static_cast<std::size_t>(it->position(0) + it->length(0));
      const std::string body = text.substr(from, text.find("\n};", from) - from);
      for (auto v = std::sregex_iterator(body.begin(), body.end(), virtual_call); v != std::sregex_iterator(); ++v)
        if (body[static_cast<std::size_t>(v->position(1)) - 1] != '~') c.virtuals.push_back((*v)[1]);
      out.push_back(std::move(c));
    }
  }
  return out;
}

// SDK 3's rule (loom/capability.hpp): a class of the contract never gains, loses or reorders a
// virtual within the major, since every 3.x plugin's vtable was laid out by 3.0's headers. What a
// minor adds is a new class: a capability, or the interface of a new kind.
TEST(Registry, ContractClassesKeepTheirVirtualsWithinTheMajor) {
  ASSERT_EQ(LOOM_SDK_VERSION_MAJOR, 3) << "a new major: write its classes' virtuals below";
  const std::map<std::string, std::vector<std::string>> sdk_3_0{
      {"Adapter", {"trainable_parameters", "attach", "load", "saved_tensors", "write", "merge", "shard_dim"}},
      {"BaseStoringAdapter", {"base_weight", "base_storage"}},
      {"Capability", {}},
      {"Collator", {"collate", "split_for_generation"}},
      {"Work", {"wait"}},
      {"CommunicationError", {}},
      {"Communicator", {"rank", "size", "all_reduce", "broadcast", "all_gather", "reduce_scatter", "send", "recv", "barrier"}},
      {"Parallel", {"mesh", "rank", "world", "data", "pipeline", "tensor"}},
      {"UserError", {}},
      {"LinearAdapter", {"delta"}},
      {"LinearWeight", {"forward", "dense", "add_", "stored", "options", "bytes", "shard", "assign", "finish_load"}},
      {"DenseWeight", {}},
      {"AdaptableLinear", {}},
      {"LoadedModel", {"block_count", "forward", "loss_sum", "logits", "parameters", "linears", "set_training", "save_pretrained", "shard_dim"}},
      {"Model", {"structure", "load"}},
      {"TensorParallelModel", {"tensor_parallel"}},
      {"Options", {}},
      {"Placement", {"plan"}},
      {"Plugin", {}},
      {"Tokenizer", {"encode", "decode", "vocab_size", "special_tokens", "pad_left"}},
  };
  std::set<std::string> seen;
  for (const auto& c : contract_classes()) {
    seen.insert(c.name);
    const auto frozen = sdk_3_0.find(c.name);
    if (frozen == sdk_3_0.end()) {
      EXPECT_TRUE(c.bases == "public Capability" || c.bases == "public Plugin")
          << c.header << ": " << c.name << " is new since 3.0: it may be a capability (deriving from Capability) or a new kind's interface (from Plugin)";
      continue;
    }
    EXPECT_EQ(c.virtuals, frozen->second) << c.header << ": " << c.name
                                          << "'s virtuals changed within SDK 3; add a capability class instead (loom/capability.hpp)";
  }
  for (const auto& [name, virtuals] : sdk_3_0) EXPECT_TRUE(seen.count(name)) << name << " left the contract within SDK 3";
}

// The layouts of the contract's (and the kit's) structs, classes and enums are held by abidiff to
// every recorded minor of the major (scripts/check-abi.sh, the CTest test abi_check; SDK 3.0's
// layouts among them, abi/types-sdk-3.0-*), through the ABI probe, which must include every public
// header: a header left out would go unchecked.
TEST(Registry, AbiProbeIncludesEveryPublicHeader) {
  const std::string probe = test::read_file(test::source_dir() / "abi/probe.cpp");
  for (const auto& [folder, prefix] : {std::pair{"sdk/include/loom", "loom/"}, std::pair{"kit/include/loom/kit", "loom/kit/"}})
    for (const auto& entry : std::filesystem::directory_iterator(test::source_dir() / folder)) {
      if (entry.path().extension() != ".hpp") continue;
      EXPECT_TRUE(test::contains(probe, "#include \"" + std::string(prefix) + entry.path().filename().string() + "\""))
          << "abi/probe.cpp does not include " << entry.path();
    }
}

// Every virtual of every plugin interface and capability has a guard that forwards it through
// guarded() (a virtual with a default and no guard would silently answer for the plugin); a
// capability's forwarder reaches the plugin's object as that capability (offered<C>).
TEST(Registry, GuardsForwardEveryVirtualAndCapability) {
  const std::string guards = test::read_file(test::source_dir() / "core/src/plugins/plugin_guard.cpp");
  // The guard class whose declaration starts with `head`, to the "};" that closes it.
  const auto guard_of = [&](const std::string& head) {
    const auto at = guards.find("class " + head);
    return at == std::string::npos ? std::string() : guards.substr(at, guards.find("\n};", at) - at);
  };
  const std::set<std::string> kinds{"LoadedModel", "Model", "Tokenizer", "Adapter", "Collator", "Placement"};
  // Capabilities of a layer's parts (a LinearAdapter, a LinearWeight): the model's forward calls
  // those parts directly, as it calls delta() and forward(), never through a guard.
  const std::set<std::string> of_layer_parts{"DeltaAddedInPlace", "WholeProduct", "FoldableDelta"};
  // Capabilities of the host's own objects (a Communicator, the Parallel): plugins call them, never the reverse.
  const std::set<std::string> of_host_objects{"AllToAll", "ExpertParallel"};
  int checked = 0, capabilities = 0;
  for (const auto& c : contract_classes()) {
    const bool capability = c.bases == "public Capability";
    if (!kinds.count(c.name) && !capability) continue;
    if (of_layer_parts.count(c.name) || of_host_objects.count(c.name)) continue;
    // A kind's guard is Guarded<Kind>; a capability's is the guard that derives from it.
    std::string guard = guard_of("Guarded" + c.name + " final");
    if (capability) {
      const std::regex derives(R"(class (Guarded\w+) final : [^{]*\bpublic )" + c.name + R"(\b)");
      std::smatch m;
      ASSERT_TRUE(std::regex_search(guards, m, derives)) << "no guard in core/src/plugins/plugin_guard.cpp derives from capability " << c.name;
      guard = guard_of(std::string(m[1]) + " final");
      ++capabilities;
    }
    ASSERT_FALSE(guard.empty()) << "no guard of " << c.name << " in core/src/plugins/plugin_guard.cpp";
    for (const auto& call : c.virtuals) {
      const auto at = guard.find(" " + call + "(");
      ASSERT_NE(at, std::string::npos) << "the guard of " << c.name << " does not forward " << call << "()";
      const auto next = guard.find("override", guard.find("override", at) + 8);
      const std::string forwarder = guard.substr(at, next == std::string::npos ? std::string::npos : next - at);
      EXPECT_TRUE(contains(forwarder, "guarded(plugin_, \"" + call + "\"")) << c.name << "::" << call << " does not call guarded()";
      if (capability) {
        EXPECT_TRUE(contains(forwarder, "offered<" + c.name + ">(*inner_)." + call + "("))
            << c.name << "::" << call << ": the guard must reach the plugin's object as the capability";
      }
      ++checked;
    }
  }
  EXPECT_GE(checked, 27);      // what the six interfaces and two capabilities declare at 3.0
  EXPECT_GE(capabilities, 2);  // TensorParallelModel, BaseStoringAdapter
}

// An adapter of the 3.0 interface alone, as a plugin built before a capability existed is: the
// host finds no capability in it and goes on without; one that offers it is asked through its
// guard, which reports a failure as the plugin's.
class JustAnAdapter : public Adapter {
 public:
  std::vector<std::uint64_t> trainable_parameters(const ModelStructure&) const override { return {}; }
  std::vector<NamedParameter> attach(LoadedModel&, std::uint64_t) override { return {}; }
  std::vector<NamedParameter> load(LoadedModel&, const std::filesystem::path&) override { return {}; }
  std::vector<std::pair<std::string, at::Tensor>> saved_tensors(LoadedModel&) const override { return {}; }
  void write(const std::vector<std::pair<std::string, at::Tensor>>&, const std::filesystem::path&) const override {}
  void merge(LoadedModel&) override {}
};
class StoresTheBase final : public JustAnAdapter, public BaseStoringAdapter {
 public:
  std::shared_ptr<LinearWeight> base_weight(const LinearInfo&, const at::TensorOptions&) const override { throw std::out_of_range("bad index"); }
  BaseStorage base_storage(const ModelStructure&, DType) const override { return {{}, 7}; }
};

TEST(Registry, CapabilitiesAreFoundOnlyWhereThePluginOffersThem) {
  LoadedPlugin plugin;
  plugin.kind = kKindAdapter;
  plugin.name = "capable";
  plugin.version = "0.1.0";
  plugin.sdk = Version{3, 0, 0};
  PluginRegistry registry;
  plugin.create = [](const Options&) -> std::unique_ptr<Plugin> { return std::make_unique<JustAnAdapter>(); };
  const auto plain = create_guarded<Adapter>(registry, plugin, Options{});
  EXPECT_EQ(capability<BaseStoringAdapter>(*plain), nullptr);  // the guard derives from it; the plugin's object does not
  EXPECT_NE(dynamic_cast<const BaseStoringAdapter*>(plain.get()), nullptr);

  plugin.create = [](const Options&) -> std::unique_ptr<Plugin> { return std::make_unique<StoresTheBase>(); };
  const auto storing = create_guarded<Adapter>(registry, plugin, Options{});
  const auto* offered = capability<BaseStoringAdapter>(*storing);
  ASSERT_NE(offered, nullptr);
  EXPECT_EQ(offered->base_storage(ModelStructure{}, DType::kFloat32).transient_bytes, 7u);
  try {
    offered->base_weight(LinearInfo{}, at::TensorOptions());
    ADD_FAILURE() << "no fault";
  } catch (const PluginFault& e) {
    EXPECT_TRUE(contains(e.what(), "adapter plugin 'capable' 0.1.0 () failed in base_weight(): bad index")) << e.what();
  }
  // An object the host made itself, not a plugin's: asked directly.
  const StoresTheBase own;
  EXPECT_EQ(capability<BaseStoringAdapter>(static_cast<const Adapter&>(own)), static_cast<const BaseStoringAdapter*>(&own));
}

// A model plugin of the contract alone, whose descriptor says the major's first minor: the host of
// any later minor lists it, plans it, trains it with the kit's LoRA on its linear, generates with
// it, and refuses a tensor mesh in one line, as the model offers no TensorParallelModel, and
// packing, as it offers no PackedSequences.
TEST(Registry, APluginOfTheMajorsFirstMinorTrainsWithoutCapabilities) {
  const std::map<std::string, std::string> env{{"LOOM_PLUGIN_PATH", test::test_plugin_dir("contract_model").string()}};
  const auto listed = test::run_loom({"plugins"}, env);
  ASSERT_EQ(listed.exit_code, 0) << listed.err;
  EXPECT_TRUE(std::regex_search(listed.out, std::regex("\\ncontract-model +model +0\\.1\\.0 +" + std::to_string(LOOM_SDK_VERSION_MAJOR) + "\\.0 ")))
      << listed.out;

  const fs::path dir = test::temp_dir();
  std::string pipeline = test::copy_task(dir);
  pipeline.replace(0, pipeline.find("[tokenizer]"), "[model]\nplugin = \"contract-model\"\n");
  test::write_file(dir / "p.toml", "[run]\nseed = 3\n" + pipeline + R"([adapter]
plugin = "lora"
r = 4
target_modules = ["up_proj"]
modules_to_save = ["embed_tokens", "lm_head"]
[train]
batch_size = 8
lr = 5e-2
log_every = 1
eval_samples = 4
max_new_tokens = 4
threads = 1
max_steps = 30
)");
  const auto run = test::run_loom({"run", (dir / "p.toml").string(), "--output", (dir / "out").string()}, env);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const auto rows = test::metrics_rows(dir / "out/metrics.jsonl", true);
  ASSERT_GE(rows.size(), 30u);
  EXPECT_LT(rows[29]["loss"].get<double>(), rows[0]["loss"].get<double>() * 0.8) << "loss did not fall";
  EXPECT_TRUE(std::filesystem::exists(dir / "out/adapter/adapter_model.safetensors"));
  EXPECT_TRUE(contains(run.out, "held-out exact-match: ")) << run.out;

  const auto tensor = test::run_loom({"plan", (dir / "p.toml").string(), "--devices", "cuda:0=16GiB,cuda:1=16GiB,cpu=64GiB", "--nproc-per-node",
                                      "2", "--set", "parallel.tensor=2"},
                                     env);
  EXPECT_EQ(tensor.exit_code, 2);
  EXPECT_TRUE(contains(tensor.err, "[parallel] tensor = 2: model plugin 'contract-model' does not split over tensor ranks: it neither splits "
                                   "itself (it offers no TensorParallelModel) nor declares how its linears split; use data or pipeline parallelism"))
      << tensor.err;
  // Packing needs a model that attends within each packed sample (PackedSequences, SDK 3.3).
  const auto packed = test::run_loom({"validate", (dir / "p.toml").string(), "--set", "data.packing=true"}, env);
  EXPECT_NE(packed.exit_code, 0);
  EXPECT_TRUE(contains(packed.err, "[data] packing = true: model plugin 'contract-model' does not attend within packed samples (it lacks "
                                   "PackedSequences, SDK 3.3); set packing = false"))
      << packed.err;
}

TEST(Registry, RefusesUnknownKind) {
  const std::string msg = refusal_for("unknown_kind");
  EXPECT_NE(msg.find("declares kind 'optimizer', which this loom does not know (known: model, tokenizer, adapter, collator, placement, objective, reward)"),
            std::string::npos) << msg;
}

TEST(Registry, RefusesReservedOptionName) {
  const std::string msg = refusal_for("reserved_option");
  EXPECT_NE(msg.find("declares an invalid option 'plugin'"), std::string::npos) << msg;
}

TEST(Registry, RefusesDuplicateKindAndName) {
  PluginRegistry registry;
  registry.scan_directory(test_plugin_dir("duplicate"), true);
  ASSERT_EQ(registry.plugins().size(), 1u);
  ASSERT_EQ(registry.refusals().size(), 1u);
  const std::string msg = registry.refusals()[0].str();
  EXPECT_NE(msg.find("test_plugin_duplicate_b.so: refused: duplicate collator plugin 'echo': already loaded from "), std::string::npos) << msg;
  EXPECT_NE(msg.find("test_plugin_duplicate_a.so; remove one of them from the plugin path"), std::string::npos) << msg;
}

// A factory failing with anything but UserError is the plugin's bug: a PluginFault naming the
// plugin, its version and file, never a user error carrying the library's text.
TEST(Registry, FactoryExceptionIsAPluginFault) {
  PluginRegistry registry;
  registry.scan_directory(test_plugin_dir("factory_throws"), true);
  const auto* p = registry.find("collator", "thrower");
  ASSERT_NE(p, nullptr);
  Options options;
  options.set("mask_prompt", false);
  try {
    registry.create(*p, options);
    FAIL() << "factory exception escaped";
  } catch (const UserError& e) {
    FAIL() << "reported as the user's error: " << e.what();
  } catch (const PluginFault& e) {
    EXPECT_EQ(std::string(e.what()), "collator plugin 'thrower' 9.9.9 (" + (test_plugin_dir("factory_throws") / "test_plugin_factory_throws.so").string() +
                                         ") failed in its factory: cannot open /dev/gpu-that-does-not-exist");
  }
}

// Every call into a plugin object the host holds is guarded the same way; a UserError passes as is.
TEST(Registry, PluginCallExceptionIsAPluginFault) {
  PluginRegistry registry;
  registry.scan_directory(test::builtin_plugin_dir(), true);
  registry.scan_directory(test_plugin_dir("collate_throws"), true);
  Options c;
  c.set("mask_prompt", false);
  const auto collator = create_guarded<Collator>(registry, *registry.find("collator", "collate-thrower"), c);
  Options t;
  t.set("add_bos", false);
  t.set("add_eos", false);
  t.set("padding_side", std::string("right"));
  t.set("pad_token", std::string("pad"));
  const auto tokenizer = create_guarded<Tokenizer>(registry, *registry.find("tokenizer", "bytes"), t);
  try {
    collator->collate({"a"}, *tokenizer, CollateSettings{16, Truncation::kRight});
    FAIL() << "collate did not throw";
  } catch (const PluginFault& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("collator plugin 'collate-thrower' 9.9.9 (", 0), 0u) << msg;
    EXPECT_NE(msg.find(") failed in collate(): vector::_M_range_check: __n (which is 7)"), std::string::npos) << msg;
  }
  EXPECT_THROW(tokenizer->decode({-5}, false), UserError);  // the bytes tokenizer refuses an id; still the user's error
}

TEST(Registry, MissingFolderOnExplicitPathIsAnError) {
  PluginRegistry registry;
  EXPECT_THROW(registry.scan_directory("/nonexistent/loom/plugins", true), UserError);
  EXPECT_NO_THROW(registry.scan_directory("/nonexistent/loom/plugins2", false));
}

// A collator from a hidden-visibility plugin works through the SDK interface with a tokenizer
// from another plugin, and keeps working after the registry that loaded both is gone.
TEST(Registry, ObjectsOutliveRegistryAndCastAcrossLibraries) {
  std::unique_ptr<Plugin> collator_object, tokenizer_object;
  {
    PluginRegistry registry;
    registry.scan_directory(test::builtin_plugin_dir(), true);
    registry.scan_directory(test_plugin_dir("good"), true);
    Options c;
    c.set("mask_prompt", true);
    collator_object = registry.create(*registry.find("collator", "echo"), c);
    Options t;
    t.set("add_bos", false);
    t.set("add_eos", true);
    t.set("padding_side", std::string("left"));
    t.set("pad_token", std::string("pad"));
    tokenizer_object = registry.create(*registry.find("tokenizer", "bytes"), t);
  }
  auto* collator = dynamic_cast<Collator*>(collator_object.get());
  auto* tokenizer = dynamic_cast<Tokenizer*>(tokenizer_object.get());
  ASSERT_NE(collator, nullptr);
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(dynamic_cast<Model*>(collator_object.get()), nullptr);
  const Batch b = collator->collate({"a b", "xy"}, *tokenizer, CollateSettings{16, Truncation::kRight});
  ASSERT_EQ(b.rows, 2);
  ASSERT_EQ(b.cols, 4);  // "a b" + EOS
  EXPECT_EQ(b.input_ids, (std::vector<std::int64_t>{'a', ' ', 'b', 257, 258, 'x', 'y', 257}));
  EXPECT_EQ(b.attention_mask, (std::vector<std::int64_t>{1, 1, 1, 1, 0, 1, 1, 1}));
  EXPECT_EQ(b.labels, (std::vector<std::int64_t>{-100, -100, 'b', 257, -100, -100, -100, -100}));
}

}  // namespace
}  // namespace loom::core
