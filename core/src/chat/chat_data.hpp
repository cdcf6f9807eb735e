#pragma once
// Conversations in the data: [data] format = "messages" (HF/OpenAI: a `messages` list of
// {role, content}, optional `tools` and `documents`), "sharegpt" (`conversations` of {from,
// value}) or "alpaca" (instruction, input, output, optional system). Each line becomes one
// Conversation, kept as its canonical JSON text (a Dataset sample), so the rest of the data path
// (shuffling, sharding over ranks, checkpointed positions) treats it like any other sample.
#include <string>

#include <nlohmann/json.hpp>

#include "chat/chat_template.hpp"

namespace loom::core {

bool is_chat_format(const std::string& format);

// What a conversation is read for: training on its assistant turns (it must hold one), or the
// prompt of a preference or sampling objective (it may end before any answer; under "messages",
// where the record has no `messages`, it may be TRL's `prompt`, a list of messages or a user's
// text, or TRL's implicit prompt: the messages whole-conversation `chosen` and `rejected` both begin
// with; under "alpaca" `output` may be missing).
enum class ConversationUse { kTraining, kPrompt };

// A data line's record in `format` as a conversation; UserError saying what is wrong with it.
Conversation conversation_from_record(const nlohmann::ordered_json& record, const std::string& format,
                                      ConversationUse use = ConversationUse::kTraining);

// Whether two messages are the same whatever the order of their keys (HF exports write
// {"content", "role"}, loom {"role", "content"}).
bool same_message(const nlohmann::ordered_json& a, const nlohmann::ordered_json& b);

// A conversation as a sample string, and back.
std::string conversation_to_sample(const Conversation& conversation);
Conversation conversation_from_sample(const std::string& sample);

}  // namespace loom::core
