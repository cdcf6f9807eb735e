#pragma once
// Regular expressions from files and pipelines (tokenizer.json Split patterns, an adapter's
// target_modules) run on PCRE2: UTF-8 with Unicode properties (\p{L}, Unicode \s), the syntax the
// Oniguruma-flavoured tokenizer files are written in; no recursion on the C++ stack, and a
// backtracking budget per match, so a catastrophic pattern is one clear error, never a hang.
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "loom/export.hpp"
#include "loom/kit/version.hpp"  // recorded in the descriptor of a plugin that uses the kit

namespace loom::kit {

class LOOM_API Regex {
 public:
  // PCRE2's own default budget, ample for tokenizing long lines.
  static constexpr std::uint32_t kDefaultMatchLimit = 10'000'000;

  // Compiles `pattern` (JIT where the library has it). Throws UserError naming the pattern (cut
  // short) and where and why it does not compile. `match_limit` bounds the work of one match.
  explicit Regex(std::string_view pattern, std::uint32_t match_limit = kDefaultMatchLimit);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Non-overlapping matches, left to right, as byte spans; `text` must be valid UTF-8. Throws
  // UserError when a match runs past the budget.
  std::vector<std::pair<std::size_t, std::size_t>> find_all(std::string_view text) const;
  // Whether the whole of `text` matches (as Python's re.fullmatch).
  bool full_match(std::string_view text) const;

 private:
  void* code_ = nullptr;
  std::uint32_t match_limit_;
  std::string shown_;  // the pattern, cut short, for messages
};

}  // namespace loom::kit
