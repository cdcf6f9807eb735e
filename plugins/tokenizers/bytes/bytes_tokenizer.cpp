// Tokenizer plugin `bytes`: one token per byte plus BOS, EOS and PAD. Needs no files, so the
// quickstart and the tests run with nothing downloaded; any byte string encodes and decodes back.
#include "loom/error.hpp"
#include "loom/plugin.hpp"
#include "loom/tokenizer.hpp"

namespace loom::bytes_tokenizer {
namespace {

constexpr std::int64_t kBos = 256;
constexpr std::int64_t kEos = 257;
constexpr std::int64_t kPad = 258;
constexpr std::int64_t kVocab = 259;

std::vector<OptionSpec> options() { return {}; }  // only the options every tokenizer takes

class BytesTokenizer final : public Tokenizer {
 public:
  explicit BytesTokenizer(const Options& o)
      : add_bos_(o.get_bool("add_bos")), add_eos_(o.get_bool("add_eos")), pad_left_(o.get_string("padding_side") == "left") {
    const auto& pad = o.get("pad_token");
    if (const auto* id = std::get_if<std::int64_t>(&pad)) {
      if (*id < 0 || *id >= kVocab)
        throw UserError("pad_token = " + std::to_string(*id) + " is not a token id (0.." + std::to_string(kVocab - 1) + ")");
      pad_ = *id;
    } else {
      const auto& name = std::get<std::string>(pad);
      if (name == "pad") pad_ = kPad;
      else if (name == "eos") pad_ = kEos;
      else if (name == "bos") pad_ = kBos;
      else throw UserError("pad_token = \"" + name + "\": use \"pad\", \"eos\", \"bos\" or a token id");
    }
  }

  Encoding encode(std::string_view text, Specials specials) const override {
    const bool bos = specials != Specials::kNone && add_bos_, eos = specials == Specials::kSample && add_eos_;
    Encoding e;
    e.ids.reserve(text.size() + 2);
    e.offsets.reserve(text.size() + 2);
    if (bos) {
      e.ids.push_back(kBos);
      e.offsets.emplace_back(0, 0);
    }
    for (std::size_t i = 0; i < text.size(); ++i) {
      e.ids.push_back(static_cast<unsigned char>(text[i]));
      e.offsets.emplace_back(i, i + 1);
    }
    if (eos) {
      e.ids.push_back(kEos);
      e.offsets.emplace_back(text.size(), text.size());
    }
    return e;
  }

  std::string decode(const std::vector<std::int64_t>& ids, bool skip_special) const override {
    std::string out;
    out.reserve(ids.size());
    for (auto id : ids) {
      if (id >= 0 && id < 256) {
        out.push_back(static_cast<char>(id));
      } else if (id >= 256 && id < kVocab) {
        if (!skip_special) out += id == kBos ? "<s>" : id == kEos ? "</s>" : "<pad>";
      } else {
        throw UserError("token id " + std::to_string(id) + " is outside the bytes vocabulary (0.." + std::to_string(kVocab - 1) + ")");
      }
    }
    return out;
  }

  std::int64_t vocab_size() const override { return kVocab; }
  SpecialTokens special_tokens() const override { return {kBos, kEos, pad_, std::nullopt}; }
  bool pad_left() const override { return pad_left_; }

 private:
  bool add_bos_, add_eos_, pad_left_;
  std::int64_t pad_ = kPad;
};

std::unique_ptr<Plugin> create(const Options& o) { return std::make_unique<BytesTokenizer>(o); }

}  // namespace
}  // namespace loom::bytes_tokenizer

LOOM_PLUGIN(loom::kKindTokenizer, "bytes", "0.1.0", "one token per byte plus BOS/EOS/PAD; no files needed",
            loom::bytes_tokenizer::options, loom::bytes_tokenizer::create)
