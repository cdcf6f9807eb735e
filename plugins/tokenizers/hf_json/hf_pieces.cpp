// Pre-tokenizers and decoders of hf-json, with the semantics of HF tokenizers (Rust).
#include <algorithm>
#include <cctype>
#include <optional>

#include <nlohmann/json.hpp>

#include "hf_tokenizer.hpp"
#include "loom/error.hpp"

namespace loom::hf {
namespace {

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

Behavior behavior_of(const kit::json::Value& j) {
  const std::string b = j.string();
  if (b == "Removed") return Behavior::kRemoved;
  if (b == "Isolated") return Behavior::kIsolated;
  if (b == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::kMergedWithNext;
  if (b == "Contiguous") return Behavior::kContiguous;
  j.fail("unknown split behavior \"" + b + "\" (Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous)");
}

// Cuts `piece` at `matches` as `behavior` says (HF's NormalizedString::split), appending to `out`.
void split_piece(const Aligned& piece, const std::vector<Span>& matches, Behavior behavior, bool invert, std::vector<Aligned>& out) {
  struct Part {
    Span span;
    bool match;
  };
  std::vector<Part> parts;
  std::size_t at = 0;
  for (const auto& m : matches) {
    if (m.first > at) parts.push_back({{at, m.first}, invert});
    parts.push_back({m, !invert});
    at = m.second;
  }
  if (at < piece.text.size() || parts.empty()) parts.push_back({{at, piece.text.size()}, invert});

  std::vector<Span> kept;
  bool previous = false;
  switch (behavior) {
    case Behavior::kRemoved:
      for (const auto& p : parts)
        if (!p.match) kept.push_back(p.span);
      break;
    case Behavior::kIsolated:
      for (const auto& p : parts) kept.push_back(p.span);
      break;
    case Behavior::kMergedWithPrevious:
      for (const auto& p : parts) {
        if (p.match && !previous && !kept.empty()) kept.back().second = p.span.second;
        else kept.push_back(p.span);
        previous = p.match;
      }
      break;
    case Behavior::kMergedWithNext:
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->match && !previous && !kept.empty()) kept.back().first = it->span.first;
        else kept.push_back(it->span);
        previous = it->match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
    case Behavior::kContiguous:
      for (std::size_t i = 0; i < parts.size(); ++i) {
        if (i > 0 && parts[i].match == previous) kept.back().second = parts[i].span.second;
        else kept.push_back(parts[i].span);
        previous = parts[i].match;
      }
      break;
  }
  for (const auto& [b, e] : kept)
    if (e > b) out.push_back(piece.slice(b, e));
}

class Split final : public PreTokenizer {
 public:
  Split(const nlohmann::json& j, const std::string& where)
      : Split(Pattern(field(j, where, "pattern").raw(), where + ".pattern"), behavior_of(field(j, where, "behavior")), field(j, where, "invert").boolean_or(false)) {}
  Split(Pattern pattern, Behavior behavior, bool invert) : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}
  void split(std::vector<Aligned>& pieces) const override {
    std::vector<Aligned> out;
    out.reserve(pieces.size() * 4);
    for (const auto& p : pieces) split_piece(p, pattern_.find_all(p.text), behavior_, invert_, out);
    pieces = std::move(out);
  }

 private:
  Pattern pattern_;
  Behavior behavior_;
  bool invert_;
};

// GPT-2's split, used by ByteLevel when use_regex is true.
const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

nlohmann::json regex(const char* pattern) { return {{"Regex", pattern}}; }

class ByteLevel final : public PreTokenizer {
 public:
  ByteLevel(const nlohmann::json& j, const std::string& where) : add_prefix_space_(field(j, where, "add_prefix_space").boolean_or(true)) {
    if (field(j, where, "use_regex").boolean_or(true)) split_.emplace(Pattern(regex(kGpt2Pattern), where), Behavior::kIsolated, false);
  }
  void split(std::vector<Aligned>& pieces) const override {
    if (add_prefix_space_)
      for (auto& p : pieces)
        if (p.text.empty() || p.text[0] != ' ') p.apply({{0, 0, " "}});
    if (split_) split_->split(pieces);
  }
  bool byte_level() const override { return true; }

