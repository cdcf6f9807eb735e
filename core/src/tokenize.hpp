#pragma once
#include <iosfwd>
#include <string>

#include "loom/tokenizer.hpp"

namespace loom::core {

struct TokenizeSettings {
  bool decode = false;       // input lines are JSON arrays of ids; output JSON strings
  bool json_lines = false;   // encode: each input line is a JSON string (may hold newlines)
  bool specials = true;      // encode: the tokenizer's special tokens (Specials::kPrompt)
  bool stats = false;        // a summary line on stderr: lines, bytes, tokens, time in the tokenizer
};

// `loom tokenize`: one output line per input line, in order. Bad lines are a UserError naming
// `source:line`.
void tokenize_stream(const Tokenizer& tokenizer, std::istream& in, std::ostream& out, const TokenizeSettings& settings, const std::string& source);

}  // namespace loom::core
