#include "config/session.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "loom/error.hpp"
#include "loom/layers.hpp"
#include "loom/kit/hub_cache.hpp"
#include "loom/kit/torch_compat.hpp"
#include "chat/chat_collator.hpp"
#include "config/objective_data.hpp"
#include "chat/chat_data.hpp"
#include "config/data.hpp"
#include "plugins/plugin_guard.hpp"

namespace loom::core {
namespace {

template <typename Interface>
std::unique_ptr<Interface> create_as(const PluginRegistry& registry, const LoadedPlugin& plugin, const Options& options,
                                     const SectionSpec& section, Diagnostics& diagnostics) {
  try {
    return create_guarded<Interface>(registry, plugin, options);
  } catch (const UserError& e) {
    diagnostics.add(section.plugin_where, e.what());
    return nullptr;
  }
}

}  // namespace

std::vector<std::uint64_t> adapter_trainable(const Model& model, const Adapter& adapter, const ModelStructure& structure) {
  std::vector<std::uint64_t> out = adapter.trainable_parameters(structure);
  const auto* experts = capability<ExpertStructure>(model);
  const auto* sizing = capability<ExpertAdapterSizing>(adapter);
  if (experts == nullptr || sizing == nullptr) return out;
  const auto more = sizing->expert_trainable_parameters(structure, experts->experts_info());
  for (std::size_t i = 0; i < out.size() && i < more.size(); ++i) out[i] += more[i];
  return out;
}

namespace {

// What the objective reads and needs, against the rest of the pipeline. A preference or sampling
// objective labels its rows itself and evaluates with the host's AnswerCollator.
void check_objective(Session& s, Diagnostics& diagnostics) {
  if (!s.objective) return;
  const auto& objective = s.spec.section(kKindObjective);
  const std::string who = "[objective] plugin = \"" + objective.plugin + "\"";
  const ObjectiveData data = s.needs.data;
  if (data == ObjectiveData::kPrompts && s.rewards.empty())
    diagnostics.add(objective.plugin_where, who + " scores the completions it samples with rewards; add one, e.g. [reward.correct] plugin = \"exact-answer\"");
  if (data != ObjectiveData::kPrompts && !s.spec.rewards.empty())
    diagnostics.add(s.spec.rewards.front().second.where,
                    "[reward." + s.spec.rewards.front().first + "]: rewards score sampled completions, and " + who + " samples none; remove the [reward] sections");
  if (data == ObjectiveData::kText) return;
  s.config.samples_with_records = true;
  const auto& collator = s.spec.section(kKindCollator);
  if (collator.present && collator.where.line > 0)
    diagnostics.add(collator.where, who + " labels the completions itself: remove the [collator] section");
  if (s.config.packing) diagnostics.add(s.spec.section("data").location_of("packing"), who + " compares whole rows: set packing = false");
  // Its log-probabilities come from the full vocabulary's logits, which a tensor group gathers
  // without a gradient.
  if (s.config.parallel.tensor > 1)
    diagnostics.add(s.config.parallel.tensor_at, "[parallel] tensor = " + std::to_string(s.config.parallel.tensor) + ": " + who +
                                                     " reads each token's log-probability from whole logits, which loom does not yet gather with their "
                                                     "gradient over a tensor group; use data or pipeline parallelism");
  s.collator = std::make_unique<AnswerCollator>(s.needs, ObjectiveSamples(s.chat));
  s.plugins.erase(kKindCollator);  // the default collator [collator] would have had serves nothing here
}

}  // namespace

Session open_session(PipelineSpec spec, const PluginRegistry& registry, const GpuCapabilities* gpus) {
  Session s;
  s.spec = std::move(spec);
  Diagnostics diagnostics;
  for (const auto& [name, section] : s.spec.sections) {
    if (section.plugin.empty()) continue;
    const LoadedPlugin* plugin = registry.find(name, section.plugin);
    if (plugin == nullptr) throw std::logic_error("validated pipeline names unknown plugin " + section.plugin);
    s.plugins[name] = plugin;
    if (name == kKindModel) s.model = create_as<Model>(registry, *plugin, section.options, section, diagnostics);
    if (name == kKindTokenizer) s.tokenizer = create_as<Tokenizer>(registry, *plugin, section.options, section, diagnostics);
    if (name == kKindAdapter) s.adapter = create_as<Adapter>(registry, *plugin, section.options, section, diagnostics);
    if (name == kKindCollator) s.collator = create_as<Collator>(registry, *plugin, section.options, section, diagnostics);
    if (name == kKindPlacement) s.placement = create_as<Placement>(registry, *plugin, section.options, section, diagnostics);
    if (name == kKindObjective) s.objective = create_as<Objective>(registry, *plugin, section.options, section, diagnostics);
  }
  for (const auto& [name, section] : s.spec.rewards) {
    const LoadedPlugin* plugin = registry.find(kKindReward, section.plugin);
    if (plugin == nullptr) throw std::logic_error("validated pipeline names unknown reward plugin " + section.plugin);
    s.rewards.push_back({name, section.options.get_float("weight"), create_as<Reward>(registry, *plugin, section.options, section, diagnostics)});
  }
  if (s.objective) try {
      s.needs = s.objective->needs();
    } catch (const UserError& e) {
      diagnostics.add(s.spec.section(kKindObjective).plugin_where, "objective plugin '" + s.spec.section(kKindObjective).plugin + "': " + e.what());
    }
  s.config = read_run_config(s.spec, diagnostics);
  choose_dtype(s.config, gpus != nullptr ? *gpus : detect_gpu_capabilities(), s.spec.section("run"), diagnostics);
  // Chat data is rendered with the model's template and labeled by the host, not a collator plugin.
  auto& chat = s.chat;
  if (is_chat_format(s.config.format) && s.tokenizer) {
    const auto& data = s.spec.section("data");
    try {
      chat = std::make_shared<const ChatTemplate>(
          chat_template_for(*s.tokenizer, s.config.chat_template, s.config.chat_template_file, s.config.template_variables));
    } catch (const UserError& e) {
      diagnostics.add(data.location_of(!s.config.chat_template_file.empty() ? "chat_template_file"
                                       : !s.config.chat_template.empty()    ? "chat_template"
                                                                            : "format"),
                      e.what());
    }
  }
  check_objective(s, diagnostics);
  if (is_chat_format(s.config.format) && s.needs.data == ObjectiveData::kText) {
    if (s.spec.section(kKindCollator).present)
      diagnostics.add(s.spec.section(kKindCollator).where, "[data] format = \"" + s.config.format +
                                                              "\" labels the assistant's turns itself: remove the [collator] section");
    else if (chat)
      s.collator = std::make_unique<ChatCollator>(*chat);
  }
  diagnostics.throw_if_any();

  const auto& model_section = s.spec.section(kKindModel);
  try {
    s.structure = s.model->structure();
  } catch (const UserError& e) {
    diagnostics.add(model_section.plugin_where, "model plugin '" + model_section.plugin + "': " + e.what());
  }
  if (diagnostics.empty() && s.structure.blocks.empty())
    diagnostics.add(model_section.plugin_where, "model plugin '" + model_section.plugin + "' describes a model with no blocks (plugin bug)");
  if (diagnostics.empty() && s.tokenizer && s.tokenizer->vocab_size() > s.structure.vocab_size) {
    diagnostics.add(s.spec.section(kKindTokenizer).plugin_where,
                    "tokenizer '" + s.spec.section(kKindTokenizer).plugin + "' has " + std::to_string(s.tokenizer->vocab_size()) +
                        " tokens but the model's vocab_size is " + std::to_string(s.structure.vocab_size) +
                        ": its ids would index past the embedding; use a model with vocab_size >= " +
                        std::to_string(s.tokenizer->vocab_size()));
  }
  if (diagnostics.empty() && s.adapter) {
    try {
      const auto trainable = adapter_trainable(*s.model, *s.adapter, s.structure);
      if (trainable.size() != s.structure.blocks.size())
        diagnostics.add(s.spec.section(kKindAdapter).plugin_where,
                        "adapter plugin '" + s.spec.section(kKindAdapter).plugin + "' reported " + std::to_string(trainable.size()) +
                            " blocks for a model of " + std::to_string(s.structure.blocks.size()) + " (plugin bug)");
      // An adapter that stores the base its own way (4-bit) says what each block then weighs.
      const auto* storing = capability<BaseStoringAdapter>(*s.adapter);
      const BaseStorage storage =
          storing ? storing->base_storage(s.structure, s.config.dtype) : BaseStorage{};
      if (!storage.weight_bytes.empty() && storage.weight_bytes.size() != s.structure.blocks.size())
        diagnostics.add(s.spec.section(kKindAdapter).plugin_where, "adapter plugin '" + s.spec.section(kKindAdapter).plugin + "' sized " +
                                                                       std::to_string(storage.weight_bytes.size()) + " blocks of " +
                                                                       std::to_string(s.structure.blocks.size()) + " (plugin bug)");
      else
        for (std::size_t i = 0; i < storage.weight_bytes.size(); ++i) s.structure.blocks[i].weight_bytes = storage.weight_bytes[i];
      s.base_transient_bytes = storage.transient_bytes;
      s.base_quantized = !storage.weight_bytes.empty();
      if (s.base_quantized) {
        // Which linears it stores its own way, by their last name part: what plan shows.
        std::vector<std::string> kinds;
        std::size_t stored = 0, linears = 0;
        const auto options = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA);  // metadata only: nothing is allocated
        for (const auto i : s.structure.distinct_blocks())
          for (const auto& l : s.structure.blocks[i].linears) {
            ++linears;
            if (!storing->base_weight(l, options)) continue;
            ++stored;
            const std::string kind = l.name.substr(l.name.rfind('.') + 1);
            if (std::find(kinds.begin(), kinds.end(), kind) == kinds.end()) kinds.push_back(kind);
          }
        std::string names;
        for (const auto& k : kinds) names += (names.empty() ? "" : ", ") + k;
        s.base_stored_by_adapter = std::to_string(stored) + " of " + std::to_string(linears) + " linears" + (names.empty() ? "" : " (" + names + ")");
        // Stacked experts it stores its own way too (asked as the [E x out, in] matrix of their
        // experts' rows): their blocks weigh what it stores, and a product dequantizes one stacked
        // weight at a time.
        std::size_t experts_stored = 0;
        const auto* experts = capability<ExpertStructure>(*s.model);
        for (const auto& e : experts ? experts->experts_info() : std::vector<ExpertsInfo>{}) {
          const auto weight = storing->base_weight(LinearInfo{e.name, e.in_features, e.experts * e.out_features, ParallelStyle::kReplicated}, options);
          if (!weight) continue;
          ++experts_stored;
          auto& block = s.structure.blocks.at(e.block);
          const std::uint64_t dense = static_cast<std::uint64_t>(e.experts * e.out_features * e.in_features) * dtype_bytes(s.config.dtype);
          block.weight_bytes = (block.weight_bytes > 0 ? block.weight_bytes : block.parameters * dtype_bytes(s.config.dtype)) - dense + weight->bytes();
          s.base_transient_bytes = std::max(s.base_transient_bytes, dense);
        }
        if (experts_stored > 0) {
          s.base_stored_by_adapter += " and " + std::to_string(experts_stored) + " stacked experts weights";
          if (s.config.merge_adapter)
            diagnostics.add(s.spec.section(kKindAdapter).location_of("merge"),
                            "[adapter] merge = true: adapter plugin '" + s.spec.section(kKindAdapter).plugin +
                                "' stores the experts 4-bit, which no merge can write back; set merge = false and merge the saved adapter into "
                                "the full-precision model with `loom export` (an [adapter] plugin = \"lora\" pipeline)");
        }
      }
    } catch (const UserError& e) {
      diagnostics.add(s.spec.section(kKindAdapter).plugin_where, "adapter plugin '" + s.spec.section(kKindAdapter).plugin + "': " + e.what());
    }
  }
  diagnostics.throw_if_any();
  return s;
}