 private:
  bool add_prefix_space_;
  std::optional<Split> split_;
};

// prepend_scheme of a Metaspace pre-tokenizer or decoder ("always", "first" or "never"); files
// written before it existed say add_prefix_space instead.
std::string prepend_scheme(const nlohmann::json& j, const std::string& where) {
  std::string scheme = field(j, where, "prepend_scheme").string_or("");
  if (scheme.empty()) scheme = field(j, where, "add_prefix_space").boolean_or(true) ? "always" : "never";
  if (scheme != "always" && scheme != "first" && scheme != "never")
    throw UserError(where + ".prepend_scheme: \"" + scheme + "\" is not always, first or never");
  return scheme;
}

class Metaspace final : public PreTokenizer {
 public:
  Metaspace(const nlohmann::json& j, const std::string& where)
      : replacement_(field(j, where, "replacement").string_or("\u2581")), scheme_(prepend_scheme(j, where)), space_({{"String", " "}}, where) {
    if (field(j, where, "split").boolean_or(true)) split_.emplace(Pattern({{"String", replacement_}}, where + ".replacement"), Behavior::kMergedWithNext, false);
  }
  void split(std::vector<Aligned>& pieces) const override {
    for (auto& p : pieces) {
      auto edits = space_.replacements(p.text, replacement_);
      const bool starts = p.text.compare(0, replacement_.size(), replacement_) == 0 || (!p.text.empty() && p.text[0] == ' ');
      // "first": only the piece that starts the caller's text (after an added token, no prefix).
      if (!starts && (scheme_ == "always" || (scheme_ == "first" && p.origin_point(0).first == 0))) edits.insert(edits.begin(), {0, 0, replacement_});
      p.apply(edits);
    }
    if (split_) split_->split(pieces);
  }

 private:
  std::string replacement_, scheme_;
  Pattern space_;
  std::optional<Split> split_;
};

class PreSequence final : public PreTokenizer {
 public:
  explicit PreSequence(std::vector<std::unique_ptr<PreTokenizer>> parts) : parts_(std::move(parts)) {}
  void split(std::vector<Aligned>& pieces) const override {
    for (const auto& p : parts_) p->split(pieces);
  }
  bool byte_level() const override {
    for (const auto& p : parts_)
      if (p->byte_level()) return true;
    return false;
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> parts_;
};

// ---- decoders ----

class Replace final : public Decoder {
 public:
  Replace(const nlohmann::json& j, const std::string& where)
      : pattern_(field(j, where, "pattern").raw(), where + ".pattern"), content_(field(j, where, "content").string()) {}
  void decode(std::vector<std::string>& tokens) const override {
    for (auto& t : tokens) {
      const auto matches = pattern_.find_all(t);
      if (matches.empty()) continue;
      std::string out;
      std::size_t at = 0;
      for (const auto& [b, e] : matches) {
        out.append(t, at, b - at);
        out += content_;
        at = e;
      }
      out.append(t, at, std::string::npos);
      t = std::move(out);
    }
  }

