#pragma once
#include <filesystem>
#include <string_view>

namespace loom::core {

// Writes `content` to `path` so that a reader (or a crash) sees the old file or the new one,
// never a half-written one: temporary file in the same folder, fsync, rename, fsync the folder.
void write_file_atomically(const std::filesystem::path& path, std::string_view content);

}  // namespace loom::core