void check_machine(const Session& s, Diagnostics& diagnostics) {
  const auto& run = s.spec.section("run");
  if (s.config.dtype == DType::kFloat16 && kit::compat::cuda_device_count() == 0)
    diagnostics.add(run.location_of("dtype"), "[run] dtype = \"fp16\" computes on CUDA devices only and this machine has none; use \"bf16\" or \"fp32\" on the CPU");
  // An adapter that stores the base its own way may refuse a CPU block (qlora's fp16 products):
  // on a machine without CUDA every block is on the CPU, so ask it now rather than at load.
  if (s.adapter && s.base_quantized && kit::compat::cuda_device_count() == 0) {
    const auto options = at::TensorOptions().dtype(scalar_type(s.config.dtype)).device(at::kCPU);
    // The refusal depends on the dtype and the device, not the linear: the first one stored decides.
    const auto* storing = capability<BaseStoringAdapter>(*s.adapter);
    const auto ask_first_stored = [&] {
      for (const auto i : s.structure.distinct_blocks())
        for (const auto& l : s.structure.blocks[i].linears)
          if (storing->base_weight(l, options)) return;
    };
    try {
      ask_first_stored();
    } catch (const UserError& e) {
      diagnostics.add(s.spec.section(kKindAdapter).plugin_where, "adapter plugin '" + s.spec.section(kKindAdapter).plugin + "': " + e.what());
    }
  }
  const auto& train = s.spec.section("train");
  const auto threads = s.config.threads;
  const auto cores = static_cast<std::int64_t>(std::thread::hardware_concurrency());
  if (cores > 0 && threads > cores)
    diagnostics.add(train.location_of("threads"), "[train] threads = " + std::to_string(threads) + " is more than this machine's " +
                                                      std::to_string(cores) + " cores, which only slows it down; use at most " +
                                                      std::to_string(cores) + " (0: LibTorch's default)");
}

