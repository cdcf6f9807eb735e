// The BPE model of hf-json: vocabulary and merges from tokenizer.json, checked for consistency,
// and a merge loop that is linear-ish in word length (a heap for long words, a word cache).
#include <algorithm>
#include <climits>
#include <cstdio>
#include <functional>
#include <queue>
#include <string_view>
#include <unordered_set>
#include <vector>

#include <nlohmann/json.hpp>

#include "hf_tokenizer.hpp"
#include "loom/error.hpp"

namespace loom::hf {
namespace {

constexpr std::size_t kCacheWords = 1 << 16;   // cleared when full
constexpr std::size_t kCachedWordBytes = 256;  // longer words are not cached
constexpr std::size_t kHeapFrom = 48;          // symbols; shorter words use a plain scan

std::uint64_t pair_key(std::int32_t a, std::int32_t b) { return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b); }

const std::string kWordStart = "\u2581";  // SentencePiece's space

// Token text as the file writes it -> id, for reading the merges (three lookups each, half a
// million merges in a large file): open addressing over views into the parsed file, one slot
// array and no node per entry, where std::unordered_map's chains cost a cache miss per hop.
class TextIds {
 public:
  explicit TextIds(std::size_t entries) {
    std::size_t capacity = 16;
    while (capacity < entries * 2) capacity *= 2;
    slots_.resize(capacity);
    mask_ = capacity - 1;
  }
  // The first id given for `text` stays.
  void insert(std::string_view text, std::int32_t id) {
    const std::size_t hash = std::hash<std::string_view>{}(text);
    for (std::size_t at = hash & mask_;; at = (at + 1) & mask_) {
      Slot& slot = slots_[at];
      if (slot.id < 0) {
        slot = Slot{hash, text, id};
        return;
      }
      if (slot.hash == hash && slot.text == text) return;
    }
  }
  const std::int32_t* find(std::string_view text) const {
    const std::size_t hash = std::hash<std::string_view>{}(text);
    for (std::size_t at = hash & mask_;; at = (at + 1) & mask_) {
      const Slot& slot = slots_[at];
      if (slot.id < 0) return nullptr;
      if (slot.hash == hash && slot.text == text) return &slot.id;
    }
  }

 private:
  struct Slot {
    std::size_t hash = 0;
    std::string_view text;
    std::int32_t id = -1;
  };
  std::vector<Slot> slots_;
  std::size_t mask_ = 0;
};

}  // namespace

