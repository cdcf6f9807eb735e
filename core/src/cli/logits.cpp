#include "cli/logits.hpp"

#include <vector>

#include <ATen/ATen.h>

#include "loom/error.hpp"
#include "loom/kit/json.hpp"

namespace loom::core {
namespace {

// A real request is a few rows of a few thousand tokens; the bound keeps a wrong file from being read whole.
constexpr std::uintmax_t kMaxInputBytes = 256u << 20;
constexpr std::int64_t kMaxRows = 4096;

// A rectangular [rows, cols] table of integers in [lo, hi] from `v`, or rows x cols of `absent` when missing.
at::Tensor table(const kit::json::Value& v, std::int64_t rows, std::int64_t cols, std::int64_t lo, std::int64_t hi) {
  v.array();
  if (static_cast<std::int64_t>(v.size()) != rows)
    v.fail("has " + std::to_string(v.size()) + " rows; input_ids has " + std::to_string(rows));
  std::vector<std::int64_t> flat;
  flat.reserve(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r) {
    const kit::json::Value row = v[static_cast<std::size_t>(r)];
    row.array();
    if (static_cast<std::int64_t>(row.size()) != cols)
      row.fail("has " + std::to_string(row.size()) + " entries; every row needs " + std::to_string(cols) + " (pad on the left and mask the padding)");
    for (std::size_t c = 0; c < row.size(); ++c) flat.push_back(row[c].integer(lo, hi));
  }
  return at::tensor(flat, at::kLong).view({rows, cols});
}

}  // namespace

TokenInputs read_token_inputs(const std::filesystem::path& file, std::int64_t vocab, std::int64_t max_positions) {
  const auto j = kit::json::read_file(file, kMaxInputBytes, "token inputs");
  const kit::json::Value root(j, file.string());
  root.object();
  const kit::json::Value ids = root["input_ids"];
  ids.array();
  const auto rows = static_cast<std::int64_t>(ids.size());
  if (rows == 0 || rows > kMaxRows) ids.fail("needs 1 to " + std::to_string(kMaxRows) + " rows of token ids, found " + std::to_string(rows));
  ids[0].array();
  const auto cols = static_cast<std::int64_t>(ids[0].size());
  if (cols == 0 || (max_positions > 0 && cols > max_positions))
    ids[0].fail("rows need 1 to " + std::to_string(max_positions) + " tokens (the model's positions), found " + std::to_string(cols));
  TokenInputs in;
  in.ids = table(ids, rows, cols, 0, vocab - 1);
  in.mask = root.has("attention_mask") ? table(root["attention_mask"], rows, cols, 0, 1) : at::ones({rows, cols}, at::kLong);
  if (in.mask.sum(1).min().item<std::int64_t>() == 0) root["attention_mask"].fail("a row masks every token; each row needs a real one");
  in.positions = root.has("position_ids") ? table(root["position_ids"], rows, cols, 0, max_positions > 0 ? max_positions - 1 : INT64_MAX)
                                          : (in.mask.cumsum(1) - 1).clamp_min(0);
  return in;
}

double max_real_difference(const at::Tensor& a, const at::Tensor& b, const at::Tensor& mask) {
  const at::Tensor real = mask.to(at::kBool).unsqueeze(-1).expand_as(a);
  return (a.to(at::kDouble) - b.to(a.device(), at::kDouble)).abs().masked_select(real).max().item<double>();
}

}  // namespace loom::core
