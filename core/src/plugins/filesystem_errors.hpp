#pragma once
// Filesystem errors in a user's words. Torch-free, header-only: the plugin guard and the output
// folders share it.
#include <cerrno>
#include <filesystem>
#include <string>
#include <system_error>

namespace loom::core {

// Whether a filesystem error says something about the machine (no space, no permission, a read-only
// filesystem, a file where a folder is needed, an I/O error) rather than about a program's logic.
inline bool is_environment_error(const std::error_code& code) {
  if (code.category() != std::generic_category() && code.category() != std::system_category()) return false;
  switch (code.value()) {
    case ENOSPC: case EDQUOT: case EACCES: case EPERM: case EROFS: case EIO: case EFBIG: case ENOTDIR: case EMFILE: case ENFILE: return true;
    default: return false;
  }
}

// "PATH: REASON" (the OS's words), not the C++ library's "filesystem error: cannot ...".
inline std::string describe_filesystem_error(const std::filesystem::filesystem_error& e) {
  std::string where = e.path1().string();
  if (!e.path2().empty()) where += " -> " + e.path2().string();
  return where + ": " + e.code().message();
}

}  // namespace loom::core
