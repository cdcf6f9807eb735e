// `loom report`: the run folder's page, from folders as a run leaves them and as they may be found
// (no manifest, a damaged one, metrics torn by a kill or written by something else). What a browser
// makes of the page is checked by the run_page_in_chromium test (tests/run_outputs).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "cli/run_page.hpp"
#include "test_support.hpp"

namespace loom {
namespace {
using namespace test;

std::size_t count_of(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// The page's data block, parsed back.
nlohmann::json page_data(const std::string& html) {
  const std::string open = "<script type=\"application/json\" id=\"loom-data\">";
  const auto from = html.find(open);
  EXPECT_NE(from, std::string::npos);
  const auto to = html.find("</script>", from);
  return nlohmann::json::parse(html.substr(from + open.size(), to - from - open.size()));
}

nlohmann::json plan_manifest() {
  nlohmann::json blocks = nlohmann::json::array();
  for (const char* b : {"embed", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "head"}) blocks.push_back({{"block", b}, {"device", "cuda:0"}});
  return {{"created", "2026-12-04T00:00:00Z"},
          {"command", {"loom", "run", "p.toml"}},
          {"plan",
           {{"strategy", "auto"},
            {"mesh", {{"world", 1}, {"data", 1}, {"pipeline", 1}, {"tensor", 1}}},
            {"devices", {{{"rank", 0}, {"device", "cuda:0"}, {"weights_bytes", 1 << 20}, {"total_bytes", 3 << 20}}}},
            {"ranks", {{{"rank", 0}, {"blocks", blocks}}}}}}};
}

TEST(RunPage, FoldersWithoutAReadableRunAreOneClearError) {
  const auto dir = temp_dir();
  auto r = run_loom({"report", (dir / "absent").string()});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "is not a folder; give the output folder of a `loom run`")) << r.err;
  r = run_loom({"report", dir.string()});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "holds no run (no run.json)")) << r.err;
  write_file(dir / "run.json", "{\"plan\": [1, 2,\n");
  r = run_loom({"report", dir.string()});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, (dir / "run.json").string() + ":2:")) << r.err;
  write_file(dir / "run.json", "[1, 2]");
  r = run_loom({"report", dir.string()});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "not a run manifest")) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir / "report.html"));
}

TEST(RunPage, ShowsThePlanBesideThePeaksAndEscapesWhatTheFilesHold) {
  const auto dir = temp_dir();
  auto manifest = plan_manifest();
  manifest["pipeline_file"] = "</script><b>x</b>.toml";
  write_file(dir / "run.json", manifest.dump());
  write_file(dir / "metrics.jsonl",
             "{\"step\": 1, \"loss\": 2.5, \"peak_memory_bytes\": {\"cuda:0\": 2097152}}\n"
             "{\"step\": 2, \"loss\": 1.5, \"</script><i>\": 1, \"note<!--<script>\": 2}\n"
             "[1, 2]\n"
             "{\"step\": 2, \"eval\": true, \"eval_loss\": 1.25, \"exact_match\": 0.5}\n"
             "{\"step\": 3, \"lo");
  const auto r = run_loom({"report", dir.string(), "--output", (dir / "page.html").string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "wrote " + (dir / "page.html").string() + "\n");
  const std::string html = read_file(dir / "page.html");
  EXPECT_EQ(count_of(html, "</script>"), 2u) << "only the page's own two script blocks end";
  // Nor can a "<!--" (after which the HTML spec runs the data block on through the page's own
  // script): every "<" of the data is written \u003c.
  const std::string block = html.substr(html.find("id=\"loom-data\">"), html.find("</script>") - html.find("id=\"loom-data\">"));
  EXPECT_EQ(count_of(block, "<"), 0u) << block;
  EXPECT_EQ(count_of(html, "<b>x"), 0u);
  EXPECT_TRUE(contains(html, "&lt;/script&gt;&lt;b&gt;x&lt;/b&gt;.toml"));
  EXPECT_TRUE(contains(html, "2 line(s) of metrics.jsonl could not be read"));
  // The plan's row: the folded blocks, planned total beside the measured peak.
  EXPECT_TRUE(contains(html, "<tr data-device=\"cuda:0\"><td>0</td><td>cuda:0</td><td>embed, layers.0-3, norm, head</td><td>1.00 MiB</td>")) << html;
  EXPECT_TRUE(contains(html, "<td>3.00 MiB</td><td>2.00 MiB</td>"));

  const auto data = page_data(html);
  std::vector<std::string> tags;
  for (const auto& s : data["series"]) tags.push_back(s["tag"]);
  EXPECT_EQ(tags, (std::vector<std::string>{"train/loss", "train/peak_memory_gib/cuda:0", "train/</script><i>", "train/note<!--<script>", "eval/loss",
                                            "eval/exact_match"}));
  EXPECT_EQ(data["series"][0]["steps"], nlohmann::json({1, 2}));
  EXPECT_EQ(data["series"][0]["values"], nlohmann::json({2.5, 1.5}));
}

TEST(RunPage, LongRunsKeepEveryNthPointAndTheLast) {
  const auto dir = temp_dir();
  write_file(dir / "run.json", plan_manifest().dump());
  std::string rows;
  for (int step = 1; step <= 7001; ++step) rows += "{\"step\": " + std::to_string(step) + ", \"loss\": " + std::to_string(1.0 / step) + "}\n";
  write_file(dir / "metrics.jsonl", rows);
  const auto data = page_data(core::run_page_html(dir));
  const auto& loss = data["series"][0];
  EXPECT_EQ(loss["every"], 3);
  EXPECT_EQ(loss["points"], 7001);
  EXPECT_EQ(loss["steps"].size(), 2335u);  // steps 1, 4, ..., 7000 and 7001
  EXPECT_EQ(loss["steps"].back(), 7001);
  // No metrics yet (a run before its first logged step): a page that says so.
  std::filesystem::remove(dir / "metrics.jsonl");
  EXPECT_TRUE(core::run_page_html(dir).find("no metrics yet") != std::string::npos);
}

}  // namespace
}  // namespace loom
