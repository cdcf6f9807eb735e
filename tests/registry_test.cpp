#include <gtest/gtest.h>

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
