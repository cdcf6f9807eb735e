#include <gtest/gtest.h>

#include "loom/devices.hpp"
#include "loom/error.hpp"
#include "loom/options.hpp"
#include "planner/planner.hpp"

namespace loom {
namespace {

TEST(Bytes, ParsesUnits) {
  EXPECT_EQ(parse_bytes("16GiB"), 16ull << 30);
  EXPECT_EQ(parse_bytes(" 1.5 GiB "), 3ull << 29);
  EXPECT_EQ(parse_bytes("512MiB"), 512ull << 20);
  EXPECT_EQ(parse_bytes("40GB"), 40000000000ull);
  EXPECT_EQ(parse_bytes("4096"), 4096u);
  EXPECT_EQ(parse_bytes("10B"), 10u);
  for (const char* bad : {"", "GiB", "16 gigs", "1.2.3GiB", "-5GiB", "99999999999TiB"}) EXPECT_THROW(parse_bytes(bad), UserError) << bad;
}

TEST(Bytes, Formats) {
  EXPECT_EQ(format_bytes(12), "12 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(14ull << 30), "14.00 GiB");
}

TEST(Devices, ParsesNames) {
  EXPECT_EQ(parse_device("cpu").str(), "cpu");
  EXPECT_EQ(parse_device("cuda").str(), "cuda:0");
  EXPECT_EQ(parse_device("cuda:3").str(), "cuda:3");
  for (const char* bad : {"gpu", "cuda:", "cuda:x", "cuda:-1", "CUDA:0", "cuda:99999"}) EXPECT_THROW(parse_device(bad), UserError) << bad;
}

TEST(Devices, ParsesSimulatedInventory) {
  const auto inv = core::parse_inventory("cuda:0=16GiB, cuda:1=15GiB,cpu=64GiB");
  ASSERT_EQ(inv.devices.size(), 3u);
  EXPECT_TRUE(inv.simulated);
  EXPECT_EQ(inv.find("cuda:1")->capacity_bytes, 15ull << 30);
  EXPECT_EQ(inv.find("cuda:2"), nullptr);
  EXPECT_THROW(core::parse_inventory("cuda:0=16GiB,cuda:0=1GiB"), UserError);
  EXPECT_THROW(core::parse_inventory("cuda:0"), UserError);
  EXPECT_THROW(core::parse_inventory(""), UserError);
  EXPECT_THROW(core::parse_inventory("tpu:0=1GiB"), UserError);
}

TEST(Dtype, ParsesKnownNames) {
  EXPECT_EQ(parse_dtype("bf16"), DType::kBFloat16);
  EXPECT_EQ(dtype_bytes(parse_dtype("fp32")), 4u);
  EXPECT_THROW(parse_dtype("fp64"), UserError);
}

TEST(OptionSpec, DescribesTypesAndValues) {
  EXPECT_EQ(option_type_name(kString | kIntList), "string or list of integers");
  EXPECT_EQ(option_type_name(kBool | kInt | kFloat), "boolean, integer or float");
  EXPECT_EQ(format_option_value(OptionValue{StringList{"q_proj", "v_proj"}}), "[\"q_proj\", \"v_proj\"]");
  EXPECT_EQ(format_option_value(OptionValue{2.0}), "2.0");
  EXPECT_EQ(format_option_value(OptionValue{StringMap{{"cuda:0", "14GiB"}}}), "{ \"cuda:0\" = \"14GiB\" }");
  EXPECT_THROW(OptionSpec::any_of("x", kInt, OptionValue{std::string("a")}, "doc"), std::logic_error);
}

TEST(Options, TypedAccessOfUndeclaredOptionIsAPluginBug) {
  Options o;
  o.set("r", std::int64_t{8});
  EXPECT_EQ(o.get_int("r"), 8);
  EXPECT_THROW(o.get_string("r"), std::logic_error);
  EXPECT_THROW(o.get_int("alpha"), std::logic_error);
}

}  // namespace
}  // namespace loom
