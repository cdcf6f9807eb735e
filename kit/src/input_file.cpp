#include "loom/kit/input_file.hpp"

#include "loom/formats/regular_file.hpp"

// The kit's file helpers are the formats library's (torch-free, linked into the kit), offered to
// plugins under their kit names.
namespace loom::kit {

void require_regular_file(const std::filesystem::path& file, const std::string& what) { formats::require_regular_file(file, what); }

int open_regular_file(const std::filesystem::path& file, const std::string& what) { return formats::open_regular_file(file, what); }

std::string read_regular_file(const std::filesystem::path& file, std::uintmax_t max_bytes, const std::string& what) {
  return formats::read_regular_file(file, max_bytes, what);
}

}  // namespace loom::kit
