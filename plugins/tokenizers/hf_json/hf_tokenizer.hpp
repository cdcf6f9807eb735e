// Internals of the `hf-json` tokenizer plugin: a reader of Hugging Face `tokenizer.json` files
// that produces the ids the `tokenizers` library produces. Pieces, in the order encode() uses them:
// added tokens, normalizers, pre-tokenizers, the BPE model, the post-processor's special tokens;
// decode() runs the file's decoders.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "loom/kit/json.hpp"
#include "loom/kit/regex.hpp"
#include "loom/kit/utf8.hpp"

namespace loom::hf {

using Span = std::pair<std::size_t, std::size_t>;  // [begin, end) bytes of the caller's text

using kit::invalid_utf8_at;
// Bytes of the UTF-8 character that starts with `lead`.
inline std::size_t utf8_length(unsigned char lead) { return lead < 0x80 ? 1 : lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2; }
// Start of the UTF-8 character that ends just before byte `at` (> 0).
inline std::size_t char_start_before(std::string_view text, std::size_t at) {
  std::size_t i = at - 1;
  while (i > 0 && (static_cast<unsigned char>(text[i]) & 0xC0) == 0x80) --i;
  return i;
}
// `s` as a JSON string, for messages (bytes that are not UTF-8 shown as U+FFFD; long ones cut).
std::string json_quote(const std::string& s);
// Member `key` of the component object `j` found at `where`, for typed reads (loom/json.hpp).
inline kit::json::Value field(const nlohmann::json& j, const std::string& where, const char* key) { return kit::json::Value::inside(j, where)[key]; }

// Text derived from the caller's input, knowing for each of its bytes which input bytes it came
// from, so that token offsets point into what the caller passed. Identity (no maps) until a
// normalizer or pre-tokenizer changes the bytes.
struct Aligned {
  std::string text;
  std::size_t base = 0;                     // identity: text[i] came from input[base + i]
  std::vector<std::uint32_t> begins, ends;  // otherwise: text[i] came from input[begins[i], ends[i])

  bool identity() const { return begins.empty(); }
  Span origin(std::size_t first, std::size_t last) const;  // input span of text[first, last), last > first
  Span origin_point(std::size_t at) const;                 // an empty input span where text[at] sits
  Aligned slice(std::size_t first, std::size_t last) const;
  // Replaces the bytes [first, last) (possibly empty) by `with`, whose bytes all come from the
  // input span those bytes came from (or the point where an empty range sits).
  struct Edit {
    std::size_t first, last;
    std::string with;
  };
  void apply(const std::vector<Edit>& edits);  // edits sorted, not overlapping

 private:
  void make_explicit();
};

// A `pattern` object of a tokenizer file: {"String": s} (literal) or {"Regex": r}.
class Pattern {
 public:
  explicit Pattern(const nlohmann::json& j, const std::string& where);
  std::vector<Span> find_all(std::string_view text) const;
  // Edits that put `with` in place of every match.
  std::vector<Aligned::Edit> replacements(std::string_view text, const std::string& with) const;

 private:
  std::string literal_;
  std::shared_ptr<kit::Regex> regex_;
};

// The "type" of a component object; `where` names it in the error when there is none.
std::string type_of(const nlohmann::json& j, const std::string& where);

// The parts of a Sequence component: make(list[i], "where.key[i]") for each, nulls dropped.
template <class Part, class Json, class Make>
std::vector<std::unique_ptr<Part>> make_parts(const Json& j, const std::string& where, const char* key, Make make) {
  std::vector<std::unique_ptr<Part>> parts;
  const auto& list = field(j, where, key).array();
  for (std::size_t i = 0; i < list.size(); ++i)
    if (auto p = make(list[i], where + "." + key + "[" + std::to_string(i) + "]")) parts.push_back(std::move(p));
  return parts;
}

// Unicode White_Space (Rust's char::is_whitespace, the \s of HF's regexes): the end of the run
// of it that starts at `from` (not past `limit`), and the start of the run that ends at `to` (not
// before `floor`, a character boundary).
std::size_t skip_whitespace(std::string_view text, std::size_t from, std::size_t limit);
std::size_t skip_whitespace_back(std::string_view text, std::size_t to, std::size_t floor);

// Normalizers and pre-tokenizers, as one tree each.
class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void normalize(Aligned& text) const = 0;
};
std::unique_ptr<Normalizer> make_normalizer(const nlohmann::json& j, const std::string& where);  // null json -> nullptr

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Splits (and may rewrite) each piece.
  virtual void split(std::vector<Aligned>& pieces) const = 0;
  virtual bool byte_level() const { return false; }  // uses the GPT-2 byte alphabet
};
std::unique_ptr<PreTokenizer> make_pre_tokenizer(const nlohmann::json& j, const std::string& where);

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void decode(std::vector<std::string>& tokens) const = 0;
};
std::unique_ptr<Decoder> make_decoder(const nlohmann::json& j, const std::string& where, bool byte_level_vocab);

// GPT-2's byte <-> printable code point table that byte-level vocabularies are written in.
const std::vector<std::string>& byte_level_chars();          // byte -> UTF-8 of its code point
std::optional<std::string> from_byte_level(std::string_view token);  // nullopt: not in the alphabet

