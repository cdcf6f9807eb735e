#include <gtest/gtest.h>

#include <map>

#include "config/data.hpp"
#include "loom/collator.hpp"
#include "loom/error.hpp"
#include "loom/tokenizer.hpp"
#include "plugins/plugin_registry.hpp"
#include "test_support.hpp"

namespace loom::core {
namespace {
namespace fs = std::filesystem;

template <typename T>
std::unique_ptr<T> make(const std::string& kind, const std::string& name, std::map<std::string, OptionValue> given) {
  return test::make_plugin<T>(kind, name, given);
}

std::unique_ptr<Tokenizer> bytes(bool left) {
  return make<Tokenizer>("tokenizer", "bytes", {{"padding_side", std::string(left ? "left" : "right")}, {"pad_token", std::string("eos")}});
}

std::string labelled_text(const Batch& b, std::int64_t row) {
  std::string out;
  for (std::int64_t i = 0; i < b.cols; ++i) {
    const auto l = b.labels[static_cast<std::size_t>(row * b.cols + i)];
    if (l >= 0 && l < 256) out += static_cast<char>(l);
    if (l == 257) out += "</s>";
  }
  return out;
}

TEST(CompletionOnly, LabelsOnlyTheResponseAndPadsOnTheTokenizersSide) {
  auto c = make<Collator>("collator", "completion-only", {{"response_template", std::string("### OUTPUT:")}});
  for (bool left : {true, false}) {
    const Batch b = c->collate({"### PROMPT: 1+2\n### OUTPUT: 3", "### PROMPT: 10+20\n### OUTPUT: 30"}, *bytes(left), {64, Truncation::kRight});
    ASSERT_EQ(b.rows, 2);
    EXPECT_EQ(labelled_text(b, 0), " 3</s>");
    EXPECT_EQ(labelled_text(b, 1), " 30</s>");
    const std::int64_t pads = b.cols - static_cast<std::int64_t>(std::string("### PROMPT: 1+2\n### OUTPUT: 3").size()) - 2;
    ASSERT_EQ(pads, 3);
    // Padding: eos id, mask 0, label -100, on the configured side.
    const std::size_t first_pad = left ? 0 : static_cast<std::size_t>(b.cols - pads);
    EXPECT_EQ(b.input_ids[first_pad], 257);
    EXPECT_EQ(b.attention_mask[first_pad], 0);
    EXPECT_EQ(b.labels[first_pad], kIgnoreLabel);
    EXPECT_EQ(b.attention_mask[left ? static_cast<std::size_t>(pads) : 0], 1);
  }
}

TEST(CompletionOnly, MultiTurnTrainsEveryResponseAndIdTemplatesWork) {
  auto c = make<Collator>("collator", "completion-only",
                          {{"response_template", std::string("B:")}, {"instruction_template", std::string("A:")}});
  const Batch b = c->collate({"A: hi B: yo A: bye B: ciao"}, *bytes(false), {64, Truncation::kRight});
  EXPECT_EQ(labelled_text(b, 0), " yo  ciao</s>");
  // Template as in-context ids ("B:" is 66, 58 in bytes).
  auto ids = make<Collator>("collator", "completion-only", {{"response_template", IntList{66, 58}}});
  EXPECT_EQ(labelled_text(ids->collate({"A: hi B: yo"}, *bytes(false), {64, Truncation::kRight}), 0), " yo</s>");
}

TEST(CompletionOnly, MissingTemplateAndTruncationPolicies) {
  auto skip = make<Collator>("collator", "completion-only", {{"response_template", std::string("### OUTPUT:")}});
  Batch b = skip->collate({"no template here", "### OUTPUT: x"}, *bytes(true), {64, Truncation::kRight});
  EXPECT_EQ(b.rows, 1);
  EXPECT_EQ(b.skipped, 1);
  auto error = make<Collator>("collator", "completion-only",
                              {{"response_template", std::string("### OUTPUT:")}, {"on_missing_template", std::string("error")}});
  EXPECT_THROW(error->collate({"no template here"}, *bytes(true), {64, Truncation::kRight}), UserError);
  const std::string long_sample = std::string(40, 'p') + "### OUTPUT: answer";
  EXPECT_EQ(skip->collate({long_sample}, *bytes(true), {20, Truncation::kDrop}).skipped, 1);
  const Batch left = skip->collate({long_sample}, *bytes(true), {20, Truncation::kLeft});
  EXPECT_EQ(left.cols, 20);
  EXPECT_EQ(labelled_text(left, 0), " answer</s>");
  // Cutting the right end removes the whole answer: nothing to learn, so the sample is skipped.
  EXPECT_EQ(skip->collate({long_sample}, *bytes(true), {20, Truncation::kRight}).skipped, 1);
}

TEST(CompletionOnly, SplitsForGeneration) {
  auto c = make<Collator>("collator", "completion-only", {{"response_template", std::string("### OUTPUT:")}});
  const auto split = c->split_for_generation("### PROMPT: 1+2\n### OUTPUT: 3");
  ASSERT_TRUE(split);
  EXPECT_EQ(split->prompt, "### PROMPT: 1+2\n### OUTPUT:");
  EXPECT_EQ(split->reference, " 3");
}

// all-tokens (issue 55): every token of a sample is its own label (BOS and EOS included), padding
// none; a response template only says where evaluation's generation starts.
TEST(AllTokens, LabelsEveryTokenAndNoPadding) {
  auto c = make<Collator>("collator", "all-tokens", {});
  for (bool left : {true, false}) {
    const Batch b = c->collate({"plain text", "### PROMPT: 1+2\n### OUTPUT: 3"}, *bytes(left), {64, Truncation::kRight});
    ASSERT_EQ(b.rows, 2);
    EXPECT_EQ(labelled_text(b, 0), "plain text</s>");
    EXPECT_EQ(labelled_text(b, 1), "### PROMPT: 1+2\n### OUTPUT: 3</s>");
    for (std::size_t i = 0; i < b.input_ids.size(); ++i)
      EXPECT_EQ(b.labels[i], b.attention_mask[i] == 1 ? b.input_ids[i] : kIgnoreLabel) << i;
  }
  EXPECT_FALSE(c->split_for_generation("### PROMPT: 1+2\n### OUTPUT: 3").has_value());
  auto with = make<Collator>("collator", "all-tokens", {{"response_template", std::string("### OUTPUT:")}});
  const auto split = with->split_for_generation("### PROMPT: 1+2\n### OUTPUT: 3");
  ASSERT_TRUE(split.has_value());
  EXPECT_EQ(split->prompt, "### PROMPT: 1+2\n### OUTPUT:");
  EXPECT_EQ(split->reference, " 3");
  EXPECT_EQ(labelled_text(with->collate({"### PROMPT: 1+2\n### OUTPUT: 3"}, *bytes(false), {64, Truncation::kRight}), 0), "### PROMPT: 1+2\n### OUTPUT: 3</s>");
  EXPECT_THROW(make<Collator>("collator", "all-tokens", {{"response_template", std::string()}}), UserError);
}

// Several train files: without weights every sample of each once, in file order; with weights each
// file's share of the total, by whole passes and then a seeded draw without repeats (the same for a
// seed).
TEST(Data, SeveralTrainFilesMixByTheirWeights) {
  const auto make = [](const std::string& name, std::size_t n) {
    core::Dataset d;
    d.file = name;
    for (std::size_t i = 0; i < n; ++i) {
      d.samples.push_back(name + std::to_string(i));
      d.lines.push_back(i + 1);
    }
    d.records = n;
    return d;
  };
  const auto plain = core::mix_datasets({make("a", 10), make("b", 2)}, {}, 7);
  ASSERT_EQ(plain.samples.size(), 12u);
  EXPECT_EQ(plain.samples[10], "b0");
  EXPECT_EQ(plain.file, "a, b");
  const auto even = core::mix_datasets({make("a", 10), make("b", 2)}, {1, 1}, 7);
  ASSERT_EQ(even.samples.size(), 12u);
  std::map<std::string, int> seen;
  for (const auto& sample : even.samples) ++seen[sample];
  std::size_t from_a = 0;
  for (const auto& [sample, count] : seen) {
    if (sample[0] == 'a') {
      from_a += static_cast<std::size_t>(count);
      EXPECT_EQ(count, 1) << sample;  // 6 of 10, none twice
    } else {
      EXPECT_EQ(count, 3) << sample;  // 2 samples, 3 passes
    }
  }
  EXPECT_EQ(from_a, 6u);
  EXPECT_EQ(core::mix_datasets({make("a", 10), make("b", 2)}, {1, 1}, 7).samples, even.samples);
  EXPECT_NE(core::mix_datasets({make("a", 10), make("b", 2)}, {1, 1}, 8).samples, even.samples);
  const auto weighted = core::mix_datasets({make("a", 10), make("b", 2)}, {3, 1}, 7);
  EXPECT_EQ(weighted.samples.size(), 12u);
  EXPECT_EQ(std::count_if(weighted.samples.begin(), weighted.samples.end(), [](const std::string& x) { return x[0] == 'b'; }), 3);
}

// [data] eval_split: a seeded draw of a count (or a fraction, rounded up) of the records, both
// parts in the file's order with their lines, the same for a seed and another for another; a split
// that leaves either side empty is one error.
TEST(Data, EvalSplitHoldsOutASeededDrawKeepingTheFilesOrder) {
  const auto make = [] {
    core::Dataset d;
    d.file = "t.jsonl";
    for (std::size_t i = 0; i < 50; ++i) {
      d.samples.push_back("s" + std::to_string(i));
      d.lines.push_back(i + 1);
    }
    return d;
  };
  core::Dataset a = make(), b = make(), c = make();
  const core::Dataset held = core::split_off(a, 0.1, 7), same = core::split_off(b, 5, 7), other = core::split_off(c, 0.1, 8);
  EXPECT_EQ(held.samples.size(), 5u);
  EXPECT_EQ(a.samples.size(), 45u);
  EXPECT_EQ(held.samples, same.samples);
  EXPECT_NE(held.samples, other.samples);
  std::vector<std::size_t> all(held.lines);
  all.insert(all.end(), a.lines.begin(), a.lines.end());
  EXPECT_TRUE(std::is_sorted(held.lines.begin(), held.lines.end()) && std::is_sorted(a.lines.begin(), a.lines.end()));
  std::sort(all.begin(), all.end());
  for (std::size_t i = 0; i < all.size(); ++i) EXPECT_EQ(all[i], i + 1);
  for (std::size_t i = 0; i < held.samples.size(); ++i) EXPECT_EQ(held.samples[i], "s" + std::to_string(held.lines[i] - 1));
  EXPECT_EQ(core::held_out_count(0.01, 50), 1u);  // rounded up
  for (const double split : {50.0, 0.9999}) {
    core::Dataset d = make();
    try {
      core::split_off(d, split, 7);
      ADD_FAILURE() << split;
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("leaving nothing to train on; hold out between 1 and 49"), std::string::npos) << e.what();
    }
  }
}

// The same five records as JSON lines, one JSON array, CSV and TSV, the files written by Python's
// json and csv modules (tests/fixtures/data/make_records.py: quoted commas, tabs, quotes and
// newlines, CRLF rows, UTF-8), give the same samples (issue 55); bad records name their place.
TEST(Data, JsonArraysCsvAndTsvGiveTheSameSamplesAsJsonLines) {
  const fs::path fixtures = test::source_dir() / "tests/fixtures/data";
  const std::string format = "{instruction} -> {output}";
  const auto expected = load_data(fixtures / "records.jsonl", format, false).samples;
  ASSERT_EQ(expected.size(), 5u);
  EXPECT_EQ(expected[3], "with\na newline -> four");
  for (const char* name : {"records.json", "records.csv", "records.tsv"}) {
    SCOPED_TRACE(name);
    const Dataset d = load_data(fixtures / name, format, false);
    EXPECT_EQ(d.samples, expected);
    EXPECT_EQ(load_data(fixtures / name, format, false, 2).samples.size(), 2u) << "validation reads the first records only";
  }
  // Where each sample came from: a CSV record's first line (the header is line 1, the record with a
  // newline spans lines 5 and 6), a JSON array's index.
  EXPECT_EQ(load_data(fixtures / "records.csv", format, false).lines, (std::vector<std::size_t>{2, 3, 4, 5, 7}));
  const Dataset array = load_data(fixtures / "records.json", format, false);
  EXPECT_EQ(array.where(4), (fixtures / "records.json").string() + ": record 5");
  const auto dir = test::temp_dir();
  const auto error_of = [&](const std::string& name, const std::string& content) {
    test::write_file(dir / name, content);
    try {
      load_data(dir / name, "{q}", false);
    } catch (const UserError& e) {
      return std::string(e.what()).substr((dir / name).string().size());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error_of("short.csv", "q,a\nx,1\ny\n"), ":3: 1 fields where the header names 2");
  EXPECT_EQ(error_of("open.csv", "q\n\"never closed\n"), ":2: a quoted field is never closed");
  EXPECT_EQ(error_of("nothing.csv", ""), ": holds no records (a header row and then a record a row is expected)");
  EXPECT_EQ(error_of("numbers.json", "[{\"q\": \"a\"}, 7]"), ": record 2: expected a JSON object, found the integer 7");
  EXPECT_EQ(error_of("field.json", " [{\"z\": \"a\"}]"), ": record 1: record has no field 'q' used by [data] format (its fields: \"z\")");
  EXPECT_EQ(error_of("empty.json", "[]"), ": holds no records (JSON lines, a JSON array of objects, or CSV/TSV with a header row)");
  // Bad records are skipped and counted under on_bad_line = "skip", in every form.
  test::write_file(dir / "mixed.csv", "q,a\nx,1\ny\nz,3\n");
  const Dataset skipped = load_data(dir / "mixed.csv", "{q}", true);
  EXPECT_EQ(skipped.samples, (std::vector<std::string>{"x", "z"}));
  EXPECT_EQ(skipped.skipped_lines, 1u);
}

// Parquet and Arrow files written by other implementations (tests/fixtures/data/columnar/
// make_columnar.mjs: arrow-rs through parquet-wasm, hyparquet-writer, apache-arrow; make_pyarrow.py:
// Arrow C++ through pyarrow 25, large_string columns included; data pages v1
// and v2, PLAIN, dictionary, RLE, DELTA_* and BYTE_STREAM_SPLIT values, uncompressed, snappy, gzip
// and zstd pages, several row groups and pages; a datasets save_to_disk folder of Arrow streams)
// give the rows of the same data as JSON lines (issue 55).
TEST(Data, ParquetAndArrowFromOtherWritersGiveTheRowsOfJsonLines) {
  const fs::path dir = test::source_dir() / "tests/fixtures/data/columnar";
  // Floats render as floats ("0.0") where JSON's 0 is an integer: scores are compared as numbers.
  const std::string format = "{question}|{answer}|{id}|{n32}|{flag}";
  const auto expected = load_data(dir / "rows.jsonl", format, false).samples;
  const auto expected_scores = load_data(dir / "rows.jsonl", "{score}", false).samples;
  ASSERT_EQ(expected.size(), 240u);
  EXPECT_EQ(expected[17], "|null|1000000000017|46801|null") << "record 18: an empty question, nulls";
  for (const char* name : {"arrow-rs-v1-plain.parquet", "arrow-rs-v1-dict-snappy.parquet", "arrow-rs-v2-gzip.parquet", "arrow-rs-v2-zstd-delta.parquet",
                           "arrow-rs-v1-delta-length.parquet", "hyparquet-snappy.parquet", "hyparquet-delta.parquet", "hyparquet-gzip.parquet",
                           "hyparquet-nested.parquet", "table.arrow", "datasets-folder", "pyarrow-v1-snappy.parquet", "pyarrow-v2-zstd-delta.parquet",
                           "pyarrow-large-string-gzip.parquet", "pyarrow-large-string.arrow"}) {
    SCOPED_TRACE(name);
    const Dataset d = load_data(dir / name, format, false);
    EXPECT_EQ(d.samples, expected);
    const auto scores = load_data(dir / name, "{score}", false).samples;
    ASSERT_EQ(scores.size(), expected_scores.size());
    for (std::size_t i = 0; i < scores.size(); ++i) ASSERT_EQ(std::stod(scores[i]), std::stod(expected_scores[i])) << "row " << i + 1;
    EXPECT_EQ(d.where(239), (dir / name).string() + ": record 240");
    EXPECT_EQ(load_data(dir / name, format, false, 3).samples.size(), 3u) << "validation reads the first records only";
  }
  // A column loom cannot read is named where a record needs it.
  try {
    load_data(dir / "hyparquet-nested.parquet", "{question} {tags}", false);
    ADD_FAILURE() << "a nested column was read";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(": record 1: record has no field 'tags' used by [data] format"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("columns loom does not read: tags (nested: a list, struct or map)"), std::string::npos) << e.what();
  }
  // Writers' options loom does not read are named: brotli pages, LZ4 bodies, a chat column.
  const auto error_of = [&](const char* name, const std::string& format) {
    try {
      load_data(dir / name, format, false);
    } catch (const UserError& e) {
      return std::string(e.what()).substr((dir / name).string().size());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error_of("pyarrow-brotli.parquet", "{question}"),
            ": row group 0, column 'question': its pages are compressed with BROTLI, which loom does not read (uncompressed, SNAPPY, GZIP and ZSTD are "
            "read); write the file again with one of those");
  EXPECT_EQ(error_of("pyarrow-lz4.arrow", "{question}"), ": its record batches are compressed (LZ4 or ZSTD), which loom does not read; write it uncompressed");
  EXPECT_EQ(error_of("pyarrow-messages.parquet", "messages"),
            ": record 1: record has no field 'messages' ([data] format = \"messages\"; its fields: \"question\", \"answer\", \"id\", \"n32\", \"score\", "
            "\"flag\"); columns loom does not read: messages (nested: a list, struct or map) (loom reads flat columns of strings, numbers and booleans; "
            "write nested data as JSON lines, e.g. with datasets' to_json)");
  EXPECT_EQ(load_data(dir / "pyarrow-messages.parquet", format, false).samples, std::vector<std::string>(expected.begin(), expected.begin() + 20));
}

// A damaged or misnamed Parquet/Arrow file or folder is one clear error, never a crash or a giant
// allocation; fuzz/fuzz_columnar.cpp tries many more.
TEST(Data, DamagedColumnarFilesAndFoldersAreOneClearError) {
  const fs::path fixtures = test::source_dir() / "tests/fixtures/data/columnar";
  const auto dir = test::temp_dir();
  const auto error_of = [&](const fs::path& file) {
    try {
      load_data(file, "{question}", false);
    } catch (const UserError& e) {
      const std::string what = e.what();
      return what.rfind(file.string(), 0) == 0 ? what.substr(file.string().size()) : what;
    }
    return std::string("no error");
  };
  const std::string parquet = test::read_file(fixtures / "hyparquet-snappy.parquet");
  test::write_file(dir / "cut.parquet", parquet.substr(0, parquet.size() - 100));
  EXPECT_EQ(error_of(dir / "cut.parquet"), ": is not a Parquet file (no PAR1 at its start and end)");
  std::string big_footer = parquet;
  big_footer[big_footer.size() - 5] = '\x7f';
  test::write_file(dir / "big.parquet", big_footer);
  EXPECT_NE(error_of(dir / "big.parquet").find("its footer claims"), std::string::npos) << error_of(dir / "big.parquet");
  // A snappy page whose bytes are damaged: the page says where.
  std::string damaged = parquet;
  for (std::size_t i = 40; i < 400; ++i) damaged[i] = static_cast<char>(0xff);
  test::write_file(dir / "damaged.parquet", damaged);
  const std::string page_error = error_of(dir / "damaged.parquet");
  EXPECT_NE(page_error.find(": row group 0, column 'question': "), std::string::npos) << page_error;
  // Bytes that are not UTF-8 in a string column (the first answer, in a file of plain pages).
  std::string binary = test::read_file(fixtures / "arrow-rs-v1-plain.parquet");
  binary[binary.find("Berlin")] = '\xff';
  test::write_file(dir / "binary.parquet", binary);
  EXPECT_EQ(error_of(dir / "binary.parquet"), ": record 1: column 'answer' holds bytes that are not UTF-8 text (binary data?)");
  test::write_file(dir / "json.parquet", "{\"question\": \"a\"}\n");
  EXPECT_EQ(error_of(dir / "json.parquet"), ": is not a Parquet file (no PAR1 at its start and end)");
  test::write_file(dir / "short.parquet", "PAR1PAR1");
  EXPECT_EQ(error_of(dir / "short.parquet"), ": is not a Parquet file (too short for its header and footer)");
  const std::string arrow = test::read_file(fixtures / "datasets-folder/data-00000-of-00002.arrow");
  test::write_file(dir / "cut.arrow", arrow.substr(0, arrow.size() / 2));
  EXPECT_NE(error_of(dir / "cut.arrow").find("runs past the end of the file"), std::string::npos) << error_of(dir / "cut.arrow");
  test::write_file(dir / "text.arrow", "question\nwhat\n");
  EXPECT_NE(error_of(dir / "text.arrow").find(": "), std::string::npos);
  // Folders: datasets' DatasetDict names its splits; any other folder says what was looked for.
  fs::create_directories(dir / "dict/train");
  test::write_file(dir / "dict/dataset_dict.json", "{\"splits\": [\"train\", \"test\"]}");
  EXPECT_EQ(error_of(dir / "dict"), ": is a DatasetDict folder (splits: train, test); name one split's folder, e.g. " + (dir / "dict/train").string());
  EXPECT_EQ(error_of(dir / "dict/train"), ": is a folder, not a data file nor a folder written by datasets' save_to_disk (it has no state.json)");
  fs::create_directories(dir / "escape");
  test::write_file(dir / "escape/state.json", "{\"_data_files\": [{\"filename\": \"../cut.arrow\"}]}");
  EXPECT_EQ(error_of(dir / "escape"), "/state.json: data file '../cut.arrow' is not a plain file name in the folder");
}

TEST(Data, FormatsRecordsAndReportsBadLinesWithLineNumbers) {
  const auto dir = test::temp_dir();
  test::write_file(dir / "d.jsonl", "{\"q\": \"a\", \"n\": 3}\n\n{\"q\": \"b\", \"n\": 4}\n");
  const auto ok = load_data(dir / "d.jsonl", "Q {q} N {n} {{x}}", false);
  EXPECT_EQ(ok.samples, (std::vector<std::string>{"Q a N 3 {x}", "Q b N 4 {x}"}));
  test::write_file(dir / "bad.jsonl", "{\"q\": \"a\"}\nnot json\n{\"z\": 1}\n[1]\n");
  try {
    load_data(dir / "bad.jsonl", "{q}", false);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()).rfind((dir / "bad.jsonl").string() + ":2:2: not valid JSON", 0), 0u) << e.what();
  }
  const auto skipped = load_data(dir / "bad.jsonl", "{q}", true);
  EXPECT_EQ(skipped.samples.size(), 1u);
  EXPECT_EQ(skipped.skipped_lines, 3u);
  test::write_file(dir / "field.jsonl", "{\"z\": 1}\n");
  try {
    load_data(dir / "field.jsonl", "{q}", false);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(":1: record has no field 'q' used by [data] format (its fields: \"z\")"), std::string::npos) << e.what();
  }
  // Lines longer than 64 MiB, just over or far over the bound, are refused; the next line is read.
  for (const std::size_t extra : {std::size_t{1}, std::size_t{100000}}) {
    test::write_file(dir / "long.jsonl", "{\"q\": \"" + std::string((64u << 20) + extra, 'a') + "\"}\n{\"q\": \"b\"}\n");
    try {
      load_data(dir / "long.jsonl", "{q}", false);
      FAIL();
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("long.jsonl:1: line is longer than 64 MiB"), std::string::npos) << e.what();
    }
    EXPECT_EQ(load_data(dir / "long.jsonl", "{q}", true).samples, std::vector<std::string>{"b"});
  }
  EXPECT_THROW(check_format("{q"), UserError);
  EXPECT_THROW(check_format("q}"), UserError);
  EXPECT_THROW(check_format("{}"), UserError);
}

TEST(Data, EpochOrderIsASeededPermutation) {
  const auto a = epoch_order(100, 42, 0, true), b = epoch_order(100, 42, 0, true), c = epoch_order(100, 42, 1, true);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  auto sorted = a;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, epoch_order(100, 42, 0, false));
}

}  // namespace
}  // namespace loom::core
