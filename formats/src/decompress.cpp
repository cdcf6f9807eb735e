#include "loom/formats/decompress.hpp"

#include <algorithm>
#include <cstring>

#include <snappy.h>
#include <zlib.h>
#include <zstd.h>

#include "loom/error.hpp"

namespace loom::formats {
namespace {

// Raw snappy (what Parquet's SNAPPY pages hold), by Google's libsnappy: the declared size is
// checked against the page's before anything is allocated, and the whole input is validated
// before it is inflated.
std::string snappy(const std::uint8_t* p, std::size_t n, std::size_t expected, const std::string& where) {
  const char* in = reinterpret_cast<const char*>(p);
  const auto fail = [&](const std::string& why) { return UserError(where + "snappy data is corrupt (" + why + ")"); };
  std::size_t declared = 0;
  if (!snappy::GetUncompressedLength(in, n, &declared)) throw fail("bad length preamble");
  if (declared != expected) throw fail("it inflates to " + std::to_string(declared) + " bytes where the page says " + std::to_string(expected));
  if (!snappy::IsValidCompressedBuffer(in, n)) throw fail("its elements do not decode");
  std::string out(expected, '\0');
  if (!snappy::RawUncompress(in, n, out.data())) throw fail("its elements do not decode");
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

}  // namespace loom::formats
