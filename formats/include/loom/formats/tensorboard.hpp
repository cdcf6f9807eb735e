#pragma once
// TensorBoard's event files, written by hand rather than through a protobuf library: a file is a
// sequence of TFRecords (little-endian u64 length, masked CRC-32C of those 8 bytes, the data, masked
// CRC-32C of the data), each holding one serialised tensorflow.Event. Only what scalar curves need
// is encoded: Event{wall_time = 1, step = 2, file_version = 3, summary = 5} and
// Summary{value = 1: Value{tag = 1, simple_value = 2}}.
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace loom::formats::tensorboard {

using Scalars = std::vector<std::pair<std::string, float>>;

// CRC-32C (Castagnoli), as TFRecord checksums its parts.
std::uint32_t crc32c(std::string_view bytes);
// TFRecord's masked form of a CRC (so a CRC of data holding CRCs is not degenerate).
std::uint32_t masked_crc(std::uint32_t crc);

// One TFRecord around `data`.
std::string record(std::string_view data);
// The first event of every file: file_version "brain.Event:2", which readers check.
std::string version_event(double wall_time);
// One event carrying `scalars` at `step`.
std::string scalars_event(double wall_time, std::int64_t step, const Scalars& scalars);

}  // namespace loom::formats::tensorboard
