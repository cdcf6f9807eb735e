#include "loom/kit/hub_cache.hpp"

#include <cctype>
#include <cstdlib>
#include <system_error>

#include "loom/error.hpp"
#include "loom/kit/input_file.hpp"

namespace loom::kit {
namespace fs = std::filesystem;
namespace {

bool id_part(const std::string& part) {
  if (part.empty() || part.size() > 96) return false;
  for (const char c : part)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) return false;
  const auto edge = [](char c) { return c == '-' || c == '.'; };
  return !edge(part.front()) && !edge(part.back()) && part.find("--") == std::string::npos && part.find("..") == std::string::npos;
}

std::string env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : "";
}

bool is_commit(const std::string& revision) {
  return revision.size() == 40 && revision.find_first_not_of("0123456789abcdef") == std::string::npos;
}

}  // namespace

bool looks_like_hub_id(const std::string& text) {
  const auto slash = text.find('/');
  if (slash == std::string::npos) return id_part(text);
  return text.find('/', slash + 1) == std::string::npos && id_part(text.substr(0, slash)) && id_part(text.substr(slash + 1));
}

fs::path hub_cache_folder() {
  for (const char* name : {"HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"})
    if (!env(name).empty()) return env(name);
  if (!env("HF_HOME").empty()) return fs::path(env("HF_HOME")) / "hub";
  if (!env("XDG_CACHE_HOME").empty()) return fs::path(env("XDG_CACHE_HOME")) / "huggingface" / "hub";
  return fs::path(env("HOME").empty() ? "/root" : env("HOME")) / ".cache" / "huggingface" / "hub";
}

fs::path model_folder(const std::string& path, const std::string& revision, const std::string& what) {
  std::error_code ec;
  if (fs::exists(path, ec) || !looks_like_hub_id(path)) return path;
  const std::string wanted = revision.empty() ? "main" : revision;
  // A branch, tag or commit: kept inside the cache's refs/.
  if (wanted.front() == '/' || wanted.find("..") != std::string::npos || wanted.find('\\') != std::string::npos)
    throw UserError(what + " revision \"" + wanted + "\": write a branch, a tag or a 40-digit commit");
  const fs::path cache = hub_cache_folder();
  std::string repo = "models--" + path;
  for (auto at = repo.find('/'); at != std::string::npos; at = repo.find('/')) repo.replace(at, 1, "--");
  const fs::path folder = cache / repo;
  const std::string fetch = "; fetch it with `hf download " + path + (revision.empty() ? "" : " --revision " + revision) +
                            "` (it goes to that cache), or set " + what + " to the model's folder";
  if (!fs::is_directory(folder, ec))
    throw UserError(what + " = \"" + path + "\" is not a folder, and as a Hugging Face hub id it is not in the local hub cache " + cache.string() +
                    " (no " + repo + "; HF_HUB_CACHE or HF_HOME choose the cache)" + fetch);
  // A branch or tag names a commit in refs/; a commit names its snapshot itself.
  // A ref is a 40-digit commit and a newline: a FIFO, a device or a huge file is no ref, and is
  // neither waited on nor read whole.
  std::string commit;
  const fs::path ref = folder / "refs" / wanted;
  if (fs::symlink_status(ref, ec).type() != fs::file_type::not_found)
    commit = read_regular_file(ref, 256, what + " = \"" + path + "\": the hub cache's ref");
  while (!commit.empty() && (commit.back() == '\n' || commit.back() == '\r' || commit.back() == ' ')) commit.pop_back();
  if (commit.empty() && is_commit(wanted)) commit = wanted;
  if (!is_commit(commit))
    throw UserError(what + " = \"" + path + "\": the hub cache's " + folder.string() + " has no revision \"" + wanted + "\" (" +
                    (commit.empty() ? "no refs/" + wanted : "refs/" + wanted + " does not hold a commit") + ")" + fetch);
  const fs::path snapshot = folder / "snapshots" / commit;
  if (!fs::is_directory(snapshot, ec))
    throw UserError(what + " = \"" + path + "\": revision \"" + wanted + "\" is commit " + commit + ", whose snapshot " + snapshot.string() +
                    " is not in the cache" + fetch);
  return snapshot;
}

}  // namespace loom::kit
