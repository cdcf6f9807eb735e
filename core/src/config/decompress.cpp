#include "config/decompress.hpp"

#include <algorithm>
#include <cstring>

#include <zlib.h>
#include <zstd.h>

#include "loom/error.hpp"

namespace loom::core {
namespace {

// Raw snappy (the format Parquet's SNAPPY pages hold): a varint of the inflated size, then
// literals and back-references. Written here: the format is a page long and a library for it
// would be one more dependency.
std::string snappy(const std::uint8_t* p, std::size_t n, std::size_t expected, const std::string& where) {
  const std::uint8_t* const end = p + n;
  const auto fail = [&](const std::string& why) { return UserError(where + "snappy data is corrupt (" + why + ")"); };
  std::uint64_t declared = 0;
  for (int shift = 0;; shift += 7) {
    if (p == end || shift > 28) throw fail("bad length preamble");
    declared |= static_cast<std::uint64_t>(*p & 0x7f) << shift;
    if (!(*p++ & 0x80)) break;
  }
  if (declared != expected) throw fail("it inflates to " + std::to_string(declared) + " bytes where the page says " + std::to_string(expected));
  // A back-reference of 3 input bytes yields at most 64: a larger claim cannot be honest.
  if (expected > 22 * n + 64) throw fail("it claims " + std::to_string(expected) + " bytes from " + std::to_string(n));
  std::string out;
  out.reserve(expected);
  while (p < end) {
    const std::uint8_t tag = *p++;
    std::size_t length = 0, offset = 0;
    const auto little_endian = [&](int bytes) {
      if (end - p < bytes) throw fail("truncated element");
      std::size_t v = 0;
      for (int i = 0; i < bytes; ++i) v |= static_cast<std::size_t>(p[i]) << (8 * i);
      p += bytes;
      return v;
    };
    switch (tag & 3) {
      case 0: {
        length = tag >> 2;
        if (length >= 60) length = little_endian(static_cast<int>(length) - 59);
        ++length;
        if (static_cast<std::size_t>(end - p) < length || length > expected - out.size()) throw fail("literal runs past the end");
        out.append(reinterpret_cast<const char*>(p), length);
        p += length;
        continue;
      }
      case 1:
        length = ((tag >> 2) & 7) + 4;
        offset = (static_cast<std::size_t>(tag >> 5) << 8) | little_endian(1);
        break;
      case 2:
        length = (tag >> 2) + 1;
        offset = little_endian(2);
        break;
      default:
        length = (tag >> 2) + 1;
        offset = little_endian(4);
    }
    if (offset == 0 || offset > out.size()) throw fail("a back-reference points before the start");
    if (length > expected - out.size()) throw fail("a back-reference runs past the end");
    for (std::size_t i = 0; i < length; ++i) out.push_back(out[out.size() - offset]);  // may overlap itself
  }
  if (out.size() != expected) throw fail("it ends after " + std::to_string(out.size()) + " of " + std::to_string(expected) + " bytes");
  return out;
}

// Grows `out` as the inflated bytes come, never past `expected` + 1 (one byte more tells too much).
template <class Step>
std::string inflate_bounded(std::size_t expected, const std::string& where, const char* name, Step step) {
  std::string out(std::min<std::size_t>(expected + 1, std::size_t{1} << 16), '\0');
  std::size_t produced = 0;
  for (;;) {
    if (produced == out.size()) {
      if (out.size() > expected) break;
      out.resize(std::min(expected + 1, out.size() * 2));
    }
    bool finished = false;
    produced += step(reinterpret_cast<std::uint8_t*>(out.data()) + produced, out.size() - produced, finished);
    if (finished) break;
  }
  if (produced != expected)
    throw UserError(where + name + " data inflates to " + (produced > expected ? "more than " + std::to_string(expected) : std::to_string(produced)) +
                    " bytes where the page says " + std::to_string(expected));
  out.resize(produced);
  return out;
}

std::string gzip(const std::uint8_t* p, std::size_t n, std::size_t expected, const std::string& where) {
  z_stream z{};
  if (inflateInit2(&z, 15 + 32) != Z_OK) throw UserError(where + "cannot start zlib");  // 15 + 32: gzip or zlib headers
  struct Ender { z_stream* z; ~Ender() { inflateEnd(z); } } ender{&z};
  z.next_in = const_cast<Bytef*>(p);
  z.avail_in = static_cast<uInt>(std::min<std::size_t>(n, 1u << 30));
  return inflate_bounded(expected, where, "gzip", [&](std::uint8_t* out, std::size_t room, bool& finished) {
    z.next_out = out;
    z.avail_out = static_cast<uInt>(std::min<std::size_t>(room, 1u << 30));
    const int rc = inflate(&z, Z_NO_FLUSH);
    const std::size_t made = std::min<std::size_t>(room, 1u << 30) - z.avail_out;
    if (rc == Z_STREAM_END) {
      finished = z.avail_in == 0;
      if (!finished && inflateReset(&z) != Z_OK) throw UserError(where + "gzip data is corrupt");  // another gzip member follows
    } else if (rc != Z_OK && !(rc == Z_BUF_ERROR && made > 0)) {
      throw UserError(where + "gzip data is corrupt (" + (z.msg ? z.msg : "ends early") + ")");
    }
    return made;
  });
}

std::string zstd(const std::uint8_t* p, std::size_t n, std::size_t expected, const std::string& where) {
  ZSTD_DStream* stream = ZSTD_createDStream();
  if (!stream) throw UserError(where + "cannot start zstd");
  struct Ender { ZSTD_DStream* s; ~Ender() { ZSTD_freeDStream(s); } } ender{stream};
  ZSTD_inBuffer in{p, n, 0};
  return inflate_bounded(expected, where, "zstd", [&](std::uint8_t* out, std::size_t room, bool& finished) {
    ZSTD_outBuffer o{out, room, 0};
    const std::size_t rc = ZSTD_decompressStream(stream, &o, &in);
    if (ZSTD_isError(rc)) throw UserError(where + "zstd data is corrupt (" + ZSTD_getErrorName(rc) + ")");
    if (in.pos == in.size && rc == 0) finished = true;  // every frame complete and flushed
    else if (in.pos == in.size && o.pos == 0) throw UserError(where + "zstd data ends in the middle of a frame");
    return o.pos;
  });
}

}  // namespace

std::string decompress(Codec codec, const std::uint8_t* data, std::size_t size, std::size_t expected, const std::string& where) {
  switch (codec) {
    case Codec::kSnappy: return snappy(data, size, expected, where);
    case Codec::kGzip: return gzip(data, size, expected, where);
    case Codec::kZstd: return zstd(data, size, expected, where);
    case Codec::kNone: break;
  }
  if (size != expected) throw UserError(where + "an uncompressed page of " + std::to_string(size) + " bytes says it holds " + std::to_string(expected));
  return std::string(reinterpret_cast<const char*>(data), size);
}

}  // namespace loom::core
