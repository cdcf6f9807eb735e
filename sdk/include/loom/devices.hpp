#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "loom/export.hpp"

namespace loom {

enum class DType { kFloat32, kBFloat16, kFloat16 };

// "fp32" | "bf16" | "fp16"; anything else throws UserError listing those.
LOOM_API DType parse_dtype(const std::string& name);
LOOM_API std::string dtype_name(DType dtype);
LOOM_API std::uint64_t dtype_bytes(DType dtype);

// A device as written in pipelines: "cpu" or "cuda:N" ("cuda" means "cuda:0").
struct LOOM_API DeviceName {
  bool is_cuda = false;
  int index = -1;  // -1 for cpu
  std::string str() const;
};
// Throws UserError naming the accepted spellings.
LOOM_API DeviceName parse_device(const std::string& text);

// "16GiB", "1.5 GiB", "512MB", "4096" (bytes). Binary (KiB, MiB, GiB, TiB) and decimal
// (KB, MB, GB, TB) units. Throws UserError on anything else or on overflow.
LOOM_API std::uint64_t parse_bytes(const std::string& text);
// "14.00 GiB", "512.0 MiB", "12 B".
LOOM_API std::string format_bytes(std::uint64_t bytes);

struct DeviceCapacity {
  std::string device;           // canonical name, "cpu" or "cuda:N"
  std::uint64_t capacity_bytes = 0;
  std::string description;      // "NVIDIA H200", "host RAM (MemAvailable)", "simulated"
};

struct LOOM_API Inventory {
  std::vector<DeviceCapacity> devices;
  bool simulated = false;
  const DeviceCapacity* find(const std::string& device) const;
};

// The one device a rank runs on: `wanted` when not empty (UserError when the rank lacks it), else
// its first GPU, else the cpu.
LOOM_API std::string rank_device(const Inventory& inventory, const std::string& wanted);

}  // namespace loom
