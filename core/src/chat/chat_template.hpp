#pragma once
// Conversations rendered with a model's chat template, as transformers' apply_chat_template
// renders them, and the parts of the text the loss is taken on (the assistant's turns).
#include <cstddef>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/formats/jinja.hpp"
#include "loom/tokenizer.hpp"

namespace loom::core {

// A conversation as a data line holds it: HF/OpenAI `messages` ({role, content, ...}), with the
// `tools` and `documents` a template may print (null when the line has none).
struct Conversation {
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  nlohmann::ordered_json tools;
  nlohmann::ordered_json documents;
};

struct RenderedChat {
  std::string text;
  // [begin, end) bytes of `text` written for the assistant's turns, in order.
  std::vector<std::pair<std::size_t, std::size_t>> assistant_spans;
};

class ChatTemplate {
 public:
  // `variables`: a JSON object every render sees besides the conversation (the tokenizer's
  // special tokens; [data] template_variables). `name` names the template in errors.
  ChatTemplate(const std::string& source, std::string name, nlohmann::ordered_json variables);

  // apply_chat_template(messages, tools=, documents=, add_generation_prompt=) as text.
  std::string render(const Conversation& conversation, bool add_generation_prompt) const;

  // The whole conversation and where its assistant turns are. A template with {% generation %}
  // blocks marks them itself (as return_assistant_tokens_mask reads them); otherwise each
  // assistant message's part is what rendering through it adds to the prompt before it (rendered
  // with add_generation_prompt), which takes in its end-of-turn token. A template that renders
  // earlier turns differently once later ones follow cannot be split that way: a UserError says so.
  RenderedChat render_for_training(const Conversation& conversation) const;

  const std::string& name() const { return template_.name(); }

 private:
  nlohmann::ordered_json context(const Conversation& conversation, bool add_generation_prompt) const;

  formats::jinja::Template template_;
  nlohmann::ordered_json variables_;
};

// The tokenizer's chat template `name` ("" for its default) with its special tokens as variables,
// or, when `file` is not empty, the template in that file (the tokenizer's special tokens still
// apply). UserError when the tokenizer carries no template (or none of that name) and no file is
// given. `extra` adds variables (e.g. date_string; [data] template_variables), over the tokenizer's.
ChatTemplate chat_template_for(const Tokenizer& tokenizer, const std::string& name, const std::filesystem::path& file,
                               const std::map<std::string, std::string>& extra = {});

}  // namespace loom::core
