#pragma once
// The collator of chat data ([data] format = "messages", "sharegpt", "alpaca"): each sample is a
// conversation (chat/chat_data.hpp) rendered with the model's chat template and tokenized whole,
// as apply_chat_template(tokenize=True) does (no special tokens added: the template writes them),
// with labels on the tokens of the assistant's turns only, as return_assistant_tokens_mask marks
// them. The host uses it in place of a [collator] plugin.
#include <optional>
#include <string>
#include <vector>

#include "chat/chat_template.hpp"
#include "loom/collator.hpp"
#include "loom/kit/collate.hpp"

namespace loom::core {

// What generation needs to know of a host collator's prompts (the evaluator's exact-match):
// whether a chat template rendered them (encoded without adding special tokens) and where an
// answer ends.
class PromptForm {
 public:
  virtual ~PromptForm() = default;
  virtual bool templated() const = 0;
  // The text that ends an answer to `sample`'s prompt ("": none but the end of sequence).
  virtual std::string end_of_turn(const std::string& sample) const = 0;
};

class ChatCollator final : public Collator, public PromptForm {
 public:
  explicit ChatCollator(ChatTemplate chat) : chat_(std::move(chat)) {}

  Batch collate(const std::vector<std::string>& samples, const Tokenizer& tokenizer, const CollateSettings& settings) const override;
  // The prompt: the conversation before its last assistant message, with the generation prompt;
  // the reference: that message's content.
  std::optional<PromptSplit> split_for_generation(const std::string& sample) const override;

  // One sample's ids and labels before truncation and padding.
  kit::LabeledRow label(const std::string& sample, const Tokenizer& tokenizer) const;
  bool templated() const override { return true; }
  // What the template writes after an assistant's content to end the turn ("<|im_end|>"), where
  // generation of an answer stops; empty when the template's turns show none.
  std::string end_of_turn(const std::string& sample) const override;

  const ChatTemplate& chat_template() const { return chat_; }

 private:
  ChatTemplate chat_;
};

// What `chat` writes after an assistant's content to end the turn ("<|im_end|>"), from a short
// reply added to `prompt` (a conversation ending before an answer); empty when the template shows
// none, or refuses the reply.
std::string turn_end_marker(const ChatTemplate& chat, const Conversation& prompt);

// Tokens of `offsets` labeled for byte spans `spans`, as transformers marks assistant tokens: from
// the token holding a span's first byte through the token holding its last.
std::vector<bool> tokens_in_spans(const std::vector<std::pair<std::size_t, std::size_t>>& offsets,
                                  const std::vector<std::pair<std::size_t, std::size_t>>& spans);

}  // namespace loom::core
