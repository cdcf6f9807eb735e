// Text plumbing for hf-json: UTF-8 checks, aligned text, patterns and the normalizers.

#include <unicode/bytestream.h>
#include <unicode/casemap.h>
#include <unicode/edits.h>
#include <unicode/normalizer2.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <stdexcept>

#include "hf_tokenizer.hpp"
#include "loom/error.hpp"

namespace loom::hf {

Span Aligned::origin(std::size_t first, std::size_t last) const {
  if (identity()) return {base + first, base + last};
  return {begins[first], ends[last - 1]};
}

Span Aligned::origin_point(std::size_t at) const {
  if (identity()) return {base + at, base + at};
  if (at < begins.size()) return {begins[at], begins[at]};
  return {ends.back(), ends.back()};
}

Aligned Aligned::slice(std::size_t first, std::size_t last) const {
  Aligned out;
  out.text = text.substr(first, last - first);
  if (identity()) {
    out.base = base + first;
  } else {
    out.begins.assign(begins.begin() + static_cast<std::ptrdiff_t>(first), begins.begin() + static_cast<std::ptrdiff_t>(last));
    out.ends.assign(ends.begin() + static_cast<std::ptrdiff_t>(first), ends.begin() + static_cast<std::ptrdiff_t>(last));
    out.base = out.begins.empty() ? origin_point(first).first : out.begins.front();
  }
  return out;
}

void Aligned::make_explicit() {
  if (!identity() || text.empty()) return;
  begins.resize(text.size());
  ends.resize(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    begins[i] = static_cast<std::uint32_t>(base + i);
    ends[i] = static_cast<std::uint32_t>(base + i + 1);
  }
}

void Aligned::apply(const std::vector<Edit>& edits) {
  if (edits.empty()) return;
  make_explicit();
  std::string out;
  std::vector<std::uint32_t> b, e;
  out.reserve(text.size());
  std::size_t at = 0;
  auto keep = [&](std::size_t to) {
    out.append(text, at, to - at);
    b.insert(b.end(), begins.begin() + static_cast<std::ptrdiff_t>(at), begins.begin() + static_cast<std::ptrdiff_t>(to));
    e.insert(e.end(), ends.begin() + static_cast<std::ptrdiff_t>(at), ends.begin() + static_cast<std::ptrdiff_t>(to));
    at = to;
  };
  for (const auto& edit : edits) {
    keep(edit.first);
    const Span from = edit.last > edit.first ? origin(edit.first, edit.last) : origin_point(edit.first);
    out += edit.with;
    b.insert(b.end(), edit.with.size(), static_cast<std::uint32_t>(from.first));
    e.insert(e.end(), edit.with.size(), static_cast<std::uint32_t>(from.second));
    at = edit.last;
  }
  keep(text.size());
  text = std::move(out);
  begins = std::move(b);
  ends = std::move(e);
  if (!begins.empty()) base = begins.front();
}

Pattern::Pattern(const nlohmann::json& j, const std::string& where) {
  if (j.is_object() && j.size() == 1 && j.contains("String") && j["String"].is_string()) {
    literal_ = j["String"].get<std::string>();
    if (literal_.empty()) throw UserError(where + ": an empty String pattern matches nothing useful");
  } else if (j.is_object() && j.size() == 1 && j.contains("Regex") && j["Regex"].is_string()) {
    try {
      regex_ = std::make_shared<kit::Regex>(j["Regex"].get<std::string>());
    } catch (const UserError& e) {
      throw UserError(where + ": " + e.what());
    }
  } else {
    throw UserError(where + ": a pattern is {\"String\": ...} or {\"Regex\": ...}, found " + kit::json::describe(j));
  }
}

std::vector<Aligned::Edit> Pattern::replacements(std::string_view text, const std::string& with) const {
  std::vector<Aligned::Edit> edits;
  for (const auto& [b, e] : find_all(text)) edits.push_back({b, e, with});
  return edits;
}

std::vector<Span> Pattern::find_all(std::string_view text) const {
  if (regex_) return regex_->find_all(text);
  std::vector<Span> out;
  for (std::size_t at = text.find(literal_); at != std::string_view::npos; at = text.find(literal_, at + literal_.size()))
    out.emplace_back(at, at + literal_.size());
  return out;
}

namespace {
// Length of the White_Space character at text[at], or 0 when it is something else.
std::size_t whitespace_at(std::string_view text, std::size_t at) {
  const auto c = static_cast<unsigned char>(text[at]);
  if (c < 0x80) return c == ' ' || (c >= 0x09 && c <= 0x0D) ? 1 : 0;
  const std::size_t len = utf8_length(c);
  std::uint32_t cp = c & (len == 2 ? 0x1F : len == 3 ? 0x0F : 0x07);
  for (std::size_t k = 1; k < len && at + k < text.size(); ++k) cp = (cp << 6) | (static_cast<unsigned char>(text[at + k]) & 0x3F);
  const bool space = cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
                     cp == 0x202F || cp == 0x205F || cp == 0x3000;
  return space ? len : 0;
}
}  // namespace

std::size_t skip_whitespace(std::string_view text, std::size_t from, std::size_t limit) {
  for (std::size_t len; from < limit && (len = whitespace_at(text, from)) > 0;) from += len;
  return from;
}

std::size_t skip_whitespace_back(std::string_view text, std::size_t to, std::size_t floor) {
  while (to > floor) {
    std::size_t start = to - 1;  // back to the lead byte of the character before `to`
    while (start > floor && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
    if (whitespace_at(text, start) != to - start) break;
    to = start;
  }
  return to;
}

std::string json_quote(const std::string& s) { return kit::json::quote(s); }

std::string type_of(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) kit::json::Value::inside(j, where).expected("an object with a \"type\"");
  return field(j, where, "type").string();
}

// ---- normalizers ----
namespace {

// Rewrites text with an ICU function that reports its edits, keeping the alignment exact.
template <class Transform>
void rewrite_with_edits(Aligned& text, Transform transform) {
  std::string out;
  icu::StringByteSink<std::string> sink(&out);
  icu::Edits edits;
  UErrorCode status = U_ZERO_ERROR;
  transform(icu::StringPiece(text.text.data(), static_cast<std::int32_t>(text.text.size())), sink, &edits, status);
  if (U_FAILURE(status)) throw UserError(std::string("unicode normalization failed: ") + u_errorName(status));
  if (!edits.hasChanges()) return;
  std::vector<Aligned::Edit> list;
  auto it = edits.getFineChangesIterator();
  while (it.next(status)) {
    const auto src = static_cast<std::size_t>(it.sourceIndex()), dst = static_cast<std::size_t>(it.destinationIndex());
    list.push_back({src, src + static_cast<std::size_t>(it.oldLength()), out.substr(dst, static_cast<std::size_t>(it.newLength()))});
  }
  text.apply(list);
}

class Unicode final : public Normalizer {
 public:
  Unicode(const std::string& form, const std::string& where) {
    UErrorCode status = U_ZERO_ERROR;
    if (form == "NFC") n_ = icu::Normalizer2::getNFCInstance(status);
    else if (form == "NFD") n_ = icu::Normalizer2::getNFDInstance(status);
    else if (form == "NFKC") n_ = icu::Normalizer2::getNFKCInstance(status);
    else n_ = icu::Normalizer2::getNFKDInstance(status);
    if (U_FAILURE(status)) throw UserError(where + ": ICU has no " + form + " data: " + u_errorName(status));
  }
  void normalize(Aligned& text) const override {
    UErrorCode status = U_ZERO_ERROR;
    if (n_->isNormalizedUTF8(icu::StringPiece(text.text.data(), static_cast<std::int32_t>(text.text.size())), status)) return;
    rewrite_with_edits(text, [&](icu::StringPiece s, icu::ByteSink& sink, icu::Edits* edits, UErrorCode& st) {
      n_->normalizeUTF8(0, s, sink, edits, st);
    });
  }

