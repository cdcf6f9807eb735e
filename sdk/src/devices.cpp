#include "loom/devices.hpp"

#include "loom/formats/regular_file.hpp"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <limits>

#include "loom/error.hpp"

namespace loom {
namespace {

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return {};
  const auto e = s.find_last_not_of(" \t");
  return s.substr(b, e - b + 1);
}

bool all_digits(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  return true;
}

}  // namespace

DType parse_dtype(const std::string& name) {
  if (name == "fp32") return DType::kFloat32;
  if (name == "bf16") return DType::kBFloat16;
  if (name == "fp16") return DType::kFloat16;
  throw UserError("unknown dtype \"" + name + "\": use \"fp32\", \"bf16\" or \"fp16\"");
}

std::string dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "fp32";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat16: return "fp16";
  }
  return "?";
}

std::uint64_t dtype_bytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

std::string DeviceName::str() const { return is_cuda ? "cuda:" + std::to_string(index) : "cpu"; }

DeviceName parse_device(const std::string& text) {
  const std::string t = trim(text);
  if (t == "cpu") return {false, -1};
  if (t == "cuda") return {true, 0};
  if (t.rfind("cuda:", 0) == 0) {
    const std::string idx = t.substr(5);
    if (all_digits(idx) && idx.size() <= 4) return {true, std::stoi(idx)};
  }
  throw UserError("unknown device \"" + text + "\": use \"cpu\", \"cuda\" or \"cuda:N\"");
}

std::uint64_t parse_bytes(const std::string& text) {
  const std::string t = trim(text);
  std::size_t pos = 0;
  while (pos < t.size() && (std::isdigit(static_cast<unsigned char>(t[pos])) || t[pos] == '.')) ++pos;
  const std::string number = t.substr(0, pos);
  const std::string unit = trim(t.substr(pos));
  const auto bad = [&] {
    return UserError("bad memory size \"" + text +
                     "\": write a number and a unit, e.g. \"16GiB\", \"512MiB\", \"40GB\" or bytes \"4096\"");
  };
  if (number.empty() || number == "." || number.find('.') != number.rfind('.')) throw bad();
  struct Unit {
    const char* name;
    double factor;
  };
  static constexpr Unit kUnits[] = {{"", 1},         {"B", 1},          {"KiB", 1024.0},
                                    {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0},
                                    {"KB", 1e3},       {"MB", 1e6},       {"GB", 1e9},
                                    {"TB", 1e12}};
  for (const auto& u : kUnits) {
    if (unit != u.name) continue;
    const double value = std::stod(number) * u.factor;
    if (!(value < static_cast<double>(std::numeric_limits<std::uint64_t>::max()) / 2))
      throw UserError("memory size \"" + text + "\" is too large");
    return static_cast<std::uint64_t>(std::llround(value));
  }
  throw bad();
}

std::string format_bytes(std::uint64_t bytes) { return formats::size_text(bytes); }

const DeviceCapacity* Inventory::find(const std::string& device) const {
  for (const auto& d : devices)
    if (d.device == device) return &d;
  return nullptr;
}

std::string rank_device(const Inventory& inventory, const std::string& wanted) {
  if (!wanted.empty()) {
    if (!inventory.find(wanted)) {
      std::string names;
      for (const auto& d : inventory.devices) names += (names.empty() ? "" : ", ") + d.device;
      throw UserError("device = \"" + wanted + "\" is not among a rank's devices (" + names + ")");
    }
    return wanted;
  }
  for (const auto& d : inventory.devices)
    if (d.device != "cpu") return d.device;
  return "cpu";
}

}  // namespace loom
