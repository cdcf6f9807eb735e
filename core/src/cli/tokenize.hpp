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
  bool round_trip = false;   // encode: a JSON object per input: "ids", "ids_no_special" and the "text" and "text_no_special" they decode to
};

// `loom tokenize`: one output line per input line, in order, or with `one_input` one output line
// for the whole stream (the TEXT argument: newlines inside it are text, "" is an input). Bad
// inputs are a UserError naming `source:line` (`source` alone for one input).
void tokenize_stream(const Tokenizer& tokenizer, std::istream& in, std::ostream& out, const TokenizeSettings& settings, const std::string& source,
                     bool one_input = false);

}  // namespace loom::core
