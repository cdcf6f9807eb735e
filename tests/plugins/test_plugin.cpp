// One source, built several times with different definitions, gives the host a good plugin and
// each kind of broken one (see tests/CMakeLists.txt).
#include <atomic>
#include <stdexcept>

#include <c10/util/Exception.h>

#include "loom/collator.hpp"
#include "loom/error.hpp"
#include "loom/plugin.hpp"

#ifndef TEST_PLUGIN_NAME
#define TEST_PLUGIN_NAME "echo"
#endif
#ifndef TEST_PLUGIN_KIND
#define TEST_PLUGIN_KIND loom::kKindCollator
#endif

namespace {

std::vector<loom::OptionSpec> options() {
  return {loom::OptionSpec::boolean("mask_prompt", false, "label nothing before the first space (test behaviour)")
#ifdef TEST_RESERVED_OPTION
              ,
          loom::OptionSpec::string("plugin", std::nullopt, "reserved name, must be refused")
#endif
  };
}

// Right-pads or left-pads as the tokenizer says; labels are the input ids, masked on padding.
class EchoCollator final : public loom::Collator {
 public:
  explicit EchoCollator(bool mask_prompt) : mask_prompt_(mask_prompt) {}
  loom::Batch collate(const std::vector<std::string>& samples, const loom::Tokenizer& tokenizer,
                      const loom::CollateSettings& settings) const override {
#ifdef TEST_COLLATE_THROWS
    // What LibTorch's caching allocator throws when a device is full, for samples that ask.
    for (const auto& sample : samples) TORCH_CHECK_WITH(OutOfMemoryError, sample != "out of memory", "CUDA out of memory. Tried to allocate 2.00 GiB");
    // What a bounds-checked access in a buggy plugin throws.
    throw std::out_of_range("vector::_M_range_check: __n (which is 7) >= this->size() (which is 3)");
#endif
    const std::int64_t max_length = settings.max_length;
    std::vector<std::vector<std::int64_t>> rows;
    std::int64_t cols = 0;
    for (const auto& s : samples) {
      auto ids = tokenizer.encode(s, loom::Specials::kSample).ids;
      if (static_cast<std::int64_t>(ids.size()) > max_length) ids.resize(static_cast<std::size_t>(max_length));
      cols = std::max<std::int64_t>(cols, static_cast<std::int64_t>(ids.size()));
      rows.push_back(std::move(ids));
    }
    loom::Batch b;
    b.rows = static_cast<std::int64_t>(rows.size());
    b.cols = cols;
    const auto pad = tokenizer.special_tokens().pad.value_or(0);
    for (const auto& ids : rows) {
      const std::size_t padding = static_cast<std::size_t>(cols) - ids.size();
      const auto emit_padding = [&] {
        for (std::size_t i = 0; i < padding; ++i) {
          b.input_ids.push_back(pad);
          b.attention_mask.push_back(0);
          b.labels.push_back(loom::kIgnoreLabel);
        }
      };
      if (tokenizer.pad_left()) emit_padding();
      bool in_prompt = mask_prompt_;
      for (auto id : ids) {
        b.input_ids.push_back(id);
        b.attention_mask.push_back(1);
        b.labels.push_back(in_prompt ? loom::kIgnoreLabel : id);
        if (id == ' ') in_prompt = false;
      }
      if (!tokenizer.pad_left()) emit_padding();
    }
    return b;
  }

  std::optional<loom::PromptSplit> split_for_generation(const std::string&) const override {
#ifdef TEST_EVAL_REFUSES
    // What slips past validation: the two held-out samples split there, then the run's final
    // evaluation is refused.
    if (++splits_ > 2) throw loom::UserError("the held-out samples changed since validation (test plugin)");
#endif
    return std::nullopt;
  }

 private:
  bool mask_prompt_;
  mutable std::atomic<int> splits_{0};
};

std::unique_ptr<loom::Plugin> create(const loom::Options& o) {
#ifdef TEST_FACTORY_THROWS
  (void)o;
  throw std::runtime_error("cannot open /dev/gpu-that-does-not-exist");
#else
  return std::make_unique<EchoCollator>(o.get_bool("mask_prompt"));
#endif
}

}  // namespace

#ifdef TEST_SDK_MAJOR
#undef LOOM_SDK_VERSION_MAJOR
#define LOOM_SDK_VERSION_MAJOR TEST_SDK_MAJOR
#endif
#ifdef TEST_SDK_MINOR_AHEAD  // built against the minor after this loom's
constexpr int kMinorAhead = LOOM_SDK_VERSION_MINOR + 1;
#undef LOOM_SDK_VERSION_MINOR
#define LOOM_SDK_VERSION_MINOR kMinorAhead
#endif
#ifdef TEST_KIT_MINOR  // built against another minor of this loom's kit (major TEST_KIT_MAJOR)
namespace loom {
constexpr std::uint32_t built_kit_version(int) { return (std::uint32_t{TEST_KIT_MAJOR} << 16) | TEST_KIT_MINOR; }
}  // namespace loom
#endif
#ifdef TEST_TORCH_MAJOR
#undef TORCH_VERSION_MAJOR
#define TORCH_VERSION_MAJOR TEST_TORCH_MAJOR
#endif

#ifdef TEST_NO_FLAGS
// A descriptor written by hand, as a library not using LOOM_PLUGIN might: it records no C++ ABI.
namespace loom_plugin_entry {
const ::loom::PluginDescriptor* describe() {
  static const ::loom::PluginDescriptor descriptor{::loom::kDescriptorMagic, LOOM_SDK_VERSION_MAJOR, LOOM_SDK_VERSION_MINOR, TORCH_VERSION_MAJOR,
                                                   TORCH_VERSION_MINOR, TORCH_VERSION_PATCH, 0, TEST_PLUGIN_KIND, TEST_PLUGIN_NAME, "9.9.9",
                                                   "test collator", options, create, nullptr, 0, 0};
  return &descriptor;
}
}  // namespace loom_plugin_entry
BOOST_DLL_ALIAS(loom_plugin_entry::describe, loom_plugin_descriptor)
#else
LOOM_PLUGIN(TEST_PLUGIN_KIND, TEST_PLUGIN_NAME, "9.9.9", "test collator", options, create)
#endif
