#pragma once
#include <filesystem>
#include <string_view>

#include "loom/export.hpp"
#include "loom/kit/version.hpp"  // recorded in the descriptor of a plugin that uses the kit

namespace loom::kit {

// Writes a file so that a reader (or a crash) sees the old file or the new one, never a
// half-written one: a temporary file in the same folder, fsync, rename, fsync the folder.
// Destroyed without commit(), it removes the temporary file and leaves the target untouched.
class LOOM_API AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::filesystem::path path);  // throws UserError if it cannot create the temporary
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void write(const void* data, std::size_t size);  // throws UserError
  void write(std::string_view text) { write(text.data(), text.size()); }
  void commit();  // fsync, rename over the target, fsync the folder

 private:
  [[noreturn]] void fail(const std::string& what);
  std::filesystem::path path_;
  std::filesystem::path tmp_;
  int fd_ = -1;
};

LOOM_API void write_file_atomically(const std::filesystem::path& path, std::string_view content);

// Removes a file or a folder with everything in it (symlinks are removed, not followed); a missing
// path is no error. Returns false when something could not be removed. loom's own walk, not
// std::filesystem::remove_all: PyTorch 2.x wheels export an older build of that function from
// libtorch.so, which takes its place in the process and crashes on a non-empty folder beside a
// newer libstdc++ (seen with torch 2.11 and gcc 13).
LOOM_API bool remove_tree(const std::filesystem::path& path);

}  // namespace loom::kit
