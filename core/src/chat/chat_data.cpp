#include "chat/chat_data.hpp"

#include <map>
#include <optional>
#include <stdexcept>

#include "loom/error.hpp"
#include "loom/kit/json.hpp"

namespace loom::core {

bool same_message(const nlohmann::ordered_json& a, const nlohmann::ordered_json& b) { return nlohmann::json(a) == nlohmann::json(b); }

bool is_chat_format(const std::string& format) { return format == "messages" || format == "sharegpt" || format == "alpaca"; }

namespace {

using Json = nlohmann::ordered_json;

const Json& field(const Json& record, const char* key, const char* format) {
  const auto it = record.find(key);
  if (it == record.end()) {
    std::string fields;
    for (const auto& [k, v] : record.items()) fields += (fields.empty() ? "" : ", ") + kit::json::quote(k, 40);
    throw UserError(std::string("record has no field '") + key + "' ([data] format = \"" + format + "\"; " +
                    (fields.empty() ? "it has none" : "its fields: " + fields.substr(0, 300)) + ")");
  }
  return *it;
}

std::string string_field(const Json& record, const char* key, const char* format) {
  const Json& v = field(record, key, format);
  if (!v.is_string()) throw UserError(std::string("'") + key + "' is " + kit::json::describe(nlohmann::json(v)) + ", not a string");
  return v.get<std::string>();
}

void check_messages(const Json& messages, ConversationUse use, const char* key = "messages") {
  if (!messages.is_array() || messages.empty())
    throw UserError(std::string("'") + key + "' must be a non-empty list of {\"role\", \"content\"} objects");
  for (std::size_t k = 0; k < messages.size(); ++k) {
    const Json& m = messages[k];
    const std::string where = "message " + std::to_string(k + 1);
    if (!m.is_object()) throw UserError(where + " is not an object");
    if (!m.contains("role") || !m["role"].is_string()) throw UserError(where + " has no \"role\" string");
    // content: text, null beside tool calls, or a list of parts (the template decides what to print)
    if (m.contains("content") && !(m["content"].is_string() || m["content"].is_null() || m["content"].is_array()))
      throw UserError(where + "'s \"content\" is neither text, null nor a list of parts");
  }
  if (use == ConversationUse::kPrompt) return;
  bool any_assistant = false;
  for (const auto& m : messages) any_assistant = any_assistant || m["role"] == "assistant";
  if (!any_assistant) throw UserError("the conversation has no assistant message: nothing to learn from");
}

Json optional_list(const Json& record, const char* key) {
  const auto it = record.find(key);
  if (it == record.end() || it->is_null()) return Json();
  if (!it->is_array()) throw UserError(std::string("'") + key + "' must be a list");
  return *it;
}

// TRL's implicit prompt: where `chosen` and `rejected` are whole conversations, the messages both
// begin with (whatever the order of their keys), up to where they part.
std::optional<Json> implicit_prompt(const Json& record) {
  const auto chosen = record.find("chosen"), rejected = record.find("rejected");
  if (chosen == record.end() || rejected == record.end() || !chosen->is_array() || !rejected->is_array()) return std::nullopt;
  Json shared = Json::array();
  for (std::size_t k = 0; k < chosen->size() && k < rejected->size(); ++k) {
    if (!same_message((*chosen)[k], (*rejected)[k])) break;
    shared.push_back((*chosen)[k]);
  }
  if (shared.empty() || shared.size() == chosen->size() || shared.size() == rejected->size()) return std::nullopt;
  return shared;
}

}  // namespace

Conversation conversation_from_record(const Json& record, const std::string& format, ConversationUse use) {
  Conversation c;
  const char* key = "messages";
  if (format == "messages") {
    // A prompt may come as TRL's conversational `prompt`: a list of messages, or a user's text.
    if (use == ConversationUse::kPrompt && !record.contains("messages") && record.contains("prompt")) {
      key = "prompt";
      c.messages = record["prompt"].is_string() ? Json::array({Json{{"role", "user"}, {"content", record["prompt"]}}}) : record["prompt"];
    } else if (use == ConversationUse::kPrompt && !record.contains("messages")) {
      auto shared = implicit_prompt(record);
      if (!shared) {
        try {
          field(record, "messages", "messages");  // throws, naming the fields the record has
        } catch (const UserError& e) {
          throw UserError(std::string(e.what()) + "; a prompt may also be TRL's 'prompt' (a list of messages, or a user's text), or the "
                                                  "messages 'chosen' and 'rejected' both begin with");
        }
        throw std::logic_error("conversation_from_record: a record without 'messages' has it");
      }
      key = "chosen";
      c.messages = std::move(*shared);
    } else {
      c.messages = field(record, "messages", "messages");
    }
    c.tools = optional_list(record, "tools");
    c.documents = optional_list(record, "documents");
  } else if (format == "sharegpt") {
    static const std::map<std::string, std::string> roles{{"system", "system"},       {"human", "user"},     {"user", "user"},
                                                          {"gpt", "assistant"},       {"assistant", "assistant"}, {"model", "assistant"},
                                                          {"tool", "tool"},           {"observation", "tool"}, {"function_response", "tool"}};
    const Json& turns = field(record, "conversations", "sharegpt");
    if (!turns.is_array()) throw UserError("'conversations' must be a list of {\"from\", \"value\"} objects");
    if (const auto system = record.find("system"); system != record.end() && system->is_string() && !system->get<std::string>().empty())
      c.messages.push_back(Json{{"role", "system"}, {"content", *system}});
    for (std::size_t k = 0; k < turns.size(); ++k) {
      const Json& t = turns[k];
      if (!t.is_object() || !t.contains("from") || !t["from"].is_string() || !t.contains("value") || !t["value"].is_string())
        throw UserError("turn " + std::to_string(k + 1) + " is not a {\"from\": ..., \"value\": \"...\"} object");
      const auto role = roles.find(t["from"].get<std::string>());
      if (role == roles.end())
        throw UserError("turn " + std::to_string(k + 1) + " is from " + kit::json::quote(t["from"].get<std::string>()) +
                        "; ShareGPT's roles are system, human (or user), gpt (or assistant, model) and tool (or observation)");
      c.messages.push_back(Json{{"role", role->second}, {"content", t["value"]}});
    }
    c.tools = optional_list(record, "tools");
  } else if (format == "alpaca") {
    std::string user = string_field(record, "instruction", "alpaca");
    if (const auto input = record.find("input"); input != record.end() && input->is_string() && !input->get<std::string>().empty())
      user += "\n\n" + input->get<std::string>();
    if (const auto system = record.find("system"); system != record.end() && system->is_string() && !system->get<std::string>().empty())
      c.messages.push_back(Json{{"role", "system"}, {"content", *system}});
    c.messages.push_back(Json{{"role", "user"}, {"content", user}});
    if (use == ConversationUse::kTraining) {
      c.messages.push_back(Json{{"role", "assistant"}, {"content", string_field(record, "output", "alpaca")}});
    } else if (const auto output = record.find("output"); output != record.end() && (output->is_string() || output->is_number())) {
      // a prompt's record may hold its answer (a number as JSON writes it), or none
      c.messages.push_back(Json{{"role", "assistant"}, {"content", output->is_string() ? output->get<std::string>() : output->dump()}});
    }
  } else {
    throw std::logic_error("conversation_from_record: not a chat format: " + format);
  }
  check_messages(c.messages, use, key);
  return c;
}

std::string conversation_to_sample(const Conversation& c) {
  Json j = Json::object();
  j["messages"] = c.messages;
  if (!c.tools.is_null()) j["tools"] = c.tools;
  if (!c.documents.is_null()) j["documents"] = c.documents;
  return j.dump();
}

Conversation conversation_from_sample(const std::string& sample) {
  const Json j = Json::parse(sample);
  Conversation c;
  c.messages = j.at("messages");
  if (j.contains("tools")) c.tools = j["tools"];
  if (j.contains("documents")) c.documents = j["documents"];
  return c;
}

}  // namespace loom::core
