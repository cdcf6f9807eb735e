// hf-json: reading tokenizer.json and tokenizer_config.json, added tokens, encode and decode.
#include "hf_tokenizer.hpp"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "loom/error.hpp"
#include "loom/kit/utf8.hpp"

namespace loom::hf {
namespace fs = std::filesystem;
namespace {

constexpr std::uintmax_t kMaxFileBytes = std::uintmax_t{256} << 20;  // the largest real tokenizer.json files are ~35 MB

// A tokenizer_config.json special token: "text", {"content": "text", ...} or null.
std::optional<std::string> config_token(const kit::json::Value& config, const char* key) {
  const auto token = config[key];
  if (!token.present()) return std::nullopt;
  if (token.is_object()) return token["content"].string();
  if (!token.is_string()) token.expected("a token string or {\"content\": ...}");
  return token.string();
}

// Runs `read` on a parsed file; its errors, and JSON of an unexpected shape, name the file.
template <class Read>
void reading(const std::string& source, Read read) {
  try {
    read();
  } catch (const nlohmann::json::exception&) {  // a read not written with loom/json.hpp's typed getters
    throw UserError(source + ": a value has an unexpected type or shape (not a tokenizer.json hf-json can read)");
  } catch (const UserError& e) {
    throw UserError(source + ": " + e.what());
  }
}

bool is_word_char_at(std::string_view text, std::size_t at) {
  static const kit::Regex word(R"(\A\w)");
  return !word.find_all(text.substr(at)).empty();
}

}  // namespace

// ---- added tokens ----

void AddedMatcher::add(const AddedToken* token) {
  std::uint32_t node = 0;
  for (const char ch : token->pattern) {
    const auto c = static_cast<unsigned char>(ch);
    const auto it = nodes_[node].next.find(c);
    if (it != nodes_[node].next.end()) {
      node = it->second;
    } else {
      nodes_.emplace_back();
      const auto created = static_cast<std::uint32_t>(nodes_.size() - 1);
      nodes_[node].next.emplace(c, created);
      node = created;
    }
  }
  nodes_[node].token = token;
  starts_[static_cast<unsigned char>(token->pattern[0])] = true;
}

std::vector<AddedMatcher::Match> AddedMatcher::find_all(std::string_view text) const {
  std::vector<Match> out;
  if (empty()) return out;
  std::size_t previous_end = 0;
  for (std::size_t at = 0; at < text.size();) {
    if (!starts_[static_cast<unsigned char>(text[at])]) {  // most bytes start no added token
      ++at;
      continue;
    }
    // The longest token starting here (leftmost-longest, as HF's Aho-Corasick matcher).
    std::uint32_t node = 0;
    std::size_t end = 0;
    const AddedToken* found = nullptr;
    for (std::size_t i = at; i < text.size(); ++i) {
      const auto it = nodes_[node].next.find(static_cast<unsigned char>(text[i]));
      if (it == nodes_[node].next.end()) break;
      node = it->second;
      if (nodes_[node].token) {
        found = nodes_[node].token;
        end = i + 1;
      }
    }
    if (!found) {
      ++at;
      continue;
    }
    std::size_t begin = at;
    at = end;  // the next search starts after this match, kept or not
    if (found->single_word) {
      const bool word_before = begin > 0 && is_word_char_at(text, char_start_before(text, begin));
      const bool word_after = end < text.size() && is_word_char_at(text, end);
      if (word_before || word_after) continue;
    }
    if (found->lstrip) begin = skip_whitespace_back(text, begin, previous_end);
    if (found->rstrip) end = skip_whitespace(text, end, text.size());
    at = end;
    previous_end = end;
    out.push_back({begin, end, found});
  }
  return out;
}

// ---- loading ----

HfTokenizer::HfTokenizer(const fs::path& path) {
  std::error_code ec;
  fs::path file = path, config;
  if (!fs::exists(path, ec)) throw UserError(path.string() + " does not exist");
  if (fs::is_directory(path, ec)) {
    file = path / "tokenizer.json";
    if (!fs::exists(file, ec))
      throw UserError(path.string() + " has no tokenizer.json (give a Hugging Face model folder that holds one, or the file itself)");
  }
  source_ = file.string();
  config = file.parent_path() / "tokenizer_config.json";
  const std::string json = kit::without_bom(kit::read_regular_file(file, kMaxFileBytes, "tokenizer file"));
  load(json, fs::exists(config, ec) ? kit::without_bom(kit::read_regular_file(config, kMaxFileBytes, "tokenizer config")) : std::string());
  // transformers saves a model's template here since 4.43; it wins over tokenizer_config.json's.
  const fs::path jinja = file.parent_path() / "chat_template.jinja";
  if (fs::exists(jinja, ec)) {
    std::string source = kit::without_bom(kit::read_regular_file(jinja, kMaxFileBytes, "chat template"));
    auto it = std::find_if(chat_templates.begin(), chat_templates.end(), [](const auto& t) { return t.first == "default"; });
    if (it != chat_templates.end()) chat_templates.erase(it);
    chat_templates.insert(chat_templates.begin(), {"default", std::move(source)});
  }
}

void HfTokenizer::load(const std::string& tokenizer_json, const std::string& config_json) {
  const nlohmann::json root = kit::json::parse(tokenizer_json, source_);
  reading(source_, [&] {
    if (!root.is_object()) throw UserError("the top level is not an object");
    if (!root.contains("model") || !root["model"].is_object()) throw UserError("it has no \"model\" object (is this a tokenizer.json?)");
    static const nlohmann::json null_json;
    const auto component = [&](const char* key) -> const nlohmann::json& { return root.contains(key) ? root[key] : null_json; };
    pre_tokenizer_ = make_pre_tokenizer(component("pre_tokenizer"), "pre_tokenizer");
    const bool byte_level = pre_tokenizer_ && pre_tokenizer_->byte_level();
    normalizer_ = make_normalizer(component("normalizer"), "normalizer");
    model_ = std::make_unique<Bpe>(root["model"], byte_level, "model");
    decoder_ = make_decoder(component("decoder"), "decoder", byte_level);
    vocab_size_ = model_->size();

    static const nlohmann::json none = nlohmann::json::array();
    const nlohmann::json& added = root.contains("added_tokens") ? root["added_tokens"] : none;
    if (!added.is_array()) throw UserError("added_tokens must be a list");
    added_.reserve(added.size());  // the matchers keep pointers into it
    for (std::size_t i = 0; i < added.size(); ++i) {
      const auto& a = added[i];
      const std::string where = "added_tokens[" + std::to_string(i) + "]";
      if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() || !a.contains("content") || !a["content"].is_string())
        throw UserError(where + ": an added token needs an integer \"id\" and a string \"content\"");
      AddedToken t;
      t.id = a["id"].get<std::int64_t>();
      t.content = a["content"].get<std::string>();
      if (t.id < 0 || t.id >= (std::int64_t{1} << 31)) throw UserError(where + ": id " + std::to_string(t.id) + " is out of range");
      if (t.content.empty()) throw UserError(where + ": empty content");
      if (invalid_utf8_at(t.content) != std::string_view::npos) throw UserError(where + ": content is not valid UTF-8");
      t.special = field(a, where, "special").boolean_or(false);
      t.single_word = field(a, where, "single_word").boolean_or(false);
      t.lstrip = field(a, where, "lstrip").boolean_or(false);
      t.rstrip = field(a, where, "rstrip").boolean_or(false);
      t.normalized = field(a, where, "normalized").boolean_or(!t.special);
      if (added_by_id_.count(t.id)) throw UserError(where + ": id " + std::to_string(t.id) + " is given to two added tokens");
      if (const std::string* existing = model_->token(t.id); existing && *existing != t.content && !(byte_level && from_byte_level(t.content) == *existing))
        throw UserError(where + ": " + json_quote(t.content) + " has id " + std::to_string(t.id) + ", which the vocabulary gives to " + json_quote(*existing));
      added_.push_back(std::move(t));
      added_by_id_[added_.back().id] = &added_.back();
      vocab_size_ = std::max(vocab_size_, added_.back().id + 1);
    }
    for (auto& t : added_) {
      t.pattern = t.content;
      if (!t.normalized) {
        raw_matcher_.add(&t);
      } else {
        // Normalized tokens are looked for in normalized text, so they are normalized too.
        if (normalizer_) {
          Aligned content{t.content, 0, {}, {}};
          normalizer_->normalize(content);
          t.pattern = content.text;
        }
        if (!t.pattern.empty()) normalized_matcher_.add(&t);
      }
    }

    // Special tokens around a single sequence.
    std::function<void(const nlohmann::json&, const std::string&)> read_post = [&](const nlohmann::json& p, const std::string& where) {
      if (p.is_null()) return;
      const std::string type = type_of(p, where);
      const auto v = kit::json::Value::inside(p, where);
      if (type == "Sequence") {
        const auto& list = v["processors"].array();
        for (std::size_t i = 0; i < list.size(); ++i) read_post(list[i], where + ".processors[" + std::to_string(i) + "]");
      } else if (type == "TemplateProcessing") {
        const auto specials = v["special_tokens"];
        specials.object();
        const auto single = v["single"];
        bool after = false;
        for (std::size_t i = 0; i < single.array().size(); ++i) {
          const auto piece = single[i];
          if (piece.has("Sequence")) {
            after = true;
            continue;
          }
          const auto name = piece["SpecialToken"]["id"].string();
          if (!specials.has(name)) throw UserError(where + ": the template names " + json_quote(name) + ", which special_tokens does not define");
          const auto ids = specials[name]["ids"];
          for (std::size_t k = 0; k < ids.array().size(); ++k) (after ? suffix_ : prefix_).push_back(ids[k].integer(0, INT32_MAX));
        }
      } else if (type == "BertProcessing" || type == "RobertaProcessing") {
        prefix_.push_back(v["cls"][1].integer(0, INT32_MAX));
        suffix_.push_back(v["sep"][1].integer(0, INT32_MAX));
      } else if (type != "ByteLevel") {
        throw UserError(where + ": unsupported post-processor type " + json_quote(type) +
                        " (hf-json supports TemplateProcessing, ByteLevel, BertProcessing, RobertaProcessing, Sequence)");
      }
    };
    read_post(component("post_processor"), "post_processor");
    for (const auto* ids : {&prefix_, &suffix_})
      for (const auto id : *ids)
        if (id < 0 || id >= vocab_size_) throw UserError("post_processor: special token id " + std::to_string(id) + " is not in the vocabulary");
  });