// The BPE model. Byte-level vocabularies are kept as raw bytes, so words are merged from bytes
// and decoding is concatenation.
class Bpe {
 public:
  Bpe(const nlohmann::json& model, bool byte_level, const std::string& where);
  struct Piece {
    std::int32_t id;
    std::uint32_t begin, end;  // bytes of the word
  };
  // Appends the tokens of one pre-tokenized word.
  void encode(std::string_view word, std::vector<Piece>& out) const;
  const std::string* token(std::int64_t id) const;  // nullptr when no vocabulary entry has this id
  std::optional<std::int32_t> id_of(const std::string& token) const;
  std::int64_t size() const { return static_cast<std::int64_t>(tokens_.size()); }

 private:
  struct Merge {
    std::int32_t rank, result;
  };
  void encode_piece(std::string_view word, std::uint32_t shift, std::vector<Piece>& out) const;  // spans + shift
  void merge_word(std::string_view word, std::vector<Piece>& out) const;
  void initial_symbols(std::string_view word, std::vector<Piece>& out) const;
  const Merge* merge_of(std::int32_t left, std::int32_t right) const;

  bool byte_level_;
  bool ignore_merges_ = false, byte_fallback_ = false, fuse_unk_ = false;
  bool split_at_word_starts_ = false;  // see the constructor
  std::set<std::string, std::less<>> joined_to_word_start_;  // characters some token holds just before a "▁"
  bool unknown_joins_word_start_ = false;                     // a character with no token may join a "▁"
  std::optional<std::int32_t> unk_;
  std::unordered_map<std::string, std::int32_t> vocab_;
  std::vector<std::string> tokens_;  // by id
  std::vector<bool> present_;        // ids the vocabulary gives out (it may skip some)
  std::unordered_map<std::uint64_t, Merge> merges_;
  std::int32_t byte_ids_[256];  // byte-level: each byte's token; byte_fallback: <0xXX>, or -1
  // Words seen before, with their tokens. Bounded; cleared when full.
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<Piece>> cache_;
};

struct AddedToken {
  std::string content;
  std::string pattern;  // what is matched: the content, normalized when `normalized`
  std::int64_t id = 0;
  bool special = false, single_word = false, lstrip = false, rstrip = false, normalized = true;
};

// Finds added tokens in text: leftmost, then longest, honouring single_word / lstrip / rstrip.
class AddedMatcher {
 public:
  void add(const AddedToken* token);
  bool empty() const { return nodes_.size() <= 1; }
  struct Match {
    std::size_t begin, end;
    const AddedToken* token;
  };
  std::vector<Match> find_all(std::string_view text) const;

 private:
  struct Node {
    std::unordered_map<unsigned char, std::uint32_t> next;
    const AddedToken* token = nullptr;
  };
  std::vector<Node> nodes_{Node{}};
  bool starts_[256] = {};  // bytes some token starts with
};

// Everything a tokenizer.json (+ tokenizer_config.json) describes.
class HfTokenizer {
 public:
  // `path`: a tokenizer.json file, or a folder holding one (and maybe tokenizer_config.json).
  explicit HfTokenizer(const std::filesystem::path& path);

  struct Encoded {
    std::vector<std::int64_t> ids;
    std::vector<Span> offsets;
  };
  // The text's tokens, with `prefix` / `suffix` special ids around them.
  Encoded encode(std::string_view text, const std::vector<std::int64_t>& prefix, const std::vector<std::int64_t>& suffix) const;
  std::string decode(const std::vector<std::int64_t>& ids, bool skip_special) const;

  std::int64_t vocab_size() const { return vocab_size_; }
  std::optional<std::int64_t> token_id(const std::string& token) const;
  // The post-processor's special tokens around a single sequence (TemplateProcessing), or the
  // config's add_bos_token / add_eos_token when the file has no template.
  const std::vector<std::int64_t>& template_prefix() const { return prefix_; }
  const std::vector<std::int64_t>& template_suffix() const { return suffix_; }
  // tokenizer_config.json's bos/eos/pad/unk tokens, when it names them.
  std::optional<std::int64_t> bos, eos, pad, unk;
  // The chat templates (name, Jinja source), the default first: chat_template.jinja beside the
  // file, else tokenizer_config.json's chat_template (a string, or [{"name", "template"}]).
  std::vector<std::pair<std::string, std::string>> chat_templates;
  // The special tokens' text as a template sees them, a JSON object (transformers' special_tokens_map).
  std::string chat_template_variables = "{}";

 private:
  void load(const std::string& tokenizer_json, const std::string& config_json);
  void encode_segment(std::string_view input, std::size_t base, Encoded& out) const;
  void encode_normalized(const Aligned& text, Encoded& out) const;

  std::string source_;  // for messages
  std::vector<AddedToken> added_;
  std::unordered_map<std::int64_t, const AddedToken*> added_by_id_;
  AddedMatcher raw_matcher_, normalized_matcher_;
  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<Bpe> model_;
  std::unique_ptr<Decoder> decoder_;
  std::vector<std::int64_t> prefix_, suffix_;
  std::int64_t vocab_size_ = 0;
};

}  // namespace loom::hf
