#include "chat/chat_template.hpp"

#include "loom/error.hpp"
#include "loom/kit/input_file.hpp"
#include "loom/kit/utf8.hpp"
#include "plugins/plugin_guard.hpp"

namespace loom::core {

ChatTemplate::ChatTemplate(const std::string& source, std::string name, nlohmann::ordered_json variables)
    : template_(source, std::move(name)), variables_(std::move(variables)) {
  if (!variables_.is_object()) variables_ = nlohmann::ordered_json::object();
}

nlohmann::ordered_json ChatTemplate::context(const Conversation& c, bool add_generation_prompt) const {
  // What apply_chat_template passes: messages, tools and documents (None when not given),
  // add_generation_prompt, the special tokens, then the caller's own variables.
  nlohmann::ordered_json context = nlohmann::ordered_json::object();
  context["messages"] = c.messages;
  context["tools"] = c.tools;
  context["documents"] = c.documents;
  context["add_generation_prompt"] = add_generation_prompt;
  for (const auto& [k, v] : variables_.items()) context[k] = v;
  return context;
}

std::string ChatTemplate::render(const Conversation& c, bool add_generation_prompt) const {
  return template_.render(context(c, add_generation_prompt)).text;
}

RenderedChat ChatTemplate::render_for_training(const Conversation& c) const {
  formats::jinja::Rendered whole = template_.render(context(c, false));
  RenderedChat out{std::move(whole.text), {}};
  if (template_.has_generation_blocks()) {
    out.assistant_spans = std::move(whole.generation_spans);
    return out;
  }
  Conversation upto = c;
  for (std::size_t k = 0; k < c.messages.size(); ++k) {
    const auto& message = c.messages[k];
    if (!message.is_object() || message.value("role", "") != "assistant") continue;
    upto.messages = nlohmann::ordered_json::array();
    for (std::size_t j = 0; j < k; ++j) upto.messages.push_back(c.messages[j]);
    const std::string prompt = template_.render(context(upto, true)).text;
    upto.messages.push_back(message);
    const std::string through = template_.render(context(upto, false)).text;
    const bool consistent = through.size() >= prompt.size() && through.compare(0, prompt.size(), prompt) == 0 && out.text.size() >= through.size() &&
                            out.text.compare(0, through.size(), through) == 0;
    if (!consistent)
      throw UserError("chat template '" + name() + "': message " + std::to_string(k + 1) +
                      " (assistant) renders differently once later messages follow, so its part of the text cannot be found; mark the "
                      "assistant's turns with {% generation %} ... {% endgeneration %} in a template file ([data] chat_template_file)");
    if (through.size() > prompt.size()) out.assistant_spans.emplace_back(prompt.size(), through.size());
  }
  return out;
}

ChatTemplate chat_template_for(const Tokenizer& tokenizer, const std::string& name, const std::filesystem::path& file,
                               const std::map<std::string, std::string>& extra) {
  const auto* source = capability<ChatTemplateSource>(tokenizer);
  nlohmann::ordered_json variables = nlohmann::ordered_json::object();
  if (source) variables = nlohmann::ordered_json::parse(source->chat_template_variables(), nullptr, false);
  if (variables.is_discarded() || !variables.is_object()) throw UserError("the tokenizer's chat template variables are not a JSON object");
  for (const auto& [k, v] : extra) variables[k] = v;
  if (!file.empty()) {
    const std::string text = kit::without_bom(kit::read_regular_file(file, std::uintmax_t{16} << 20, "chat template file"));
    return ChatTemplate(text, file.string(), std::move(variables));
  }
  if (!source) throw UserError("the tokenizer carries no chat templates (its plugin does not offer them): give [data] chat_template_file");
  const auto names = source->chat_template_names();
  if (names.empty()) throw UserError("the tokenizer carries no chat template: give [data] chat_template_file");
  const std::string chosen = name.empty() ? names.front() : name;
  return ChatTemplate(source->chat_template(chosen), chosen, std::move(variables));
}

}  // namespace loom::core
