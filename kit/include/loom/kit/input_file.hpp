#pragma once
// Files a user names (configs, data, weights, tokenizer files, checkpoints) are opened only when
// they are regular files, so a folder, a FIFO or a device (/dev/zero, a pipe with no writer) is
// one clear error instead of a hang or an endless read; and read whole only up to a bound.
#include <cstdint>
#include <filesystem>
#include <string>

#include "loom/export.hpp"
#include "loom/kit/version.hpp"  // recorded in the descriptor of a plugin that uses the kit

namespace loom::kit {

// Throws UserError "WHAT FILE: ..." unless `file` (symbolic links followed) is a regular file.
LOOM_API void require_regular_file(const std::filesystem::path& file, const std::string& what);

// Opens a regular file for reading without ever blocking on a FIFO (the type is checked on the
// open descriptor, so it cannot change in between). Returns the descriptor; the caller closes it.
LOOM_API int open_regular_file(const std::filesystem::path& file, const std::string& what);

// The whole content of a regular file of at most `max_bytes` (read until its end, so files whose
// size stat cannot tell, as in /proc, are bounded too). Errors name the file and say what it is.
LOOM_API std::string read_regular_file(const std::filesystem::path& file, std::uintmax_t max_bytes, const std::string& what);

}  // namespace loom::kit
