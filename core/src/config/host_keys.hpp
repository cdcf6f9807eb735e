#pragma once
// The host's own sections ([run], [parallel], [data], [train], [plugins]), each key named once: its
// schema (type, default, bounds, doc: what validation checks and `loom plugins reference` prints)
// beside where read_run_config stores its value in the typed RunConfig.
#include <functional>
#include <string>
#include <vector>

#include "config/diagnostics.hpp"
#include "loom/options.hpp"

namespace loom::core {

struct RunConfig;

// Where a key's value was set, for a store that checks more than the schema can say.
struct KeyPlace {
  Location at;
  Diagnostics& diagnostics;
};

struct HostKey {
  OptionSpec spec;
  // Stores the value (given or default) into the config; null for a key the pipeline loader reads
  // itself ([plugins]).
  std::function<void(RunConfig&, const OptionValue&, const KeyPlace&)> store;
};

// The host sections' names, in the order their keys are read.
const std::vector<std::string>& host_sections();
// A host section's keys; empty for any other section.
const std::vector<HostKey>& host_keys(const std::string& section);

}  // namespace loom::core
