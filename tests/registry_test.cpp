#include <gtest/gtest.h>

#include <regex>

#include "loom/adapter.hpp"
#include "loom/collator.hpp"
#include "loom/error.hpp"
#include "loom/model.hpp"
#include "loom/tokenizer.hpp"
#include "loom/version.hpp"
#include "plugin_guard.hpp"
#include "plugin_registry.hpp"
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
  const std::string minor = std::to_string(LOOM_SDK_VERSION_MINOR);
  EXPECT_NE(msg.find("built against loom SDK 1." + minor + ", this loom provides SDK 2." + minor + " (major versions differ); rebuild the plugin against SDK 2.x"),
            std::string::npos) << msg;
}

TEST(Registry, RefusesNewerSdkMinor) {
  const std::string msg = refusal_for("sdk_minor_newer");
  const std::string ours = "2." + std::to_string(LOOM_SDK_VERSION_MINOR);
  EXPECT_NE(msg.find("built against loom SDK 2.7, newer than this loom's SDK " + ours + "; upgrade loom or rebuild the plugin against SDK " + ours),
            std::string::npos) << msg;
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

// Every virtual of every plugin interface has a guard that forwards it (a virtual with a default
// and no guard would silently answer for the plugin), and one a minor appended ("SDK 2.N" in its
// comment) is forwarded only to plugins built at 2.N or later.
TEST(Registry, GuardsForwardEveryVirtualFromItsMinor) {
  const auto text_of = [](const std::string& file) { return test::read_file(test::source_dir() / file); };
  const std::string guards = text_of("core/src/plugin_guard.cpp");
  // The text from "class <head>" to the "};" that closes it.
  const auto body = [](const std::string& text, const std::string& head) {
    const auto at = text.find("class " + head);
    if (at == std::string::npos) return std::string();
    return text.substr(at, text.find("\n};", at) - at);
  };
  const std::vector<std::pair<std::string, std::string>> interfaces{{"model.hpp", "LoadedModel"}, {"model.hpp", "Model"},
                                                                    {"tokenizer.hpp", "Tokenizer"}, {"adapter.hpp", "Adapter"},
                                                                    {"collator.hpp", "Collator"}, {"placement.hpp", "Placement"}};
  const std::regex virtual_call(R"(virtual\s+[^;{(]*?\b(\w+)\s*\()");
  const std::regex appended(R"(SDK 2\.(\d+))");
  int checked = 0;
  for (const auto& [header, name] : interfaces) {
    const std::string declared = body(text_of("sdk/include/loom/" + header), "LOOM_API " + name + " ");
    ASSERT_FALSE(declared.empty()) << name << " not found in " << header;
    const std::string guard = body(guards, "Guarded" + name + " final");
    ASSERT_FALSE(guard.empty()) << "no Guarded" << name << " in core/src/plugin_guard.cpp";
    std::size_t previous_end = 0;
    for (auto it = std::sregex_iterator(declared.begin(), declared.end(), virtual_call); it != std::sregex_iterator(); ++it) {
      const std::string call = (*it)[1];
      // The comment above the declaration: back to the previous declaration's end.
      const auto start = static_cast<std::size_t>(it->position(0));
      const std::string comment = declared.substr(previous_end, start - previous_end);
      previous_end = declared.find(';', start) + 1;
      if (declared[static_cast<std::size_t>(it->position(1)) - 1] == '~') continue;  // the destructor
      std::smatch minor;
      const int since = std::regex_search(comment, minor, appended) ? std::stoi(minor[1]) : 0;
      const auto at = guard.find(" " + call + "(");
      ASSERT_NE(at, std::string::npos) << "Guarded" << name << " does not forward " << call << "()";
      const auto next = guard.find("override", guard.find("override", at) + 8);
      const std::string forwarder = guard.substr(at, next == std::string::npos ? std::string::npos : next - at);
      EXPECT_TRUE(contains(forwarder, "guarded(plugin_, \"" + call + "\"")) << "Guarded" << name << "::" << call << " does not call guarded()";
      if (since > 0)
        EXPECT_TRUE(contains(forwarder, "since(plugin_, " + std::to_string(since) + ")"))
            << name << "::" << call << " came in SDK 2." << since << ", but its guard calls it on older plugins too";
      else
        EXPECT_FALSE(contains(forwarder, "since(plugin_")) << name << "::" << call;
      ++checked;
    }
  }
  EXPECT_GE(checked, 24);  // what the six interfaces declare today
}

// The calls a minor appended are not made on a plugin built before it (they would read past its
// vtable); the guard answers with the SDK's default.
class AnswersEverything final : public Adapter {
 public:
  std::vector<std::uint64_t> trainable_parameters(const ModelStructure&) const override { return {}; }
  std::vector<NamedParameter> attach(LoadedModel&, std::uint64_t) override { return {}; }
  std::vector<NamedParameter> load(LoadedModel&, const std::filesystem::path&) override { return {}; }
  std::vector<std::pair<std::string, at::Tensor>> saved_tensors(LoadedModel&) const override { return {}; }
  void write(const std::vector<std::pair<std::string, at::Tensor>>&, const std::filesystem::path&) const override {}
  void merge(LoadedModel&) override {}
  BaseStorage base_storage(const ModelStructure&, DType) const override { return {{}, 7}; }
};

TEST(Registry, OlderMinorsAreNotAskedWhatCameLater) {
  LoadedPlugin plugin;
  plugin.kind = kKindAdapter;
  plugin.name = "answers-everything";
  plugin.create = [](const Options&) -> std::unique_ptr<Plugin> { return std::make_unique<AnswersEverything>(); };
  PluginRegistry registry;
  for (const std::uint16_t minor : {0, 1}) {
    plugin.sdk = Version{2, minor, 0};
    const auto adapter = create_guarded<Adapter>(registry, plugin, Options{});
    EXPECT_EQ(adapter->base_storage(ModelStructure{}, DType::kFloat32).transient_bytes, minor == 0 ? 0u : 7u) << "SDK 2." << minor;
  }
}

TEST(Registry, RefusesUnknownKind) {
  const std::string msg = refusal_for("unknown_kind");
  EXPECT_NE(msg.find("declares kind 'optimizer', which this loom does not know (known: model, tokenizer, adapter, collator, placement)"),
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
