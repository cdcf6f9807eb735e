#pragma once
// UTF-8 as text a user supplies must hold it (data lines, command-line prompts, chat templates,
// tokenizer files). Header-only.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace loom::kit {

// Index of the first byte that does not start a valid UTF-8 sequence (an overlong form, a
// surrogate, a code point past U+10FFFF or a cut sequence), or npos when all of `text` is UTF-8.
inline std::size_t invalid_utf8_at(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const std::size_t n = text.size();
  std::size_t i = 0;
  while (i < n) {
    const unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t len;
    std::uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) len = 2, cp = c & 0x1F;
    else if (c >= 0xE0 && c <= 0xEF) len = 3, cp = c & 0x0F;
    else if (c >= 0xF0 && c <= 0xF4) len = 4, cp = c & 0x07;
    else return i;
    if (i + len > n) return i;
    for (std::size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::string_view::npos;
}

// `text` with each byte that starts no valid sequence replaced by U+FFFD, as Python's
// decode(errors="replace") does byte by byte. Kit 3.6.
inline std::string replace_invalid_utf8(std::string_view text) {
  std::string out;
  while (true) {
    const std::size_t bad = invalid_utf8_at(text);
    if (bad == std::string_view::npos) break;
    out.append(text.substr(0, bad));
    out.append("\xEF\xBF\xBD");
    text.remove_prefix(bad + 1);
  }
  out.append(text);
  return out;
}

// The length of the UTF-8 byte-order mark `text` starts with (3), or 0. Editors on Windows and
// Excel's "CSV UTF-8" write one; it is no part of the text.
inline std::size_t utf8_bom_size(std::string_view text) { return text.substr(0, 3) == "\xEF\xBB\xBF" ? 3 : 0; }

// A text file's content without its byte-order mark.
inline std::string without_bom(std::string text) {
  text.erase(0, utf8_bom_size(text));
  return text;
}

}  // namespace loom::kit
