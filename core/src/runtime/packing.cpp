#include "runtime/packing.hpp"

#include <algorithm>
#include <numeric>
#include <stdexcept>

#include "loom/error.hpp"

namespace loom::core {

Packer parse_packer(const std::string& name) {
  if (name == "first_fit_decreasing") return Packer::kFirstFitDecreasing;
  if (name == "greedy") return Packer::kGreedy;
  throw UserError("packer \"" + name + "\": use \"first_fit_decreasing\" or \"greedy\"");
}

PackedRows pack_rows(const std::vector<std::int64_t>& length, std::int64_t row_length, Packer packer) {
  std::vector<std::size_t> order(length.size());
  std::iota(order.begin(), order.end(), 0);
  if (packer == Packer::kFirstFitDecreasing)
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return length[a] > length[b]; });
  PackedRows out;
  std::vector<std::int64_t> used;  // what each row holds
  for (const std::size_t i : order) {
    if (length[i] == 0) continue;
    std::size_t row = out.rows.size();
    if (packer == Packer::kFirstFitDecreasing) {
      for (std::size_t r = 0; r < out.rows.size(); ++r)
        if (used[r] + length[i] <= row_length) {
          row = r;
          break;
        }
    } else if (!out.rows.empty() && used.back() + length[i] <= row_length) {
      row = out.rows.size() - 1;
    }
    if (row == out.rows.size()) {
      out.rows.emplace_back();
      used.push_back(0);
    }
    out.rows[row].push_back(i);
    used[row] += length[i];
  }
  out.longest = used.empty() ? 0 : *std::max_element(used.begin(), used.end());
  return out;
}

Batch pack_samples(const std::vector<Batch>& samples, std::int64_t row_length, Packer packer, std::int64_t pad_id) {
  std::vector<std::int64_t> length(samples.size());
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const Batch& s = samples[i];
    if (s.rows != 1 || static_cast<std::int64_t>(s.input_ids.size()) != s.cols || s.labels.size() != s.input_ids.size() ||
        s.attention_mask.size() != s.input_ids.size())
      throw std::logic_error("pack_samples: a sample is not one row of ids, mask and labels");
    length[i] = std::count(s.attention_mask.begin(), s.attention_mask.end(), 1);
    if (length[i] > row_length) throw std::logic_error("pack_samples: a sample longer than the row");
  }
  const PackedRows packed = pack_rows(length, row_length, packer);
  const auto& rows = packed.rows;
  Batch out;
  out.rows = static_cast<std::int64_t>(rows.size());
  out.cols = packed.longest;
  for (const auto& s : samples) out.skipped += s.skipped;
  const auto cells = static_cast<std::size_t>(out.rows * out.cols);
  out.input_ids.assign(cells, pad_id);
  out.attention_mask.assign(cells, 0);
  out.labels.assign(cells, -100);
  for (std::size_t r = 0; r < rows.size(); ++r) {
    std::size_t at = r * static_cast<std::size_t>(out.cols);
    std::int64_t segment = 0;
    for (const std::size_t i : rows[r]) {
      ++segment;
      const Batch& s = samples[i];
      bool first = true;
      for (std::size_t t = 0; t < s.input_ids.size(); ++t) {
        if (s.attention_mask[t] != 1) continue;  // a collator's padding, if any
        out.input_ids[at] = s.input_ids[t];
        out.attention_mask[at] = segment;
        out.labels[at] = first ? -100 : s.labels[t];
        first = false;
        ++at;
      }
    }
  }
  return out;
}

}  // namespace loom::core
