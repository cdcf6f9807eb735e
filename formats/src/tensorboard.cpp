#include "loom/formats/tensorboard.hpp"

#include <array>
#include <cstring>

namespace loom::formats::tensorboard {
namespace {

static_assert(sizeof(float) == 4 && sizeof(double) == 8, "protobuf's fixed32/fixed64 fields are IEEE floats");

std::array<std::uint32_t, 256> crc32c_table() {
  std::array<std::uint32_t, 256> table{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // the reflected Castagnoli polynomial
    table[i] = c;
  }
  return table;
}

// Little-endian whatever the host: the wire format's byte order.
void put_fixed(std::string& out, std::uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out += static_cast<char>((value >> (8 * i)) & 0xFF);
}

void put_varint(std::string& out, std::uint64_t value) {
  while (value >= 0x80) {
    out += static_cast<char>((value & 0x7F) | 0x80);
    value >>= 7;
  }
  out += static_cast<char>(value);
}

enum WireType : std::uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void put_key(std::string& out, std::uint32_t field, WireType type) { put_varint(out, (field << 3) | type); }

void put_bytes(std::string& out, std::uint32_t field, std::string_view bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out.append(bytes.data(), bytes.size());
}

void put_double(std::string& out, std::uint32_t field, double value) {
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  put_key(out, field, kFixed64);
  put_fixed(out, bits, 8);
}

void put_float(std::string& out, std::uint32_t field, float value) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  put_key(out, field, kFixed32);
  put_fixed(out, bits, 4);
}

// Event's fields.
constexpr std::uint32_t kWallTime = 1, kStep = 2, kFileVersion = 3, kSummary = 5;
// Summary.value, and Summary.Value's fields.
constexpr std::uint32_t kSummaryValue = 1, kTag = 1, kSimpleValue = 2;

// As proto3 writes it: a field at its default value (0) is left out.
std::string event_head(double wall_time, std::int64_t step) {
  std::string event;
  if (wall_time != 0) put_double(event, kWallTime, wall_time);
  if (step != 0) {
    put_key(event, kStep, kVarint);
    put_varint(event, static_cast<std::uint64_t>(step));  // int64: two's complement, as protobuf encodes it
  }
  return event;
}

}  // namespace

std::uint32_t crc32c(std::string_view bytes) {
  static const auto table = crc32c_table();
  std::uint32_t crc = 0xFFFFFFFFu;
  for (const char c : bytes) crc = table[(crc ^ static_cast<unsigned char>(c)) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

std::uint32_t masked_crc(std::uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u; }

std::string record(std::string_view data) {
  std::string length;
  put_fixed(length, data.size(), 8);
  std::string out = length;
  put_fixed(out, masked_crc(crc32c(length)), 4);
  out.append(data.data(), data.size());
  put_fixed(out, masked_crc(crc32c(data)), 4);
  return out;
}

std::string version_event(double wall_time) {
  std::string event = event_head(wall_time, 0);
  put_bytes(event, kFileVersion, "brain.Event:2");
  return record(event);
}

std::string scalars_event(double wall_time, std::int64_t step, const Scalars& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string entry;
    put_bytes(entry, kTag, tag);
    put_float(entry, kSimpleValue, value);
    put_bytes(summary, kSummaryValue, entry);
  }
  std::string event = event_head(wall_time, step);
  put_bytes(event, kSummary, summary);
  return record(event);
}

}  // namespace loom::formats::tensorboard
