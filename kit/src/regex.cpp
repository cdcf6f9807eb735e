#include "loom/kit/regex.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "loom/error.hpp"

namespace loom::kit {
namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR message[256];
  pcre2_get_error_message(code, message, sizeof message);
  return reinterpret_cast<const char*>(message);
}

std::string shown(std::string_view pattern) {
  constexpr std::size_t kShown = 60;
  if (pattern.size() <= kShown) return "\"" + std::string(pattern) + "\"";
  std::size_t end = kShown;
  while (end > 0 && (static_cast<unsigned char>(pattern[end]) & 0xC0) == 0x80) --end;
  return "\"" + std::string(pattern.substr(0, end)) + "...\" (" + std::to_string(pattern.size()) + " bytes)";
}

// Per thread (a tokenizer may encode on several): a match block, a match context holding the
// budget, and a JIT stack that may grow to 8 MiB so long whitespace runs do not hit the 32 KiB
// default.
struct Scratch {
  pcre2_match_data* data = pcre2_match_data_create(16, nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  Scratch() { pcre2_jit_stack_assign(context, nullptr, stack); }
  ~Scratch() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(stack);
    pcre2_match_data_free(data);
  }
  pcre2_match_context* with_limit(std::uint32_t limit) {
    pcre2_set_match_limit(context, limit);
    pcre2_set_depth_limit(context, limit);
    return context;
  }
};
thread_local Scratch scratch;

}  // namespace

Regex::Regex(std::string_view pattern, std::uint32_t match_limit) : match_limit_(match_limit), shown_(shown(pattern)) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  auto* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
  if (!code)
    throw UserError("regular expression " + shown_ + " does not compile at offset " + std::to_string(offset) + ": " + pcre2_message(error));
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter where JIT is missing
  code_ = code;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

std::vector<std::pair<std::size_t, std::size_t>> Regex::find_all(std::string_view text) const {
  auto* code = static_cast<pcre2_code*>(code_);
  auto* context = scratch.with_limit(match_limit_);
  std::vector<std::pair<std::size_t, std::size_t>> out;
  std::size_t at = 0;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  while (at <= text.size()) {
    const int rc = pcre2_match(code, subject, text.size(), at, PCRE2_NO_UTF_CHECK, scratch.data, context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) throw UserError("regular expression " + shown_ + " failed on the input: " + pcre2_message(rc));
    const PCRE2_SIZE* v = pcre2_get_ovector_pointer(scratch.data);
    const std::size_t b = v[0], e = v[1];
    if (e > b) {
      out.emplace_back(b, e);
      at = e;
    } else {  // an empty match: step over one character
      const auto lead = b < text.size() ? static_cast<unsigned char>(text[b]) : 0;
      at = b + (lead < 0x80 ? 1 : lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2);
    }
  }
  return out;
}

bool Regex::full_match(std::string_view text) const {
  const int rc = pcre2_match(static_cast<pcre2_code*>(code_), reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), 0,
                             PCRE2_ANCHORED | PCRE2_ENDANCHORED, scratch.data, scratch.with_limit(match_limit_));
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0)
    throw UserError("regular expression " + shown_ + " failed on " + std::string(text.substr(0, 80)) + ": " + pcre2_message(rc) +
                    " (the pattern backtracks too much; simplify it)");
  return true;
}

}  // namespace loom::kit