Bpe::Bpe(const nlohmann::json& model, bool byte_level, const std::string& where) : byte_level_(byte_level) {
  const std::string type = field(model, where, "type").string_or("BPE");  // old files omit it for BPE
  if (type != "BPE")
    throw UserError(where + ": unsupported model type \"" + type + "\" (hf-json reads BPE models; WordPiece and Unigram are not supported)");
  if (field(model, where, "dropout").number_or(0) > 0)
    throw UserError(where + ".dropout: BPE dropout is for training a tokenizer; hf-json encodes deterministically (set it to null)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const auto affix = field(model, where, key).string_or(""); !affix.empty())
      throw UserError(where + "." + key + " = " + json_quote(affix) + " is not supported by hf-json (only empty or null)");
  ignore_merges_ = field(model, where, "ignore_merges").boolean_or(false);
  byte_fallback_ = field(model, where, "byte_fallback").boolean_or(false);
  fuse_unk_ = field(model, where, "fuse_unk").boolean_or(false);

  const auto vocab = model.find("vocab");
  if (vocab == model.end() || !vocab->is_object()) throw UserError(where + ".vocab must be an object of token -> id");
  vocab_.reserve(vocab->size());
  // Merges name tokens as the file writes them: they are looked up by that text (views into the
  // parsed file), with no byte-level conversion per merge.
  TextIds by_text(vocab->size());
  std::vector<const std::string*> owner;
  std::unordered_set<std::string> literal_keys;  // keys of literal entries (see below)
  for (const auto& [token, id_json] : vocab->items()) {
    if (!id_json.is_number_integer() || id_json.get<std::int64_t>() < 0 || id_json.get<std::int64_t>() >= INT32_MAX)
      throw UserError(where + ".vocab[" + json_quote(token) + "]: expected an id from 0 to " + std::to_string(INT32_MAX - 1) + ", found " + kit::json::describe(id_json));
    const auto id = static_cast<std::int32_t>(id_json.get<std::int64_t>());
    std::string key = token;
    bool literal = false;  // a byte-level vocabulary's entry outside the byte alphabet keeps its text; no merge builds it
    if (byte_level_) {
      if (auto raw = from_byte_level(token)) key = std::move(*raw);
      else literal = true;
    }
    if (static_cast<std::size_t>(id) >= tokens_.size()) {
      if (static_cast<std::size_t>(id) > vocab->size() * 4 + 1024)
        throw UserError(where + ".vocab[" + json_quote(token) + "]: id " + std::to_string(id) + " is far past the vocabulary's " +
                        std::to_string(vocab->size()) + " entries");
      tokens_.resize(static_cast<std::size_t>(id) + 1);
      present_.resize(static_cast<std::size_t>(id) + 1, false);
      owner.resize(static_cast<std::size_t>(id) + 1, nullptr);
    }
    if (owner[static_cast<std::size_t>(id)])
      throw UserError(where + ".vocab: id " + std::to_string(id) + " is given to both " + json_quote(*owner[static_cast<std::size_t>(id)]) + " and " +
                      json_quote(token));
    auto [entry, inserted] = vocab_.emplace(key, id);
    if (!inserted) {
      // Aya's and Command R's byte-level vocabularies also hold emoji as plain text, the same bytes
      // as an entry in the byte alphabet. BPE only ever builds the latter, so it keeps the key; the
      // literal one stays decodable by its id.
      const bool existing_literal = literal_keys.count(key) != 0;
      if (literal == existing_literal) throw UserError(where + ".vocab: " + json_quote(token) + " appears twice");
      if (existing_literal) {
        entry->second = id;
        literal_keys.erase(key);
      }
    } else if (literal) {
      literal_keys.insert(key);
    }
    tokens_[static_cast<std::size_t>(id)] = key;
    present_[static_cast<std::size_t>(id)] = true;
    owner[static_cast<std::size_t>(id)] = &entry->first;
    by_text.insert(token, id);
  }

  std::fill(std::begin(byte_ids_), std::end(byte_ids_), -1);
  for (int b = 0; b < 256; ++b) {
    if (byte_level_) {
      const auto it = vocab_.find(std::string(1, static_cast<char>(b)));
      if (it == vocab_.end())
        throw UserError(where + ".vocab: a byte-level vocabulary needs a token for every byte; byte 0x" + [&] {
          char hex[3];
          std::snprintf(hex, sizeof hex, "%02X", b);
          return std::string(hex);
        }() + " (" + json_quote(byte_level_chars()[static_cast<std::size_t>(b)]) + ") has none");
      byte_ids_[b] = it->second;
    } else if (byte_fallback_) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      if (const auto it = vocab_.find(name); it != vocab_.end()) byte_ids_[b] = it->second;
    }
  }

  if (const auto unk_token = field(model, where, "unk_token").opt_string()) {
    const auto& unk = *unk_token;
    const auto it = vocab_.find(unk);
    if (it == vocab_.end()) throw UserError(where + ".unk_token " + json_quote(unk) + " is not in the vocabulary");
    unk_ = it->second;
  }

  const auto merges = model.find("merges");
  if (merges == model.end() || !merges->is_array()) throw UserError(where + ".merges must be a list");
  merges_.reserve(merges->size());
  std::string joined;
  for (std::size_t i = 0; i < merges->size(); ++i) {
    const auto& m = (*merges)[i];
    std::string_view left, right;
    if (m.is_string()) {
      const std::string& text = m.get_ref<const std::string&>();
      const auto space = text.find(' ');
      if (space == std::string::npos || text.find(' ', space + 1) != std::string::npos)
        throw UserError(where + ".merges[" + std::to_string(i) + "] " + json_quote(text) + ": a merge is two tokens separated by one space");
      left = std::string_view(text).substr(0, space);
      right = std::string_view(text).substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get_ref<const std::string&>();
      right = m[1].get_ref<const std::string&>();
    } else {
      throw UserError(where + ".merges[" + std::to_string(i) + "]: a merge is \"a b\" or [\"a\", \"b\"], found " + kit::json::describe(m));
    }
    const auto shown = [&] { return json_quote(std::string(left) + " " + std::string(right)); };
    const std::int32_t *a_id = by_text.find(left), *b_id = by_text.find(right);
    for (const auto& [id, part] : {std::pair{a_id, left}, std::pair{b_id, right}})
      if (id == nullptr)
        throw UserError(where + ".merges[" + std::to_string(i) + "] " + shown() + ": " + json_quote(std::string(part)) + " is not in the vocabulary");
    joined.assign(left).append(right);
    const std::int32_t* merged = by_text.find(joined);
    if (merged == nullptr)
      throw UserError(where + ".merges[" + std::to_string(i) + "] " + shown() + ": the merged token " + json_quote(joined) + " is not in the vocabulary");
    merges_[pair_key(*a_id, *b_id)] = Merge{static_cast<std::int32_t>(i), *merged};  // a repeated pair keeps its last rank, as HF does
  }

  // SentencePiece-style files have no pre-tokenizer, so a whole line is one "word". A merge can
  // join a character c with a following "▁" (SentencePiece's space) only if some token holds "c▁".
  // For every other c, the line can be cut before a "▁" that follows c and merged piece by piece,
  // through the cache, with the same result. Nearly all tokens hold "▁" only at their start; the
  // few characters that do precede one inside a token (Gemma 3's ">▁</", InternLM2's "\t▁") are
  // collected here, and the line is not cut after them. A character with no token of its own
  // starts as byte tokens ("<0xE2>") or as unk, so it joins a "▁" if the last character of those
  // does. "▁" must be a token itself, or an unknown "▁" could fuse with an unknown character.
  if (!byte_level_ && !ignore_merges_ && vocab_.count(kWordStart) != 0) {
    split_at_word_starts_ = true;
    for (const auto& t : tokens_)
      for (std::size_t at = t.find(kWordStart, 1); at != std::string::npos; at = t.find(kWordStart, at + 1)) {
        const std::size_t c = char_start_before(t, at);
        if (t.compare(c, at - c, kWordStart) != 0) joined_to_word_start_.emplace(t, c, at - c);
      }
    const auto joins = [&](const std::string& symbol) {
      return !symbol.empty() && joined_to_word_start_.count(symbol.substr(char_start_before(symbol, symbol.size()))) != 0;
    };
    unknown_joins_word_start_ = (byte_fallback_ && joins(">")) || (unk_ && joins(tokens_[static_cast<std::size_t>(*unk_)]));
  }
}

