#include "runtime/output_folder.hpp"

#include <cerrno>
#include <cstring>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include "loom/error.hpp"
#include "loom/kit/atomic_file.hpp"
#include "plugins/filesystem_errors.hpp"

namespace loom::core {
namespace fs = std::filesystem;

void OutputFolder::check(const fs::path& dir, bool resume) {
  std::error_code ec;
  const bool has_run = fs::exists(dir / "run.json", ec);
  if (resume) {
    if (!has_run) throw UserError("--resume: " + dir.string() + " holds no run to resume (no run.json)");
    return;
  }
  if (has_run)
    throw UserError(dir.string() + " already holds a run (run.json); pass --resume to continue it or --output NEW_DIR to start another");
  for (const char* name : kNames)
    if (fs::symlink_status(dir / name, ec).type() != fs::file_type::not_found)
      throw UserError((dir / name).string() + " is in the way: a run writes " + name + " in its output folder, and this one is not from a loom run " +
                      "(there is no run.json); move it, or start the run in another folder with --output NEW_DIR");
}

OutputFolder::OutputFolder(fs::path dir, bool resume) : dir_(std::move(dir)) {
  std::error_code ec;
  created_ = !fs::exists(dir_, ec);
  fs::create_directories(dir_, ec);
  if (ec) throw UserError("cannot create output folder " + dir_.string() + ": " + ec.message());
  fd_ = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd_ < 0) throw UserError("cannot open output folder " + dir_.string() + ": " + std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    ::close(fd_);
    fd_ = -1;
    if (error == EWOULDBLOCK)
      throw UserError(dir_.string() + " is in use by another loom run (it holds the folder's lock; `fuser -v " + dir_.string() +
                      "` names it); wait for it to end, or start this one with --output NEW_DIR");
    throw UserError("cannot lock output folder " + dir_.string() + ": " + std::strerror(error) +
                    " (loom locks the folder a run writes; use a local folder)");
  }
  try {
    check(dir_, resume);  // again, now that no other run can change it
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

OutputFolder::~OutputFolder() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

std::string describe_error(const std::exception& e) {
  if (const auto* f = dynamic_cast<const fs::filesystem_error*>(&e)) return describe_filesystem_error(*f);
  return e.what();
}

void OutputFolder::discard_new_run() noexcept {
  for (const char* name : kNames) kit::remove_tree(dir_ / name);
  std::error_code ec;
  if (created_) fs::remove(dir_, ec);  // only when empty
}

}  // namespace loom::core
