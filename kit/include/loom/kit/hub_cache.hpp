#pragma once
// Models named by Hugging Face hub id ("org/name") found in the local hub cache, as huggingface_hub
// resolves them offline: nothing is downloaded.
#include <filesystem>
#include <string>

#include "loom/export.hpp"
#include "loom/kit/version.hpp"  // recorded in the descriptor of a plugin that uses the kit

namespace loom::kit {

// Whether `text` has a hub id's shape: "name" or "org/name", letters, digits, '-', '_' and '.',
// neither part starting or ending with '-' or '.', no "--" or "..", at most 96 characters a part.
LOOM_API bool looks_like_hub_id(const std::string& text);

// The hub cache huggingface_hub uses: HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else HF_HOME/hub,
// else XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub.
LOOM_API std::filesystem::path hub_cache_folder();

// The folder a model `path` names: `path` itself where it exists; else, for a hub id, the snapshot
// of `revision` ("main" when empty; a branch or tag through refs/, or a 40-digit commit) in the hub
// cache. `what` names the key in errors ("[model] path"). UserError otherwise, naming what was
// searched and the `hf download` command that fetches the model.
LOOM_API std::filesystem::path model_folder(const std::string& path, const std::string& revision, const std::string& what);

}  // namespace loom::kit