 private:
  Pattern pattern_;
  std::string content_;
};

// <0xAB> tokens become their bytes; a run that is not UTF-8 becomes one U+FFFD per byte, as in HF.
class ByteFallback final : public Decoder {
 public:
  void decode(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    std::string bytes;
    std::size_t count = 0;
    auto flush = [&] {
      if (count == 0) return;
      if (invalid_utf8_at(bytes) == std::string_view::npos) out.push_back(bytes);
      else
        for (std::size_t i = 0; i < count; ++i) out.emplace_back("\xEF\xBF\xBD");
      bytes.clear();
      count = 0;
    };
    for (auto& t : tokens) {
      if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' && std::isxdigit(static_cast<unsigned char>(t[3])) &&
          std::isxdigit(static_cast<unsigned char>(t[4]))) {
        bytes.push_back(static_cast<char>(std::stoi(t.substr(3, 2), nullptr, 16)));
        ++count;
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    tokens = std::move(out);
  }
};

class Fuse final : public Decoder {
 public:
  void decode(std::vector<std::string>& tokens) const override {
    std::string all;
    for (const auto& t : tokens) all += t;
    tokens.assign(1, std::move(all));
  }
};

class Strip final : public Decoder {
 public:
  Strip(const nlohmann::json& j, const std::string& where)
      : content_(field(j, where, "content").string()),
        start_(static_cast<int>(field(j, where, "start").opt_integer(0, 1 << 20).value_or(0))),
        stop_(static_cast<int>(field(j, where, "stop").opt_integer(0, 1 << 20).value_or(0))) {
    if (content_.empty() || invalid_utf8_at(content_) != std::string_view::npos) throw UserError(where + ".content must be one character");
  }
  void decode(std::vector<std::string>& tokens) const override {
    for (auto& t : tokens) {
      std::size_t first = 0, last = t.size();
      for (int i = 0; i < start_ && t.compare(first, content_.size(), content_) == 0; ++i) first += content_.size();
      for (int i = 0; i < stop_ && last >= first + content_.size() && t.compare(last - content_.size(), content_.size(), content_) == 0; ++i)
        last -= content_.size();
      t = t.substr(first, last - first);
    }
  }

 private:
  std::string content_;
  int start_, stop_;
};

// As HF's Rust decoder: "▁" becomes a space, except in the first token, where it is dropped
// (the prefix the pre-tokenizer added) unless prepend_scheme is "never".
class MetaspaceDecoder final : public Decoder {
 public:
  MetaspaceDecoder(const nlohmann::json& j, const std::string& where)
      : replacement_(field(j, where, "replacement").string_or("\u2581")), drop_in_first_(prepend_scheme(j, where) != "never") {}
  void decode(std::vector<std::string>& tokens) const override {
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      std::string out;
      const auto& t = tokens[i];
      for (std::size_t at = 0; at < t.size();) {
        if (t.compare(at, replacement_.size(), replacement_) == 0) {
          if (!(i == 0 && drop_in_first_)) out += ' ';
          at += replacement_.size();
        } else {
          out += t[at++];
        }
      }
      tokens[i] = std::move(out);
    }
  }

