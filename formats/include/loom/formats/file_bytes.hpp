#pragma once
// A regular file read by ranges (pread), for formats whose metadata says where their parts lie:
// each range is checked against the file's size before anything is allocated for it.
#include <unistd.h>
#include <sys/stat.h>

#include <cstdint>
#include <filesystem>
#include <string>

#include "loom/error.hpp"
#include "loom/formats/regular_file.hpp"

namespace loom::formats {

class FileBytes {
 public:
  FileBytes(const std::filesystem::path& file, const std::string& what) : name_(file.string()), fd_(open_regular_file(file, what)) {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      ::close(fd_);
      throw UserError(name_ + ": cannot read its size");
    }
    size_ = static_cast<std::uint64_t>(st.st_size);
  }
  ~FileBytes() { ::close(fd_); }
  FileBytes(const FileBytes&) = delete;
  FileBytes& operator=(const FileBytes&) = delete;

  std::uint64_t size() const { return size_; }
  const std::string& name() const { return name_; }
  // `length` bytes from `offset`; a range past the end is a UserError that says what it was.
  std::string read(std::uint64_t offset, std::uint64_t length, const std::string& what) const {
    if (offset > size_ || length > size_ - offset)
      throw UserError(name_ + ": " + what + " (" + std::to_string(length) + " bytes at " + std::to_string(offset) + ") lies past the end of the file (" +
                      std::to_string(size_) + " bytes); the file is truncated or damaged");
    std::string out(static_cast<std::size_t>(length), '\0');
    std::size_t done = 0;
    while (done < out.size()) {
      const ssize_t n = ::pread(fd_, out.data() + done, out.size() - done, static_cast<off_t>(offset + done));
      if (n <= 0) throw UserError(name_ + ": cannot read " + what + " (the file changed while it was read?)");
      done += static_cast<std::size_t>(n);
    }
    return out;
  }

 private:
  std::string name_;
  int fd_;
  std::uint64_t size_ = 0;
};

}  // namespace loom::formats