 private:
  const icu::Normalizer2* n_;
};

class Lowercase final : public Normalizer {
 public:
  void normalize(Aligned& text) const override {
    rewrite_with_edits(text, [](icu::StringPiece s, icu::ByteSink& sink, icu::Edits* edits, UErrorCode& st) {
      icu::CaseMap::utf8ToLower("", 0, s, sink, edits, st);
    });
  }
};

class Replace final : public Normalizer {
 public:
  Replace(const nlohmann::json& j, const std::string& where)
      : pattern_(field(j, where, "pattern").raw(), where + ".pattern"), content_(field(j, where, "content").string()) {}
  void normalize(Aligned& text) const override { text.apply(pattern_.replacements(text.text, content_)); }

 private:
  Pattern pattern_;
  std::string content_;
};

class Prepend final : public Normalizer {
 public:
  explicit Prepend(std::string with) : with_(std::move(with)) {}
  void normalize(Aligned& text) const override {
    if (!text.text.empty()) text.apply({{0, 0, with_}});  // HF prepends to non-empty text only
  }

 private:
  std::string with_;
};

class Strip final : public Normalizer {
 public:
  Strip(bool left, bool right) : left_(left), right_(right) {}
  void normalize(Aligned& text) const override {
    const std::size_t first = left_ ? skip_whitespace(text.text, 0, text.text.size()) : 0;
    const std::size_t last = right_ ? skip_whitespace_back(text.text, text.text.size(), first) : text.text.size();
    std::vector<Aligned::Edit> edits;
    if (first > 0) edits.push_back({0, first, ""});
    if (last < text.text.size()) edits.push_back({last, text.text.size(), ""});
    text.apply(edits);
  }

 private:
  bool left_, right_;
};

class Sequence final : public Normalizer {
 public:
  explicit Sequence(std::vector<std::unique_ptr<Normalizer>> parts) : parts_(std::move(parts)) {}
  void normalize(Aligned& text) const override {
    for (const auto& p : parts_) p->normalize(text);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

}  // namespace

std::unique_ptr<Normalizer> make_normalizer(const nlohmann::json& j, const std::string& where) {
  if (j.is_null()) return nullptr;
  const std::string type = type_of(j, where);
  if (type == "Sequence") {
    return std::make_unique<Sequence>(make_parts<Normalizer>(j, where, "normalizers", make_normalizer));
  }
  if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") return std::make_unique<Unicode>(type, where);
  if (type == "Lowercase") return std::make_unique<Lowercase>();
  if (type == "Replace") return std::make_unique<Replace>(j, where);
  if (type == "Prepend") return std::make_unique<Prepend>(field(j, where, "prepend").string());
  if (type == "Strip") return std::make_unique<Strip>(field(j, where, "strip_left").boolean_or(true), field(j, where, "strip_right").boolean_or(true));
  throw UserError(where + ": unsupported normalizer type \"" + type +
                  "\" (hf-json supports Sequence, NFC, NFD, NFKC, NFKD, Lowercase, Replace, Prepend, Strip)");
}

}  // namespace loom::hf
