// Placement plugin `manual`: a device map written in the pipeline, checked for completeness. Every
// block must be placed exactly once; a block the map misses is an error naming it, never a silent
// default. `loom plan --freeze` writes an auto plan in this form so a run can be pinned.
#include <map>

#include "loom/error.hpp"
#include "loom/kit/memory.hpp"
#include "loom/placement.hpp"
#include "loom/plugin.hpp"

namespace loom::manual_placement {
namespace {

std::vector<OptionSpec> options() {
  return {OptionSpec::string_map("map",
                                 "block -> device: { \"embed\" = \"cuda:0\", \"layers.0-15\" = \"cuda:0\", \"layers.16-31\" = \"cuda:1\", "
                                 "\"norm\" = \"cuda:1\", \"head\" = \"cuda:1\" }")
              .require()};
}

// "layers.3" -> {"layers", 3, 3}; "layers.0-15" -> {"layers", 0, 15}; other names -> no range.
struct Key {
  std::string prefix;
  long first = -1, last = -1;
};

Key parse_key(const std::string& key) {
  const auto dot = key.rfind('.');
  if (dot == std::string::npos) return {key};
  const std::string tail = key.substr(dot + 1);
  const auto dash = tail.find('-');
  const auto number = [](const std::string& s) {
    if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string::npos) return -1L;
    return std::stol(s);
  };
  if (dash == std::string::npos) {
    const long n = number(tail);
    return n < 0 ? Key{key} : Key{key.substr(0, dot), n, n};
  }
  const long a = number(tail.substr(0, dash)), b = number(tail.substr(dash + 1));
  if (a < 0 || b < 0 || b < a) throw UserError("map key \"" + key + "\": a range is written FIRST-LAST with FIRST <= LAST, e.g. layers.0-15");
  return {key.substr(0, dot), a, b};
}

class ManualPlacement final : public Placement {
 public:
  explicit ManualPlacement(StringMap map) : map_(std::move(map)) {}

  Plan plan(const PlacementRequest& request) const override {
    const auto& blocks = request.model.blocks;
    std::map<std::string, std::size_t> index;
    for (std::size_t i = 0; i < blocks.size(); ++i) index[blocks[i].name] = i;
    std::vector<std::string> where(blocks.size());
    std::vector<std::string> source(blocks.size());
    for (const auto& [key, device_text] : map_) {
      const std::string device = parse_device(device_text).str();
      const Key k = parse_key(key);
      std::vector<std::size_t> hits;
      if (k.first < 0) {
        if (auto it = index.find(key); it != index.end()) hits.push_back(it->second);
      } else {
        for (long n = k.first; n <= k.last; ++n) {
          auto it = index.find(k.prefix + "." + std::to_string(n));
          if (it == index.end())
            throw UserError("map key \"" + key + "\": the model has no block " + k.prefix + "." + std::to_string(n) + " (its blocks: " +
                            summary(blocks) + ")");
          hits.push_back(it->second);
        }
      }
      if (hits.empty()) throw UserError("map key \"" + key + "\" names no block of the model (its blocks: " + summary(blocks) + ")");
      for (auto i : hits) {
        if (!where[i].empty())
          throw UserError("block " + blocks[i].name + " is placed twice, by \"" + source[i] + "\" and by \"" + key + "\"");
        where[i] = device;
        source[i] = key;
      }
    }
    std::string missing;
    for (std::size_t i = 0; i < blocks.size(); ++i)
      if (where[i].empty()) missing += (missing.empty() ? "" : ", ") + blocks[i].name;
    if (!missing.empty()) throw UserError("the map places no device for: " + missing + "; every block must be placed");
    Plan plan;
    plan.strategy = "manual";
    for (std::size_t i = 0; i < blocks.size(); ++i) plan.blocks.push_back({blocks[i].name, where[i]});
    plan.devices = kit::device_usage(request, plan.blocks);
    plan.notes.push_back("placed as [placement] map says");
    return plan;
  }

 private:
  static std::string summary(const std::vector<BlockInfo>& blocks) {
    std::string out;
    std::size_t i = 0;
    while (i < blocks.size()) {
      const Key k = parse_key(blocks[i].name);
      std::size_t j = i;
      while (k.first >= 0 && j + 1 < blocks.size() && parse_key(blocks[j + 1].name).prefix == k.prefix) ++j;
      out += (out.empty() ? "" : ", ") + (j > i ? k.prefix + "." + std::to_string(k.first) + "-" + std::to_string(parse_key(blocks[j].name).last)
                                                : blocks[i].name);
      i = j + 1;
    }
    return out;
  }

  StringMap map_;
};

std::unique_ptr<Plugin> create(const Options& o) {
  const auto& map = o.get_string_map("map");
  for (const auto& [key, device] : map) {
    parse_key(key);
    parse_device(device);
  }
  return std::make_unique<ManualPlacement>(map);
}

}  // namespace
}  // namespace loom::manual_placement

LOOM_PLUGIN(loom::kKindPlacement, "manual", "0.1.0", "a device map written in the pipeline, checked for completeness",
            loom::manual_placement::options, loom::manual_placement::create)