void check_machine(const Session& s) {
  Diagnostics diagnostics;
  check_machine(s, diagnostics);
  diagnostics.throw_if_any();
}

void check_inputs(const Session& s) {
  Diagnostics diagnostics;
  const auto& data = s.spec.section("data");
  const auto& train = s.spec.section("train");
  const auto max_length = s.config.collate.max_length;
  const auto positions = s.structure.max_positions;
  if (positions > 0 && max_length > positions)
    diagnostics.add(data.location_of("max_length"), "[data] max_length = " + std::to_string(max_length) + " is longer than the model's " +
                                                        std::to_string(positions) + " positions (its max_position_embeddings)");
  const auto new_tokens = s.config.max_new_tokens;
  if (positions > 0 && s.config.has_eval() && max_length <= positions && max_length + new_tokens > positions)
    diagnostics.add(train.location_of("max_new_tokens"),
                    "[train] max_new_tokens = " + std::to_string(new_tokens) + ": a prompt of up to " + std::to_string(max_length) +
                        " tokens ([data] max_length) and its answer would pass the model's " + std::to_string(positions) +
                        " positions; use at most " + std::to_string(positions - max_length));
  if (s.config.packing && s.model && capability<PackedSequences>(*s.model) == nullptr)
    diagnostics.add(data.location_of("packing"), "[data] packing = true: model plugin '" + s.spec.section(kKindModel).plugin +
                                                     "' does not attend within packed samples (it lacks PackedSequences, SDK 3.3); set packing = false");
  check_machine(s, diagnostics);
  if (!s.collator)
    diagnostics.add(Location{s.spec.file.string(), 0, 0},
                    "training needs a [collator] section: plugin = \"completion-only\" (loss on the responses) or \"all-tokens\" (on every token: "
                    "continued pretraining, or the inputs too); or a chat [data] format (\"messages\")");
  // A preference or sampling objective's first records: each with what it reads, the pairs
  // fitting [data] max_length.
  if (s.needs.data != ObjectiveData::kText && s.tokenizer && s.config.train_file && diagnostics.empty()) {
    const Location where = data.location_of("train");
    try {
      const Dataset first = load_data(*s.config.train_file, s.config.format, s.config.skip_bad_lines, kRecordsChecked, true, true);
      const ObjectiveSamples read(s.chat);
      std::int64_t kept = 0;
      for (std::size_t i = 0; i < first.samples.size(); ++i) {
        try {
          if (s.needs.data == ObjectiveData::kPreferences)
            kept += collate_pairs({first.samples[i]}, s.needs, read, *s.tokenizer, s.config.collate).pairs;
          else kept += read.prompt_ids(split_sample(first.samples[i]), *s.tokenizer).empty() ? 0 : 1;
        } catch (const UserError& e) {
          throw UserError(first.where(i) + ": " + e.what());
        }
      }
      if (kept == 0)
        diagnostics.add(where, "[data] train: none of the first " + std::to_string(first.samples.size()) + " records gives " +
                                   (s.needs.data == ObjectiveData::kPreferences ? "a pair whose completions fit [data] max_length" : "a prompt") +
                                   ": training would learn nothing");
    } catch (const UserError& e) {
      diagnostics.add(where, std::string("[data] train: ") + e.what());
    }
  }
  // The first records, collated as training will: a collator that labels nothing in them (a
  // response template the data never holds, ids outside the vocabulary) would train on nothing.
  if (s.needs.data == ObjectiveData::kText && s.collator && s.tokenizer && s.config.train_file && diagnostics.empty()) {
    const bool chat = is_chat_format(s.config.format);
    const Location where = chat ? data.location_of("format") : s.spec.section(kKindCollator).plugin_where;
    const std::string who = chat ? "the chat template" : "collator '" + s.spec.section(kKindCollator).plugin + "'";
    try {
      const auto head = s.spec.data_heads.find("train");
      const Dataset first = head != s.spec.data_heads.end() ? head->second
                                                             : load_data(*s.config.train_file, s.config.format, s.config.skip_bad_lines, kRecordsChecked);
      const Batch batch = s.collator->collate(first.samples, *s.tokenizer, s.config.collate);
      if (batch.rows == 0)
        diagnostics.add(where, who + " kept none of the first " + std::to_string(first.samples.size()) + " samples of " + s.config.train_file->string() +
                                   (chat ? " (none had an assistant token left within [data] max_length)"
                                         : s.config.collate.truncation == Truncation::kDrop
                                               ? " (each lacked its template, or was longer than [data] max_length with truncation = \"drop\")"
                                               : " (each lacked its template, or [data] max_length = " + std::to_string(s.config.collate.max_length) +
                                                     " with truncation = \"" + (s.config.collate.truncation == Truncation::kLeft ? "left" : "right") +
                                                     "\" cut its response off)") +
                                   ": training would learn nothing");
    } catch (const UserError& e) {
      diagnostics.add(where, who + ": " + e.what());
    }
  }
  // Every held-out sample the evaluation generates from (the first [train] eval_samples) must give
  // a prompt: one that renders empty (a conversation that starts with the assistant, a template
  // that writes nothing for the generation prompt) would stop the run after its last step.
  if (s.collator && s.tokenizer && s.config.eval_file && diagnostics.empty()) {
    const bool chat = is_chat_format(s.config.format);
    const auto count = s.config.eval_samples > 0 ? static_cast<std::size_t>(s.config.eval_samples) : static_cast<std::size_t>(-1);
    try {
      const Dataset eval = load_data(*s.config.eval_file, s.config.format, s.config.skip_bad_lines, count, true, s.config.samples_with_records);
      std::size_t empty = 0;
      std::string first;
      for (std::size_t i = 0; i < eval.samples.size(); ++i) {
        const auto split = s.collator->split_for_generation(eval.samples[i]);
        if (!split || !s.tokenizer->encode(split->prompt, chat ? Specials::kNone : Specials::kPrompt).ids.empty()) continue;
        if (empty++ == 0) first = eval.where(i);
      }
      if (empty > 0)
        diagnostics.add(data.location_of("eval"),
                        first + ": this held-out sample's prompt " + (chat ? "(the conversation before its last assistant message, rendered with a generation prompt) " : "") +
                            "is empty, so the exact-match has nothing to generate from" + (empty > 1 ? " (and " + std::to_string(empty - 1) + " more)" : "") +
                            (chat ? "; give it a turn before the assistant's, or a template that writes a generation prompt" : "; give it a prompt before its response"));
    } catch (const UserError& e) {
      diagnostics.add(data.location_of("eval"), e.what());
    }
  }
  diagnostics.throw_if_any();
}

std::filesystem::path model_folder_of(const Session& session) {
  const auto& model = session.spec.section(kKindModel).options;
  if (!model.has("path")) return {};
  const std::string path = model.get_string("path");
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec) || !kit::looks_like_hub_id(path)) return path;
  return kit::model_folder(path, model.has("revision") ? model.get_string("revision") : "", "[model] path");
}

std::filesystem::path tokenizer_folder_of(const Session& session) {
  std::error_code ec;
  const auto tokenizer = session.spec.sections.find(kKindTokenizer);
  if (tokenizer != session.spec.sections.end() && tokenizer->second.options.has("path")) {
    const std::filesystem::path path = tokenizer->second.options.get_string("path");
    if (std::filesystem::is_directory(path, ec)) return path;
    if (std::filesystem::is_regular_file(path, ec)) return path.parent_path();
    if (kit::looks_like_hub_id(path.string()))
      return kit::model_folder(path.string(), tokenizer->second.options.has("revision") ? tokenizer->second.options.get_string("revision") : "",
                               "[tokenizer] path");
  }
  return model_folder_of(session);
}

}  // namespace loom::core
