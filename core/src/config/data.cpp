#include "config/data.hpp"

#include <cctype>
#include <fstream>
#include <functional>

#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <numeric>

#include <nlohmann/json.hpp>

#include "chat/chat_data.hpp"
#include "loom/error.hpp"
#include "loom/kit/input_file.hpp"
#include "loom/kit/json.hpp"
#include "loom/kit/utf8.hpp"

namespace loom::core {
namespace {

struct Piece {
  bool field;
  std::string text;  // literal text, or the field name
};

std::vector<Piece> parse_format(const std::string& format) {
  std::vector<Piece> pieces;
  std::string literal;
  for (std::size_t i = 0; i < format.size(); ++i) {
    const char c = format[i];
    if ((c == '{' || c == '}') && i + 1 < format.size() && format[i + 1] == c) {
      literal += c;
      ++i;
    } else if (c == '{') {
      const auto close = format.find('}', i);
      if (close == std::string::npos) throw UserError("[data] format: '{' at position " + std::to_string(i) + " is never closed");
      const std::string name = format.substr(i + 1, close - i - 1);
      if (name.empty() || name.find('{') != std::string::npos) throw UserError("[data] format: bad field name \"{" + name + "}\"");
      if (!literal.empty()) pieces.push_back({false, std::move(literal)});
      literal.clear();
      pieces.push_back({true, name});
      i = close;
    } else if (c == '}') {
      throw UserError("[data] format: '}' at position " + std::to_string(i) + " has no '{' (write }} for a literal brace)");
    } else {
      literal += c;
    }
  }
  if (!literal.empty()) pieces.push_back({false, literal});
  if (std::none_of(pieces.begin(), pieces.end(), [](const Piece& p) { return p.field; }))
    throw UserError("[data] format " + kit::json::quote(format) +
                    " names no field (such as {text}): every sample would be the same text; the chat formats are \"messages\", \"sharegpt\" and \"alpaca\"");
  return pieces;
}

}  // namespace

bool read_line(std::istream& in, std::string& line, bool& too_long) {
  line.clear();
  too_long = false;
  char buffer[65536];
  while (true) {
    in.getline(buffer, sizeof buffer);
    const auto got = static_cast<std::size_t>(in.gcount());
    if (in.bad() || (in.fail() && !in.eof() && got == 0)) throw UserError("cannot read the input (is it a regular file?)");
    if (in.fail() && !in.eof() && got == sizeof buffer - 1) {  // the buffer filled before a newline
      in.clear();
      if (line.size() + got > kMaxRecordBytes) too_long = true;
      else line.append(buffer, got);
      continue;
    }
    if (got == 0 && in.eof() && line.empty()) return false;
    const std::size_t tail = got > 0 && !in.eof() ? got - 1 : got;  // without the newline
    if (line.size() + tail > kMaxRecordBytes) too_long = true;
    if (!too_long) line.append(buffer, tail);
    if (in.eof()) in.clear(std::ios::eofbit);
    return true;
  }
}

void check_format(const std::string& format) {
  if (!is_chat_format(format)) parse_format(format);
}

namespace {

// The whole of a JSON array file is parsed at once: past this, JSON lines stream instead.
constexpr std::uintmax_t kMaxArrayFileBytes = std::uintmax_t{512} << 20;

// One record as [data] format renders it, or as a chat format keeps it (`use`: the conversation
// whole, or an objective's prompt); `where` starts its errors.
std::string render(const nlohmann::ordered_json& record, const std::string& format, const std::vector<Piece>& pieces, const std::string& where,
                   ConversationUse use) {
  if (!record.is_object()) throw UserError(where + "expected a JSON object, found " + kit::json::describe(nlohmann::json(record)));
  if (is_chat_format(format)) {
    try {
      return conversation_to_sample(conversation_from_record(record, format, use));
    } catch (const UserError& e) {
      throw UserError(where + e.what());
    }
  }
  std::string text;
  for (const auto& p : pieces) {
    if (!p.field) {
      text += p.text;
      continue;
    }
    const auto it = record.find(p.text);
    if (it == record.end()) {
      std::string fields;
      for (const auto& [k, v] : record.items()) fields += (fields.empty() ? "" : ", ") + kit::json::quote(k, 40);
      if (fields.size() > 300) fields = fields.substr(0, 300) + "...";
      throw UserError(where + "record has no field '" + p.text + "' used by [data] format (" + (fields.empty() ? "it has none" : "its fields: " + fields) + ")");
    }
    text += it->is_string() ? it->get<std::string>() : it->dump();
  }
  return text;
}

// The next record of a CSV or TSV file (RFC 4180: a field in double quotes may hold the
// delimiter, newlines and "" for a quote; CRLF or LF ends a record) as its fields; false at the
// end. `line` counts the file's lines (the record's first is where it starts). A record past 64 MiB
// or a quote left open is a UserError.
bool read_delimited(std::istream& in, char delimiter, std::vector<std::string>& fields, std::size_t& line, const std::string& file) {
  fields.assign(1, std::string());
  std::size_t bytes = 0;
  bool quoted = false, any = false;
  const std::size_t first = line + 1;
  for (int c = in.get(); c != EOF; c = in.get()) {
    any = true;
    if (++bytes > kMaxRecordBytes) throw UserError(file + ":" + std::to_string(first) + ": record is longer than 64 MiB");
    if (quoted) {
      if (c == '"') {
        if (in.peek() == '"') fields.back() += static_cast<char>(in.get());
        else quoted = false;
      } else {
        if (c == '\n') ++line;
        fields.back() += static_cast<char>(c);
      }
    } else if (c == '"' && fields.back().empty()) {
      quoted = true;
    } else if (c == delimiter) {
      fields.emplace_back();
    } else if (c == '\n' || (c == '\r' && in.peek() == '\n')) {
      if (c == '\r') in.get();
      ++line;
      return true;
    } else {
      fields.back() += static_cast<char>(c);
    }
  }
  if (in.bad()) throw UserError(file + ": cannot read the input (is it a regular file?)");
  if (quoted) throw UserError(file + ":" + std::to_string(first) + ": a quoted field is never closed");
  if (any) ++line;
  return any;
}

}  // namespace

std::string sample_with_record(const std::string& rendered, const nlohmann::ordered_json& record) {
  return nlohmann::ordered_json{{"prompt", rendered}, {"record", record}}.dump();
}

SampleWithRecord split_sample(const std::string& sample) {
  const auto j = nlohmann::ordered_json::parse(sample);
  return {j.at("prompt").get<std::string>(), j.at("record")};
}

std::string Dataset::where(std::size_t i) const {
  return records_by_index ? file + ": record " + std::to_string(lines[i]) : file + ":" + std::to_string(lines[i]);
}

Dataset load_data(const std::filesystem::path& file, const std::string& format, bool skip_bad_lines, std::size_t max_records, bool keep_samples,
                  bool with_records) {
  const auto pieces = is_chat_format(format) ? std::vector<Piece>{} : parse_format(format);
  std::error_code ec;
  const bool folder = std::filesystem::is_directory(file, ec);
  std::unique_ptr<formats::TableRows> table = folder ? formats::open_datasets_folder(file) : formats::is_parquet_file(file) ? formats::open_parquet(file) : formats::is_arrow_file(file) ? formats::open_arrow(file) : nullptr;
  if (!table) ::close(kit::open_regular_file(file, "data file"));
  std::ifstream in;
  if (!table) in.open(file, std::ios::binary);
  if (!table && !in) throw UserError(file.string() + ": cannot read");
  // A text file's byte-order mark (Excel's "CSV UTF-8", Windows editors) is no part of its text.
  std::streamoff text_start = 0;
  if (!table) {
    char head[3] = {0, 0, 0};
    in.read(head, 3);
    text_start = static_cast<std::streamoff>(kit::utf8_bom_size(std::string_view(head, static_cast<std::size_t>(in.gcount()))));
    in.clear();
    in.seekg(text_start);
  }
  Dataset data;
  data.file = file.string();
  // Each record once, as a sample or (under on_bad_line = "skip") counted.
  const auto take = [&](const std::function<nlohmann::ordered_json()>& record, std::size_t number, const std::string& where) {
    try {
      nlohmann::ordered_json fields = record();
      std::string sample = render(fields, format, pieces, where, with_records ? ConversationUse::kPrompt : ConversationUse::kTraining);
      if (with_records) sample = sample_with_record(sample, fields);
      ++data.records;
      if (!keep_samples) return;
      data.samples.push_back(std::move(sample));
      data.lines.push_back(number);
    } catch (const UserError&) {
      if (!skip_bad_lines) throw;
      ++data.skipped_lines;
    }
  };
  const std::string ext = lowercase_extension(file);
  std::size_t number = 0;
  // Columns a table file holds but loom leaves out, named where a record lacks a field.
  const auto unread_hint = [&]() -> std::string {
    if (!table || table->unread_columns().empty()) return "";
    std::string names;
    for (const auto& c : table->unread_columns()) names += (names.empty() ? "" : ", ") + c;
    return "; columns loom does not read: " + names + " (loom reads flat columns of strings, numbers and booleans; write nested data as JSON lines, "
           "e.g. with datasets' to_json)";
  };
  if (table) {
    // Parquet, Arrow and datasets folders: each row a record, numbered from 1.
    data.records_by_index = true;
    nlohmann::ordered_json row;
    while (data.records < max_records && table->next(row)) {
      ++number;
      const std::string where = data.file + ": record " + std::to_string(number) + ": ";
      try {
        take([&] { return std::move(row); }, number, where);
      } catch (const UserError& e) {
        throw UserError(e.what() + unread_hint());
      }
    }
  } else if (ext == ".csv" || ext == ".tsv") {
    // The first record names the columns; every field is a string.
    const char delimiter = ext == ".csv" ? ',' : '\t';
    std::vector<std::string> header, fields;
    std::size_t line = 0;
    if (!read_delimited(in, delimiter, header, line, data.file)) throw UserError(data.file + ": holds no records (a header row and then a record a row is expected)");
    for (std::size_t f = 0; f < header.size(); ++f)
      if (kit::invalid_utf8_at(header[f]) != std::string::npos)
        throw UserError(data.file + ":1: column " + std::to_string(f + 1) + "'s name holds bytes that are not UTF-8 text; save the file as UTF-8");
    formats::check_unique_columns(header, data.file + ":1");
    while (data.records < max_records) {
      const std::size_t starts = line + 1;
      if (!read_delimited(in, delimiter, fields, line, data.file)) break;
      if (fields.size() == 1 && fields[0].find_first_not_of(" \t\r") == std::string::npos) continue;  // a blank line
      ++number;
      const std::string where = data.file + ":" + std::to_string(starts) + ": ";
      take([&] {
        if (fields.size() != header.size())
          throw UserError(where + std::to_string(fields.size()) + " fields where the header names " + std::to_string(header.size()));
        nlohmann::ordered_json record = nlohmann::ordered_json::object();
        for (std::size_t f = 0; f < header.size(); ++f) {
          // Text is UTF-8 in every format (JSON, Parquet and Arrow hold nothing else), whatever
          // the objective does with it.
          if (const auto bad = kit::invalid_utf8_at(fields[f]); bad != std::string::npos)
            throw UserError(where + "column " + kit::json::quote(header[f], 60) + " holds bytes that are not UTF-8 text (byte " + std::to_string(bad + 1) +
                            " of the field); save the file as UTF-8 (Excel: \"CSV UTF-8\")");
          record[header[f]] = fields[f];
        }
        return record;
      }, starts, where);
    }
  } else if (in >> std::ws, in.peek() == '[') {
    // One JSON array of records (json.dump(records)); its elements are numbered from 1.
    in.close();
    data.records_by_index = true;
    const std::string text = kit::without_bom(kit::read_regular_file(file, kMaxArrayFileBytes, "data file (a JSON array; JSON lines have no size limit)"));
    const auto array = kit::json::parse<nlohmann::ordered_json>(text, data.file);
    for (const auto& element : array) {
      if (data.records >= max_records) break;
      ++number;
      take([&] { return element; }, number, data.file + ": record " + std::to_string(number) + ": ");
    }
  } else {
    in.clear();  // skipping whitespace to the end of an empty file set failbit
    in.seekg(text_start);
    std::string line;
    bool too_long = false;
    while (data.records < max_records && read_line(in, line, too_long)) {
      ++number;
      const std::string where = data.file + ":" + std::to_string(number) + ": ";
      if (!too_long && line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank lines are not records
      take([&] {
        if (too_long) throw UserError(where + "line is longer than 64 MiB");
        return kit::json::parse<nlohmann::ordered_json>(line, data.file, kit::json::kMaxDepth, number);
      }, number, where);
    }
  }
  if (data.records == 0)
    throw UserError(data.file + (number == 0 ? table ? ": holds no rows" : ": holds no records (JSON lines, a JSON array of objects, or CSV/TSV with a header row)"
                                             : ": no usable records (every one was bad and skipped)" + unread_hint()));
  return data;
}

std::size_t held_out_count(double split, std::size_t records) {
  return split >= 1 ? static_cast<std::size_t>(split) : static_cast<std::size_t>(std::ceil(split * static_cast<double>(records)));
}

Dataset split_off(Dataset& train, double split, std::uint64_t seed) {
  const std::size_t n = train.samples.size(), held = held_out_count(split, n);
  if (held == 0 || held >= n) {
    char value[32];
    std::snprintf(value, sizeof value, "%g", split);
    throw UserError("[data] eval_split = " + std::string(value) + " holds out " + std::to_string(held) + " of the " + std::to_string(n) +
                    " training records of " + train.file + ", leaving " + (held == 0 ? "no evaluation" : "nothing to train on") +
                    "; hold out between 1 and " + std::to_string(n - 1));
  }
  // A seeded draw apart from the epochs' shuffles; both parts keep the file's order.
  const auto order = epoch_order(n, seed ^ 0x5EED0E7A1ull, 0, true);
  std::vector<bool> is_held(n, false);
  for (std::size_t i = 0; i < held; ++i) is_held[order[i]] = true;
  Dataset eval, kept;
  for (Dataset* part : {&eval, &kept}) {
    part->file = train.file;
    part->records_by_index = train.records_by_index;
  }
  for (std::size_t i = 0; i < n; ++i) {
    Dataset& to = is_held[i] ? eval : kept;
    to.samples.push_back(std::move(train.samples[i]));
    to.lines.push_back(train.lines[i]);
  }
  eval.records = eval.samples.size();
  kept.records = kept.samples.size();
  kept.skipped_lines = train.skipped_lines;
  train = std::move(kept);
  return eval;
}

Dataset mix_datasets(std::vector<Dataset> files, const std::vector<std::int64_t>& weights, std::uint64_t seed) {
  if (files.size() == 1 && weights.empty()) return std::move(files.front());
  std::size_t total = 0;
  std::int64_t weight_sum = 0;
  for (std::size_t i = 0; i < files.size(); ++i) {
    total += files[i].samples.size();
    weight_sum += weights.empty() ? 0 : weights[i];
  }
  // Each file's share of the total by its weight, the remainder to the largest fractions (ties:
  // the earlier file), so the shares add up to the total.
  std::vector<std::size_t> counts(files.size());
  std::vector<std::pair<double, std::size_t>> fractions;
  std::size_t given = 0;
  for (std::size_t i = 0; i < files.size(); ++i) {
    if (weights.empty()) {
      counts[i] = files[i].samples.size();
      continue;
    }
    const double share = static_cast<double>(total) * static_cast<double>(weights[i]) / static_cast<double>(weight_sum);
    counts[i] = static_cast<std::size_t>(share);
    given += counts[i];
    fractions.emplace_back(-(share - static_cast<double>(counts[i])), i);
  }
  std::sort(fractions.begin(), fractions.end());
  for (std::size_t k = 0; !weights.empty() && given < total; ++k, ++given) ++counts[fractions[k % fractions.size()].second];
  Dataset mixed;
  mixed.file = files.front().file;
  for (std::size_t i = 0; i < files.size(); ++i) {
    Dataset& f = files[i];
    const std::size_t n = f.samples.size(), count = counts[i];
    // Whole passes over the file, then a seeded draw of the rest (the same on every rank).
    const auto order = epoch_order(n, seed ^ (0x3779B97Full * (i + 1)), 0, true);
    for (std::size_t k = 0; k < count; ++k) {
      const std::size_t pick = k / n < count / n ? k % n : order[k % n];
      mixed.samples.push_back(f.samples[pick]);
      mixed.lines.push_back(f.lines[pick]);
    }
    mixed.records += f.records;
    mixed.skipped_lines += f.skipped_lines;
    if (i > 0) mixed.file += ", " + f.file;
  }
  return mixed;
}

std::vector<std::size_t> epoch_order(std::size_t n, std::uint64_t seed, std::uint64_t epoch, bool shuffle) {
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  if (!shuffle) return order;
  std::uint64_t state = seed * 0x9E3779B97F4A7C15ull + epoch + 1;
  const auto next = [&] {  // SplitMix64: the same sequence on every platform and compiler
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  for (std::size_t i = n; i > 1; --i) std::swap(order[i - 1], order[next() % i]);
  return order;
}

}  // namespace loom::core