  if (config_json.empty()) return;
  const std::string config_source = (fs::path(source_).parent_path() / "tokenizer_config.json").string();
  const nlohmann::json config_root = kit::json::parse(config_json, config_source);
  reading(config_source, [&] {
    if (!config_root.is_object()) throw UserError("the top level is not an object");
    const auto config = kit::json::Value::inside(config_root, "");
    auto resolve = [&](const char* key) -> std::optional<std::int64_t> {
      const auto name = config_token(config, key);
      if (!name) return std::nullopt;
      const auto id = token_id(*name);
      if (!id) throw UserError(std::string(key) + " " + json_quote(*name) + " is not a token of " + source_);
      return id;
    };
    bos = resolve("bos_token");
    eos = resolve("eos_token");
    pad = resolve("pad_token");
    unk = resolve("unk_token");
    nlohmann::json variables = nlohmann::json::object();
    for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"})
      if (const auto text = config_token(config, key)) variables[key] = *text;
    if (const auto extra = config["additional_special_tokens"]; extra.present() && extra.is_array() && extra.size() > 0) {
      nlohmann::json texts = nlohmann::json::array();
      for (std::size_t k = 0; k < extra.size(); ++k) {
        const auto token = extra[k];
        texts.push_back(token.is_object() ? token["content"].string() : token.string());
      }
      variables["additional_special_tokens"] = std::move(texts);
    }
    chat_template_variables = variables.dump();
    const auto templates = config["chat_template"];
    if (templates.is_string())
      chat_templates.emplace_back("default", templates.string());
    else if (templates.present()) {
      if (!templates.is_array()) templates.expected("a template string or a list of {\"name\", \"template\"}");
      for (std::size_t k = 0; k < templates.size(); ++k) chat_templates.emplace_back(templates[k]["name"].string(), templates[k]["template"].string());
      // the one named "default" first, as transformers picks it when no name is given
      std::stable_partition(chat_templates.begin(), chat_templates.end(), [](const auto& t) { return t.first == "default"; });
    }
    // A file without a template adds what the config says (transformers' add_bos_token / add_eos_token).
    if (prefix_.empty() && suffix_.empty()) {
      if (config["add_bos_token"].boolean_or(false) && bos) prefix_.push_back(*bos);
      if (config["add_eos_token"].boolean_or(false) && eos) suffix_.push_back(*eos);
    }
  });
}

