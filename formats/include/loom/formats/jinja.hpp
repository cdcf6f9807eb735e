#pragma once
// The Jinja subset that Hugging Face chat templates are written in, rendered as transformers'
// apply_chat_template renders them: Python's jinja2 in an immutable sandbox with trim_blocks and
// lstrip_blocks, the loopcontrols extension, HF's `tojson` (json.dumps, ensure_ascii off), and the
// globals `raise_exception` and `strftime_now`. No packaged C++ library renders real templates,
// hence this one; docs/chat.md lists what it supports and what it refuses.
//
// Values follow Python: `{{ [1, 'a', none] }}` prints "[1, 'a', None]", `7 / 2` is 3.5, a string's
// length counts code points, a for loop's assignments stay in its iteration.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace loom::formats::jinja {

struct Settings {
  bool trim_blocks = true;    // HF's setting: the first newline after a block tag is dropped
  bool lstrip_blocks = true;  // HF's setting: spaces and tabs before a block tag on its line are dropped
  // A hostile template cannot run for ever, print without end, build values past memory or recurse
  // past the stack: each bound is one clear error naming the template's line.
  std::size_t max_output_bytes = std::size_t{64} << 20;  // what a render (or a captured block) prints
  std::size_t max_value_bytes = std::size_t{64} << 20;   // any one string, list or printed value it builds
  std::uint64_t max_steps = 2'000'000;                   // statements, loop iterations and calls
  // Bytes every operation reads, copies or builds, summed over the render: a bound on its time and,
  // since nothing is built without being counted, on the memory it holds.
  std::uint64_t max_work_bytes = std::uint64_t{1} << 30;
};

struct Rendered {
  std::string text;
  // [begin, end) byte ranges of `text` printed inside {% generation %} ... {% endgeneration %}.
  std::vector<std::pair<std::size_t, std::size_t>> generation_spans;
};

class Template {
 public:
  // Parses `source`. A syntax error or a construct outside the subset is a UserError naming
  // `name` and the template's line.
  Template(const std::string& source, std::string name, Settings settings = {});
  ~Template();
  Template(const Template&) = default;
  Template& operator=(const Template&) = default;

  // Renders with `context`'s keys as variables. A runtime error (an undefined value used, a type
  // mismatch, the template's own raise_exception) is a UserError naming the template and line.
  Rendered render(const nlohmann::ordered_json& context) const;

  bool has_generation_blocks() const;
  const std::string& name() const;

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

// Text made safe for HTML as Jinja's `escape` filter (markupsafe) makes it: & < > " ' as entities.
std::string html_escape(const std::string& text);

}  // namespace loom::formats::jinja
