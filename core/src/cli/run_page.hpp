#pragma once
// `loom report RUN_DIR`: one self-contained HTML page about a run folder (no network, no files
// beside it): a curve of every scalar in metrics.jsonl, the plan's per-device table beside the
// measured peaks, where the outputs are, and the manifest. A run writes it when it ends.
#include <filesystem>
#include <string>

namespace loom::core {

// The page for `run_dir`; UserError when the folder holds no run.json or an unreadable one.
// Damaged metrics lines (a run killed mid-write) are left out and counted on the page.
std::string run_page_html(const std::filesystem::path& run_dir);

// Writes the page atomically to `output` (default RUN_DIR/report.html) and returns where.
std::filesystem::path write_run_page(const std::filesystem::path& run_dir, std::filesystem::path output = {});

}  // namespace loom::core
