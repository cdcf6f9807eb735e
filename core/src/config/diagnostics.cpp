#include "config/diagnostics.hpp"

#include <algorithm>
#include <cctype>
#include <tuple>

namespace loom::core {
namespace {

std::string join_lines(const std::vector<Diagnostic>& ds) {
  std::string out;
  for (std::size_t i = 0; i < ds.size(); ++i) out += (i ? "\n" : "") + ds[i].str();
  return out;
}

std::size_t edit_distance(const std::string& a, const std::string& b) {
  // Optimal string alignment distance: a transposition counts as one edit ("seed" vs "sede").
  const std::size_t n = a.size(), m = b.size();
  std::vector<std::vector<std::size_t>> d(n + 1, std::vector<std::size_t>(m + 1));
  for (std::size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= n; ++i) {
    for (std::size_t j = 1; j <= m; ++j) {
      const bool same = std::tolower(static_cast<unsigned char>(a[i - 1])) == std::tolower(static_cast<unsigned char>(b[j - 1]));
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (same ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[n][m];
}

}  // namespace

std::string Location::str() const {
  if (line <= 0) return file;
  return file + ":" + std::to_string(line) + ":" + std::to_string(column);
}

std::string Diagnostic::str() const { return where.str() + ": " + message; }

void Diagnostics::add(Location where, std::string message) { items_.push_back({std::move(where), std::move(message)}); }

void Diagnostics::throw_if_any() const {
  if (items_.empty()) return;
  // Files keep the order they were first reported in; within a file, problems go by position.
  std::vector<std::string> files;
  for (const auto& d : items_)
    if (std::find(files.begin(), files.end(), d.where.file) == files.end()) files.push_back(d.where.file);
  const auto rank = [&](const Diagnostic& d) {
    return std::make_tuple(std::find(files.begin(), files.end(), d.where.file) - files.begin(), d.where.line, d.where.column);
  };
  auto sorted = items_;
  std::stable_sort(sorted.begin(), sorted.end(), [&](const Diagnostic& a, const Diagnostic& b) { return rank(a) < rank(b); });
  throw PipelineError(std::move(sorted));
}

PipelineError::PipelineError(std::vector<Diagnostic> diagnostics)
    : UserError(join_lines(diagnostics)), diagnostics_(std::move(diagnostics)) {}

std::string closest_match(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  std::size_t best_distance = std::max<std::size_t>(2, word.size() / 3) + 1;
  for (const auto& c : candidates) {
    const std::size_t d = edit_distance(word, c);
    if (d < best_distance) {
      best_distance = d;
      best = c;
    }
  }
  return best;
}

std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates) {
  const std::string m = closest_match(word, candidates);
  return m.empty() ? "" : ", did you mean '" + m + "'?";
}

}  // namespace loom::core
