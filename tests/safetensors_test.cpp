#include <gtest/gtest.h>

#include <limits>

#include <ATen/ATen.h>

#include "loom/error.hpp"
#include "loom/kit/atomic_file.hpp"
#include "loom/kit/safetensors.hpp"
#include "test_support.hpp"

namespace loom {
namespace {
namespace fs = std::filesystem;

// A file with this header text and `data_bytes` zero bytes of data.
fs::path craft(const std::string& header, std::size_t data_bytes, std::uint64_t claimed_length = UINT64_MAX) {
  const fs::path path = test::temp_dir() / "crafted.safetensors";
  std::string bytes(8, '\0');
  const std::uint64_t len = claimed_length == UINT64_MAX ? header.size() : claimed_length;
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(len >> (8 * i));
  bytes += header;
  bytes += std::string(data_bytes, '\0');
  test::write_file(path, bytes);
  return path;
}

std::string error_of(const fs::path& path) {
  try {
    kit::SafetensorsFile f(path);
  } catch (const UserError& e) {
    return e.what();
  }
  return "accepted";
}

TEST(Safetensors, RoundTripsEveryDtypeAndMetadata) {
  const fs::path path = test::temp_dir() / "t.safetensors";
  const auto a = at::arange(12, at::kFloat).reshape({3, 4});
  const auto b = at::arange(5, at::kLong);
  const auto c = at::ones({2, 2}, at::kBFloat16) * 1.5;
  const auto d = at::arange(6, at::kFloat).reshape({2, 3}).t();  // not contiguous
  kit::write_safetensors(path, {{"a", a}, {"b", b}, {"c", c}, {"d", d}}, {{"format", "pt"}});
  kit::SafetensorsFile f(path);
  ASSERT_EQ(f.tensors().size(), 4u);
  EXPECT_EQ(f.find("c")->dtype, "BF16");
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_TRUE(at::equal(f.tensor("a"), a));
  EXPECT_TRUE(at::equal(f.tensor("b"), b));
  EXPECT_TRUE(at::equal(f.tensor("c"), c));
  EXPECT_TRUE(at::equal(f.tensor("d"), d));
  EXPECT_THROW(f.tensor("e"), UserError);
  // Every dtype loom loads, written and read back bit for bit under its safetensors name.
  const std::vector<std::pair<at::ScalarType, std::string>> dtypes = {
      {at::kDouble, "F64"}, {at::kFloat, "F32"}, {at::kHalf, "F16"}, {at::kBFloat16, "BF16"}, {at::kLong, "I64"},
      {at::kInt, "I32"},    {at::kShort, "I16"}, {at::kChar, "I8"},   {at::kByte, "U8"},      {at::kBool, "BOOL"}};
  std::vector<std::pair<std::string, at::Tensor>> all;
  for (const auto& [dtype, name] : dtypes) {
    // Values that use the type's range: negatives, fractions and extremes where it has them.
    at::Tensor t = at::tensor({-3.5, 0.0, 1.0, 2.25, 100.0, -128.0}).to(dtype);
    if (at::isFloatingType(dtype)) t = at::cat({t, at::tensor({std::numeric_limits<double>::infinity()}).to(dtype)});
    all.emplace_back(name, t.reshape({-1, 1}));
  }
  const fs::path every = test::temp_dir() / "every.safetensors";
  kit::write_safetensors(every, all);
  kit::SafetensorsFile e(every);
  ASSERT_EQ(e.tensors().size(), dtypes.size());
  for (const auto& [name, t] : all) {
    ASSERT_NE(e.find(name), nullptr) << name;
    EXPECT_EQ(e.find(name)->dtype, name);
    const at::Tensor back = e.tensor(name);
    EXPECT_EQ(back.scalar_type(), t.scalar_type()) << name;
    EXPECT_TRUE(at::equal(back, t)) << name;
  }
  // The header is padded so the data starts 8-byte aligned, and tensors outlive the file object.
  at::Tensor kept;
  {
    kit::SafetensorsFile g(path);
    kept = g.tensor("a");
  }
  EXPECT_TRUE(at::equal(kept, a));
}

TEST(Safetensors, HostileFilesAreCleanErrors) {
  const std::string ok = R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  EXPECT_EQ(error_of(craft(ok, 16)), "accepted");

  const fs::path tiny = test::temp_dir() / "tiny.safetensors";
  test::write_file(tiny, "abc");
  EXPECT_NE(error_of(tiny).find("shorter than the 8-byte header length"), std::string::npos);
  EXPECT_NE(error_of(craft(ok, 8)).find("lie past the end of the data (8 bytes; truncated file?)"), std::string::npos);
  EXPECT_NE(error_of(craft(ok, 16, 1ull << 40)).find("header claims 1099511627776 bytes but the file has"), std::string::npos);
  EXPECT_NE(error_of(craft("{not json", 0)).find("(header):1:3: not valid JSON: at \"ot json\""), std::string::npos);
  EXPECT_NE(error_of(craft(R"([1,2])", 0)).find("header is not a JSON object"), std::string::npos);
  EXPECT_NE(error_of(craft(R"({"w":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})", 4)).find("unknown dtype \"F33\""), std::string::npos);
  EXPECT_NE(error_of(craft(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8))
                .find("shape and dtype need 3 x 4 bytes but the span holds 8"),
            std::string::npos);
  EXPECT_NE(error_of(craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12))
                .find("overlaps the tensor before it"),
            std::string::npos);
  EXPECT_NE(error_of(craft(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8)).find("a gap of 4 bytes precedes tensor 'a'"),
            std::string::npos);
  // 100 GB claimed by the shape: refused by arithmetic, nothing allocated.
  EXPECT_NE(error_of(craft(R"({"w":{"dtype":"F32","shape":[25000000000],"data_offsets":[0,100000000000]}})", 16))
                .find("lie past the end of the data"),
            std::string::npos);
  EXPECT_NE(error_of(craft(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,16]}})", 16))
                .find("shape overflows"),
            std::string::npos);
  EXPECT_NE(error_of(craft(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4)).find("not a non-negative integer"),
            std::string::npos);
  EXPECT_NE(error_of(craft(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", 8)).find("begin after they end"), std::string::npos);
  EXPECT_NE(error_of(craft(R"({"w":{"dtype":"F32","shape":[1]}})", 4)).find("lacks dtype, shape or data_offsets"), std::string::npos);
  EXPECT_NE(error_of(test::temp_dir()).find("not a regular file"), std::string::npos);
  EXPECT_NE(error_of("/nonexistent.safetensors").find("cannot open"), std::string::npos);
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {
namespace fs = std::filesystem;

// kit::remove_tree empties and removes a folder depth first, removes links without following them, and
// takes a missing path as done.
TEST(RemoveTree, RemovesNestedFoldersNotWhatLinksPointTo) {
  const fs::path dir = test::temp_dir();
  test::write_file(dir / "keep/file", "kept");
  test::write_file(dir / "gone/a/b/c.txt", "x");
  test::write_file(dir / "gone/d.txt", "y");
  fs::create_symlink(dir / "keep", dir / "gone/a/link");
  EXPECT_TRUE(kit::remove_tree(dir / "gone"));
  EXPECT_FALSE(fs::exists(dir / "gone"));
  EXPECT_EQ(test::read_file(dir / "keep/file"), "kept");
  EXPECT_TRUE(kit::remove_tree(dir / "gone"));  // already gone
  test::write_file(dir / "single", "z");
  EXPECT_TRUE(kit::remove_tree(dir / "single"));
  EXPECT_FALSE(fs::exists(dir / "single"));
}

}  // namespace
}  // namespace loom