std::optional<std::int64_t> HfTokenizer::token_id(const std::string& token) const {
  for (const auto& t : added_)
    if (t.content == token) return t.id;
  if (const auto id = model_->id_of(token)) return *id;
  if (pre_tokenizer_ && pre_tokenizer_->byte_level())
    if (const auto raw = from_byte_level(token))
      if (const auto id = model_->id_of(*raw)) return *id;
  return std::nullopt;
}

// ---- encode ----

HfTokenizer::Encoded HfTokenizer::encode(std::string_view text, const std::vector<std::int64_t>& prefix, const std::vector<std::int64_t>& suffix) const {
  if (const auto bad = invalid_utf8_at(text); bad != std::string_view::npos) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02X", static_cast<unsigned char>(text[bad]));
    throw UserError("text is not valid UTF-8: byte " + std::to_string(bad) + " (" + hex + ") does not start a valid character");
  }
  Encoded out;
  for (const auto id : prefix) {
    out.ids.push_back(id);
    out.offsets.emplace_back(0, 0);
  }
  std::size_t at = 0;
  for (const auto& m : raw_matcher_.find_all(text)) {
    if (m.begin > at) encode_segment(text.substr(at, m.begin - at), at, out);
    out.ids.push_back(m.token->id);
    out.offsets.emplace_back(m.begin, m.end);
    at = m.end;
  }
  if (at < text.size()) encode_segment(text.substr(at), at, out);
  for (const auto id : suffix) {
    out.ids.push_back(id);
    out.offsets.emplace_back(text.size(), text.size());
  }
  return out;
}