 private:
  std::string replacement_;
  bool drop_in_first_;
};

// Byte-level vocabularies are stored as raw bytes, so their decoder has nothing left to do.
class Identity final : public Decoder {
 public:
  void decode(std::vector<std::string>&) const override {}
};

class DecoderSequence final : public Decoder {
 public:
  explicit DecoderSequence(std::vector<std::unique_ptr<Decoder>> parts) : parts_(std::move(parts)) {}
  void decode(std::vector<std::string>& tokens) const override {
    for (const auto& p : parts_) p->decode(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> parts_;
};

}  // namespace

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const nlohmann::json& j, const std::string& where) {
  if (j.is_null()) return nullptr;
  const std::string type = type_of(j, where);
  if (type == "Sequence") {
    return std::make_unique<PreSequence>(make_parts<PreTokenizer>(j, where, "pretokenizers", make_pre_tokenizer));
  }
  if (type == "Split") return std::make_unique<Split>(j, where);
  if (type == "ByteLevel") return std::make_unique<ByteLevel>(j, where);
  if (type == "Metaspace") return std::make_unique<Metaspace>(j, where);
  // Digits as Rust's char::is_numeric has them (Nd, Nl and No: "①" and "٣" too), one per piece
  // or in runs.
  if (type == "Digits")
    return std::make_unique<Split>(Pattern(regex("\\p{N}"), where), field(j, where, "individual_digits").boolean_or(false) ? Behavior::kIsolated : Behavior::kContiguous, false);
  if (type == "Whitespace") return std::make_unique<Split>(Pattern(regex(R"(\w+|[^\w\s]+)"), where), Behavior::kRemoved, true);
  if (type == "WhitespaceSplit") return std::make_unique<Split>(Pattern(regex(R"(\s+)"), where), Behavior::kRemoved, false);
  throw UserError(where + ": unsupported pre-tokenizer type \"" + type +
                  "\" (hf-json supports Sequence, Split, ByteLevel, Metaspace, Digits, Whitespace, WhitespaceSplit)");
}

std::unique_ptr<Decoder> make_decoder(const nlohmann::json& j, const std::string& where, bool byte_level_vocab) {
  if (j.is_null()) return nullptr;
  const std::string type = type_of(j, where);
  if (type == "Sequence") {
    return std::make_unique<DecoderSequence>(make_parts<Decoder>(j, where, "decoders", [&](const nlohmann::json& part, const std::string& w) {
      return make_decoder(part, w, byte_level_vocab);
    }));
  }
  if (type == "ByteLevel") {
    if (!byte_level_vocab) throw UserError(where + ": a ByteLevel decoder needs a ByteLevel pre-tokenizer (hf-json does not support the mix)");
    return std::make_unique<Identity>();
  }
  if (type == "Replace") return std::make_unique<Replace>(j, where);
  if (type == "ByteFallback") return std::make_unique<ByteFallback>();
  if (type == "Fuse") return std::make_unique<Fuse>();
  if (type == "Strip") return std::make_unique<Strip>(j, where);
  if (type == "Metaspace") return std::make_unique<MetaspaceDecoder>(j, where);
  throw UserError(where + ": unsupported decoder type \"" + type +
                  "\" (hf-json supports Sequence, ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace)");
}

const std::vector<std::string>& byte_level_chars() {
  // GPT-2: printable Latin-1 bytes stand for themselves; the other 68 bytes map to U+0100 onwards.
  static const std::vector<std::string> table = [] {
    std::vector<std::string> t(256);
    auto utf8 = [](std::uint32_t cp) {
      std::string s;
      if (cp < 0x80) s.push_back(static_cast<char>(cp));
      else {
        s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
        s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
      }
      return s;
    };
    std::uint32_t next = 256;
    for (std::uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t[b] = utf8(printable ? b : next++);
    }
    return t;
  }();
  return table;
}

std::optional<std::string> from_byte_level(std::string_view token) {
  // The alphabet's code points are all below U+0144: one array lookup per character.
  static const std::vector<int> reverse = [] {
    std::vector<int> r(0x200, -1);
    const auto& t = byte_level_chars();
    for (int b = 0; b < 256; ++b) {
      const auto& s = t[static_cast<std::size_t>(b)];
      const std::uint32_t cp = s.size() == 1 ? static_cast<unsigned char>(s[0])
                                             : ((static_cast<unsigned char>(s[0]) & 0x1Fu) << 6) | (static_cast<unsigned char>(s[1]) & 0x3Fu);
      r[cp] = b;
    }
    return r;
  }();
  std::string out;
  out.reserve(token.size());
  for (std::size_t at = 0; at < token.size();) {
    const auto c = static_cast<unsigned char>(token[at]);
    std::uint32_t cp;
    if (c < 0x80) {
      cp = c;
      at += 1;
    } else if ((c & 0xE0) == 0xC0 && at + 1 < token.size()) {
      cp = ((c & 0x1Fu) << 6) | (static_cast<unsigned char>(token[at + 1]) & 0x3Fu);
      at += 2;
    } else {
      return std::nullopt;  // three- and four-byte characters are outside the alphabet
    }
    if (cp >= reverse.size() || reverse[cp] < 0) return std::nullopt;
    out.push_back(static_cast<char>(reverse[cp]));
  }
  return out;
}

}  // namespace loom::hf
