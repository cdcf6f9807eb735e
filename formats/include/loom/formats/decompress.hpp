#pragma once
// The page codecs of columnar data files (Parquet): each inflates into exactly the size the file
// declares, never allocating past what the input can really produce, so a hostile size is one
// clear error instead of a giant allocation.
#include <cstddef>
#include <cstdint>
#include <string>

namespace loom::formats {

enum class Codec { kNone, kSnappy, kGzip, kZstd };

// `size` bytes of `data` in `codec` inflated to `expected` bytes; anything else (corrupt input,
// more or fewer bytes than expected) is a UserError starting with `where`.
std::string decompress(Codec codec, const std::uint8_t* data, std::size_t size, std::size_t expected, const std::string& where);

}  // namespace loom::formats
