// A chat template and a conversation, through the formats library alone: the template's source,
// then "\n=====\n", then a JSON object whose "messages" (and "tools") become the context. Parsed
// and rendered as a prompt, with the engine's bounds lowered (steps, output, value size and work)
// so that each input runs in milliseconds and holds a few MiB: a template that ran on, built past
// its bounds or recursed without end would show as a timeout, a memory limit or a crash
// (scripts/test-formats.sh runs it with -timeout=5 and 2 GiB).
#include <nlohmann/json.hpp>

#include "fuzz_files.hpp"
#include "loom/error.hpp"
#include "loom/formats/jinja.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace loom;
  const auto parts = fuzz::split(data, size, "\n=====\n", 2);
  formats::jinja::Settings bounds;
  bounds.max_steps = 100000;
  bounds.max_output_bytes = 1 << 20;
  bounds.max_value_bytes = 1 << 20;
  bounds.max_work_bytes = 64 << 20;
  nlohmann::ordered_json context = nlohmann::ordered_json::object();
  const auto record = nlohmann::ordered_json::parse(parts[1], nullptr, false);
  if (!record.is_discarded() && record.is_object())
    for (const char* key : {"messages", "tools"})
      if (record.contains(key)) context[key] = record[key];
  context["add_generation_prompt"] = true;
  context["eos_token"] = "</s>";
  try {
    const formats::jinja::Template tmpl(parts[0], "fuzz", bounds);
    tmpl.render(context);
  } catch (const UserError&) {
  }
  return 0;
}