void HfTokenizer::encode_segment(std::string_view input, std::size_t base, Encoded& out) const {
  Aligned text{std::string(input), base, {}, {}};
  if (normalizer_) normalizer_->normalize(text);
  if (normalized_matcher_.empty()) {
    encode_normalized(text, out);
    return;
  }
  std::size_t at = 0;
  for (const auto& m : normalized_matcher_.find_all(text.text)) {
    if (m.begin > at) encode_normalized(text.slice(at, m.begin), out);
    out.ids.push_back(m.token->id);
    out.offsets.push_back(text.origin(m.begin, m.end));
    at = m.end;
  }
  if (at < text.text.size()) encode_normalized(text.slice(at, text.text.size()), out);
}

void HfTokenizer::encode_normalized(const Aligned& text, Encoded& out) const {
  if (text.text.empty()) return;
  std::vector<Aligned> pieces{text};
  if (pre_tokenizer_) pre_tokenizer_->split(pieces);
  std::vector<Bpe::Piece> tokens;
  for (const auto& piece : pieces) {
    tokens.clear();
    model_->encode(piece.text, tokens);
    for (const auto& t : tokens) {
      out.ids.push_back(t.id);
      out.offsets.push_back(piece.origin(t.begin, t.end));
    }
  }
}

// ---- decode ----

std::string HfTokenizer::decode(const std::vector<std::int64_t>& ids, bool skip_special) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const auto id : ids) {
    if (const auto it = added_by_id_.find(id); it != added_by_id_.end()) {
      if (!(skip_special && it->second->special)) tokens.push_back(it->second->content);
      continue;
    }
    const std::string* token = model_->token(id);
    if (!token) throw UserError("token id " + std::to_string(id) + " is not in the vocabulary of " + source_ + " (" + std::to_string(vocab_size_) + " ids)");
    tokens.push_back(*token);
  }
  if (decoder_) decoder_->decode(tokens);
  std::string text;
  for (const auto& t : tokens) text += t;
  return text;
}

}  // namespace loom::hf
