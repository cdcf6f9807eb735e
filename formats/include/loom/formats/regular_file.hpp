#pragma once
// Files a user names (configs, data, weights, tokenizer files, checkpoints) are opened only when
// they are regular files, so a folder, a FIFO or a device (/dev/zero, a pipe with no writer) is one
// clear error instead of a hang or an endless read; and read whole only up to a bound. The kit's
// loom/kit/input_file.hpp offers the same to plugins.
#include <cstdint>
#include <filesystem>
#include <string>

namespace loom::formats {

// Throws UserError "WHAT FILE: ..." unless `file` (symbolic links followed) is a regular file.
void require_regular_file(const std::filesystem::path& file, const std::string& what);

// Opens a regular file for reading without ever blocking on a FIFO (the type is checked on the
// open descriptor, so it cannot change in between). Returns the descriptor; the caller closes it.
int open_regular_file(const std::filesystem::path& file, const std::string& what);

// The whole content of a regular file of at most `max_bytes` (read until its end, so files whose
// size stat cannot tell, as in /proc, are bounded too). Errors name the file and say what it is.
std::string read_regular_file(const std::filesystem::path& file, std::uintmax_t max_bytes, const std::string& what);

// A size as people read it: "512 B", "4.00 MiB" (binary units, two decimals past bytes).
std::string size_text(std::uint64_t bytes);

// A file name's extension in lower case (".parquet" for "x.PARQUET").
std::string lowercase_extension(const std::filesystem::path& file);

}  // namespace loom::formats