const std::string* Bpe::token(std::int64_t id) const {
  if (id < 0 || static_cast<std::size_t>(id) >= tokens_.size() || !present_[static_cast<std::size_t>(id)]) return nullptr;
  return &tokens_[static_cast<std::size_t>(id)];
}

std::optional<std::int32_t> Bpe::id_of(const std::string& token) const {
  const auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const Bpe::Merge* Bpe::merge_of(std::int32_t left, std::int32_t right) const {
  const auto it = merges_.find(pair_key(left, right));
  return it == merges_.end() ? nullptr : &it->second;
}

void Bpe::initial_symbols(std::string_view word, std::vector<Piece>& out) const {
  if (byte_level_) {
    for (std::size_t i = 0; i < word.size(); ++i)
      out.push_back({byte_ids_[static_cast<unsigned char>(word[i])], static_cast<std::uint32_t>(i), static_cast<std::uint32_t>(i + 1)});
    return;
  }
  bool previous_unk = false;
  for (std::size_t at = 0; at < word.size();) {
    const std::size_t len = std::min(utf8_length(static_cast<unsigned char>(word[at])), word.size() - at);
    const auto b = static_cast<std::uint32_t>(at), e = static_cast<std::uint32_t>(at + len);
    const auto it = vocab_.find(std::string(word.substr(at, len)));
    at += len;
    if (it != vocab_.end()) {
      out.push_back({it->second, b, e});
      previous_unk = false;
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (std::uint32_t k = b; k < e; ++k) all = all && byte_ids_[static_cast<unsigned char>(word[k])] >= 0;
      if (all) {
        for (std::uint32_t k = b; k < e; ++k) out.push_back({byte_ids_[static_cast<unsigned char>(word[k])], k, k + 1});
        previous_unk = false;
        continue;
      }
    }
    if (!unk_)
      throw UserError("the character " + json_quote(std::string(word.substr(b, len))) +
                      " has no token in this vocabulary and the tokenizer has no unk_token to stand for it");
    if (fuse_unk_ && previous_unk) out.back().end = e;
    else out.push_back({*unk_, b, e});
    previous_unk = true;
  }
}

void Bpe::merge_word(std::string_view word, std::vector<Piece>& out) const {
  std::vector<Piece> sym;
  sym.reserve(word.size());
  initial_symbols(word, sym);
  const auto n = static_cast<std::int32_t>(sym.size());
  std::vector<std::int32_t> next(static_cast<std::size_t>(n)), prev(static_cast<std::size_t>(n));
  for (std::int32_t i = 0; i < n; ++i) {
    next[static_cast<std::size_t>(i)] = i + 1 < n ? i + 1 : -1;
    prev[static_cast<std::size_t>(i)] = i - 1;
  }
  std::vector<bool> alive(static_cast<std::size_t>(n), true);
  auto merge_at = [&](std::int32_t left, const Merge& m) {
    const auto right = next[static_cast<std::size_t>(left)];
    auto& l = sym[static_cast<std::size_t>(left)];
    l.id = m.result;
    l.end = sym[static_cast<std::size_t>(right)].end;
    alive[static_cast<std::size_t>(right)] = false;
    next[static_cast<std::size_t>(left)] = next[static_cast<std::size_t>(right)];
    if (next[static_cast<std::size_t>(right)] >= 0) prev[static_cast<std::size_t>(next[static_cast<std::size_t>(right)])] = left;
  };

  if (static_cast<std::size_t>(n) < kHeapFrom) {
    // Lowest rank first; among equal ranks (the same pair twice) the leftmost.
    while (true) {
      std::int32_t best = -1;
      const Merge* best_merge = nullptr;
      for (std::int32_t i = 0; i >= 0 && next[static_cast<std::size_t>(i)] >= 0; i = next[static_cast<std::size_t>(i)]) {
        const Merge* m = merge_of(sym[static_cast<std::size_t>(i)].id, sym[static_cast<std::size_t>(next[static_cast<std::size_t>(i)])].id);
        if (m && (!best_merge || m->rank < best_merge->rank)) {
          best = i;
          best_merge = m;
        }
      }
      if (!best_merge) break;
      merge_at(best, *best_merge);
    }
  } else {
    struct Entry {
      std::int32_t rank, left, right;
      bool operator>(const Entry& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
    };
    std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
    auto push = [&](std::int32_t left) {
      if (left < 0) return;
      const auto right = next[static_cast<std::size_t>(left)];
      if (right < 0) return;
      if (const Merge* m = merge_of(sym[static_cast<std::size_t>(left)].id, sym[static_cast<std::size_t>(right)].id)) heap.push({m->rank, left, right});
    };
    for (std::int32_t i = 0; i + 1 < n; ++i) push(i);
    while (!heap.empty()) {
      const Entry e = heap.top();
      heap.pop();
      // Stale entries: a side was merged away, or the pair changed since it was pushed.
      if (!alive[static_cast<std::size_t>(e.left)] || next[static_cast<std::size_t>(e.left)] != e.right) continue;
      const Merge* m = merge_of(sym[static_cast<std::size_t>(e.left)].id, sym[static_cast<std::size_t>(e.right)].id);
      if (!m || m->rank != e.rank) continue;
      merge_at(e.left, *m);
      push(prev[static_cast<std::size_t>(e.left)]);
      push(e.left);
    }
  }
  for (std::int32_t i = 0; i >= 0 && i < n; i = next[static_cast<std::size_t>(i)]) out.push_back(sym[static_cast<std::size_t>(i)]);
}

void Bpe::encode(std::string_view word, std::vector<Piece>& out) const {
  if (word.empty()) return;
  if (split_at_word_starts_ && word.size() > kWordStart.size()) {
    // Before each "▁" whose preceding character no token joins to it (a run of "▁" stays whole).
    std::size_t start = 0;
    for (std::size_t at = word.find(kWordStart, 1); at != std::string_view::npos; at = word.find(kWordStart, at + kWordStart.size())) {
      const std::size_t c = char_start_before(word, at);
      const std::string_view before = word.substr(c, at - c);
      if (before == kWordStart || joined_to_word_start_.count(before) != 0) continue;
      if (unknown_joins_word_start_ && vocab_.count(std::string(before)) == 0) continue;
      encode_piece(word.substr(start, at - start), static_cast<std::uint32_t>(start), out);
      start = at;
    }
    encode_piece(word.substr(start), static_cast<std::uint32_t>(start), out);
    return;
  }
  encode_piece(word, 0, out);
}

void Bpe::encode_piece(std::string_view word, std::uint32_t shift, std::vector<Piece>& out) const {
  if (ignore_merges_) {
    if (const auto it = vocab_.find(std::string(word)); it != vocab_.end()) {
      out.push_back({it->second, shift, shift + static_cast<std::uint32_t>(word.size())});
      return;
    }
  }
  const bool cacheable = word.size() <= kCachedWordBytes;
  std::string key;
  if (cacheable) {
    key.assign(word);
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (const auto it = cache_.find(key); it != cache_.end()) {
      for (const auto& p : it->second) out.push_back({p.id, p.begin + shift, p.end + shift});
      return;
    }
  }
  const std::size_t first = out.size();
  merge_word(word, out);
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cache_.size() >= kCacheWords) cache_.clear();
    cache_.emplace(std::move(key), std::vector<Piece>(out.begin() + static_cast<std::ptrdiff_t>(first), out.end()));
  }
  for (auto it = out.begin() + static_cast<std::ptrdiff_t>(first); it != out.end(); ++it) {
    it->begin += shift;
    it->end += shift;
  }
}

}  // namespace loom::hf
