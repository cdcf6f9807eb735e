#include <gtest/gtest.h>

#include "config/diagnostics.hpp"

namespace loom::core {
namespace {

TEST(DidYouMean, FindsCloseNames) {
  EXPECT_EQ(closest_match("outptu_dir", {"output_dir", "seed", "dtype"}), "output_dir");
  EXPECT_EQ(closest_match("lama", {"llama", "single"}), "llama");
  EXPECT_EQ(closest_match("Seed", {"seed"}), "seed");
  EXPECT_EQ(closest_match("completely_else", {"seed", "dtype"}), "");
}

TEST(Diagnostics, SortsByPositionWithinFileAndKeepsAll) {
  Diagnostics d;
  d.add({"p.toml", 9, 1}, "late");
  d.add({"p.toml", 2, 5}, "early");
  d.add({"p.toml", 0, 0}, "file-level");
  try {
    d.throw_if_any();
    FAIL();
  } catch (const PipelineError& e) {
    ASSERT_EQ(e.diagnostics().size(), 3u);
    EXPECT_EQ(e.diagnostics()[0].str(), "p.toml: file-level");
    EXPECT_EQ(e.diagnostics()[1].str(), "p.toml:2:5: early");
    EXPECT_EQ(e.diagnostics()[2].str(), "p.toml:9:1: late");
    EXPECT_EQ(std::string(e.what()), "p.toml: file-level\np.toml:2:5: early\np.toml:9:1: late");
  }
}

}  // namespace
}  // namespace loom::core
