#pragma once
// The fuzz targets' files: the fuzzer's bytes split into several inputs, and a scratch folder to
// write them in. Torch-free, for the formats library's targets built on their own.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

namespace loom::fuzz {

// The fuzzer's bytes split at `separator` into exactly `parts` pieces (the last holds the rest;
// missing pieces are empty), so one input can carry several files.
inline std::vector<std::string> split(const std::uint8_t* data, std::size_t size, std::string_view separator, std::size_t parts) {
  std::vector<std::string> out;
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  while (out.size() + 1 < parts) {
    const auto at = rest.find(separator);
    if (at == std::string_view::npos) break;
    out.emplace_back(rest.substr(0, at));
    rest.remove_prefix(at + separator.size());
  }
  out.emplace_back(rest);
  out.resize(parts);
  return out;
}

// A folder of this process for the files a target writes; emptied on each call.
inline std::filesystem::path scratch() {
  static const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("loom-fuzz-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

inline void write(const std::filesystem::path& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

}  // namespace loom::fuzz
