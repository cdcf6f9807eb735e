#pragma once
#include <cstdint>
#include <filesystem>
#include <iosfwd>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/formats/regular_file.hpp"
#include "loom/formats/table_rows.hpp"

namespace loom::core {

// Records of each data file that validation reads, renders and collates (the rest is read when
// training starts).
inline constexpr std::size_t kRecordsChecked = 64;
// The longest record (a JSON line, a CSV record) or value (a Parquet or Arrow string) read: a
// hostile file cannot make one giant allocation. A file's extension in lower case (".csv") picks
// how it is read.
using formats::kMaxRecordBytes;
using formats::lowercase_extension;

struct Dataset {
  std::vector<std::string> samples;  // formatted text, one per usable record
  std::vector<std::size_t> lines;    // each sample's line in the file (1-based), or its index in a JSON array
  std::size_t records = 0;           // usable records read (also when their samples were not kept)
  std::size_t skipped_lines = 0;     // bad records passed over under on_bad_line = "skip"
  std::string file;
  bool records_by_index = false;     // a JSON array: `lines` are the records' indices
  // Sample i's place for messages: "file:line" or "file: record N".
  std::string where(std::size_t i) const;
};

// Reads a data file's records and renders each through `format` ("{field}" is the field's value,
// "{{" and "}}" are literal braces), or, for a chat format ("messages", "sharegpt", "alpaca";
// chat/chat_data.hpp), keeps each as a conversation's JSON, rendered with the chat template later.
// The file is JSON lines (a JSON object a line), one JSON array of objects (the first character
// past whitespace is '['; up to 512 MiB), or, by its extension .csv or .tsv, RFC 4180 records under a
// header row naming the fields (every value a string). A bad record (not JSON, not an object, a
// missing field, the wrong number of fields, longer than 64 MiB) is a UserError "file:line: ..."
// ("file: record N: ..." in an array) unless `skip_bad_lines`; a file with no usable record is an
// error either way. `file` must be a regular file. At most `max_records` records are read
// (validation reads the first few); without `keep_samples` every record is checked and counted
// (records) but none is kept (loom validate streams whole files so).
// With `with_records` each sample holds the rendered text (a chat format: the conversation as an
// objective's prompt, ConversationUse::kPrompt) and the record it came from
// (sample_with_record), for an objective that reads more fields than the format renders.
Dataset load_data(const std::filesystem::path& file, const std::string& format, bool skip_bad_lines,
                  std::size_t max_records = static_cast<std::size_t>(-1), bool keep_samples = true, bool with_records = false);

// A sample that carries its record beside its rendered text (the prompt of a preference or
// sampling objective), as one JSON text, and back.
std::string sample_with_record(const std::string& rendered, const nlohmann::ordered_json& record);
struct SampleWithRecord {
  std::string prompt;
  nlohmann::ordered_json record;
};
SampleWithRecord split_sample(const std::string& sample);

// [data] eval_split: the records held out of `records` (a whole number of them from 1, or a
// fraction below 1, rounded up as datasets' train_test_split rounds it).
std::size_t held_out_count(double split, std::size_t records);
// Moves held_out_count(split) of `train`'s samples, drawn with `seed`, into the returned evaluation
// set; both keep the file's order and each sample's line. A split that leaves either side empty is
// a UserError.
Dataset split_off(Dataset& train, double split, std::uint64_t seed);

// The next line of `in` without its newline; false at the end. A line over 64 MiB is not kept
// (`too_long` is set, the line is skipped), so a hostile file cannot make one giant allocation.
// A stream that fails to read (a folder) is a UserError, never an endless loop.
bool read_line(std::istream& in, std::string& line, bool& too_long);

// Checks a format string once, before any data is read: balanced braces, non-empty field names.
void check_format(const std::string& format);

// Deterministic order of epoch `epoch` over n samples (Fisher-Yates from a seeded SplitMix64).
// Several training files as one, in file order: each file's samples repeated or drawn (with
// `seed`, once) to its share weight / sum of weights of the files' total (shares rounded down, the
// remainder to the largest fractions); no weights keep every sample of each once. `weights` is
// empty or one per file, each from 1.
Dataset mix_datasets(std::vector<Dataset> files, const std::vector<std::int64_t>& weights, std::uint64_t seed);

std::vector<std::size_t> epoch_order(std::size_t n, std::uint64_t seed, std::uint64_t epoch, bool shuffle);

}  // namespace loom::core
