// The formats library on its own (no LibTorch): the columnar readers give the rows other writers
// wrote, refuse what hostile files claim, and the page codecs inflate exactly what a page says.
// loom_tests covers the same readers through [data] format (Data.*, HostileInput.*).
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <functional>

#include <nlohmann/json.hpp>
#include <snappy.h>

#include "loom/error.hpp"
#include "loom/formats/decompress.hpp"
#include "loom/formats/gguf.hpp"
#include "loom/formats/jinja.hpp"
#include "loom/formats/regular_file.hpp"
#include "loom/formats/table_rows.hpp"
#include "parquet_footer.hpp"

namespace loom::formats {
namespace {
namespace fs = std::filesystem;

const fs::path kFixtures = fs::path(LOOM_SOURCE_DIR) / "tests/fixtures/data/columnar";

fs::path temp_dir() {
  static int n = 0;
  const fs::path dir = fs::temp_directory_path() / ("loom-formats-test-" + std::to_string(::getpid())) / std::to_string(n++);
  fs::create_directories(dir);
  return dir;
}

void write_file(const fs::path& file, const std::string& bytes) { std::ofstream(file, std::ios::binary) << bytes; }

std::vector<nlohmann::ordered_json> rows_of(TableRows& table) {
  std::vector<nlohmann::ordered_json> rows;
  nlohmann::ordered_json row;
  while (table.next(row)) rows.push_back(row);
  return rows;
}

std::string refusal(const std::function<void()>& read) {
  try {
    read();
  } catch (const UserError& e) {
    return e.what();
  }
  return "no error";
}

// Every fixture written by another implementation (arrow-rs, hyparquet, apache-arrow JS, pyarrow:
// tests/fixtures/data/columnar) reads as rows.jsonl's 240 rows, value for value (a float column's
// values as numbers).
TEST(Columnar, OtherWritersFilesGiveTheRowsOfJsonLines) {
  std::vector<nlohmann::ordered_json> expected;
  std::ifstream lines(kFixtures / "rows.jsonl");
  for (std::string line; std::getline(lines, line);) expected.push_back(nlohmann::ordered_json::parse(line));
  ASSERT_EQ(expected.size(), 240u);
  for (const char* name : {"arrow-rs-v1-plain.parquet", "arrow-rs-v1-dict-snappy.parquet", "arrow-rs-v2-gzip.parquet", "arrow-rs-v2-zstd-delta.parquet",
                           "arrow-rs-v1-delta-length.parquet", "hyparquet-snappy.parquet", "hyparquet-delta.parquet", "hyparquet-gzip.parquet",
                           "table.arrow", "datasets-folder", "pyarrow-v1-snappy.parquet", "pyarrow-v2-zstd-delta.parquet",
                           "pyarrow-large-string-gzip.parquet", "pyarrow-large-string.arrow"}) {
    SCOPED_TRACE(name);
    const fs::path file = kFixtures / name;
    const auto table = fs::is_directory(file) ? open_datasets_folder(file) : is_parquet_file(file) ? open_parquet(file) : open_arrow(file);
    const auto rows = rows_of(*table);
    ASSERT_EQ(rows.size(), expected.size());
    for (std::size_t i = 0; i < rows.size(); ++i)
      for (const char* column : {"question", "answer", "id", "n32", "flag", "score"}) {
        const auto& got = rows[i].at(column);
        const auto& want = expected[i].at(column);
        if (got.is_number() && want.is_number()) ASSERT_EQ(got.get<double>(), want.get<double>()) << "row " << i + 1 << " " << column;
        else ASSERT_EQ(got, want) << "row " << i + 1 << " " << column;
      }
  }
}

// Issue 67's shapes at the readers: chunks that overlap or run past the file are refused before
// any is read, a column named twice is one error, a datasets folder lists each file once.
TEST(Columnar, HostileLayoutsAreRefusedBeforeAnythingIsRead) {
  const fs::path dir = temp_dir();
  std::vector<std::string> names = {"text"};
  for (int i = 1; i < 64; ++i) names.push_back("c" + std::to_string(i));
  write_file(dir / "overlap.parquet", test::parquet_with_shared_chunk(names, 256));
  EXPECT_EQ(refusal([&] { open_parquet(dir / "overlap.parquet"); }),
            (dir / "overlap.parquet").string() + ": row group 0: two column chunks overlap (at bytes 4 and 4); the file is damaged");
  write_file(dir / "past.parquet", test::parquet_with_shared_chunk({"text"}, 8, 1 << 20));
  EXPECT_NE(refusal([&] { open_parquet(dir / "past.parquet"); }).find("its chunk (1048576 bytes at 4) lies past the end of the file"), std::string::npos);
  write_file(dir / "twice.parquet", test::parquet_with_shared_chunk({"text", "text"}, 8));
  EXPECT_EQ(refusal([&] { open_parquet(dir / "twice.parquet"); }),
            (dir / "twice.parquet").string() + ": column \"text\" appears twice (columns 1 and 2); a record keeps one value a name, so rename one of them");
  fs::create_directories(dir / "ds");
  fs::copy_file(kFixtures / "datasets-folder/data-00000-of-00002.arrow", dir / "ds/a.arrow");
  write_file(dir / "ds/state.json", R"({"_data_files": [{"filename": "a.arrow"}, {"filename": "a.arrow"}]})");
  EXPECT_NE(refusal([&] { open_datasets_folder(dir / "ds"); }).find("lists the data file \"a.arrow\" twice"), std::string::npos);
  EXPECT_EQ(refusal([&] { check_unique_columns({"a", "b", "a"}, "x.csv:1"); }),
            "x.csv:1: column \"a\" appears twice (columns 1 and 3); a record keeps one value a name, so rename one of them");
}

// Arrow's metadata goes through flatbuffers' verifier before anything reads it: a footer or a
// message whose root offset points outside its buffer is one error, in the file and stream forms.
TEST(Columnar, ArrowMetadataIsVerifiedBeforeItIsRead) {
  const fs::path dir = temp_dir();
  const auto read_all = [](const fs::path& file) {
    std::ifstream in(file, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  std::string file_form = read_all(kFixtures / "table.arrow");
  std::int32_t footer = 0;
  std::memcpy(&footer, file_form.data() + file_form.size() - 10, 4);
  const std::size_t root = file_form.size() - 10 - static_cast<std::size_t>(footer);
  const std::uint32_t outside = 0x7ffffff0u;
  std::memcpy(file_form.data() + root, &outside, 4);
  write_file(dir / "footer.arrow", file_form);
  EXPECT_EQ(refusal([&] { open_arrow(dir / "footer.arrow"); }),
            (dir / "footer.arrow").string() + ": its metadata is damaged (an offset or a size points outside it)");
  std::string stream = read_all(kFixtures / "datasets-folder/data-00000-of-00002.arrow");
  ASSERT_EQ(stream.substr(0, 4), "\xff\xff\xff\xff");  // the continuation marker, then the size
  std::memcpy(stream.data() + 8, &outside, 4);
  write_file(dir / "stream.arrow", stream);
  EXPECT_EQ(refusal([&] { open_arrow(dir / "stream.arrow"); }),
            (dir / "stream.arrow").string() + ": its metadata is damaged (an offset or a size points outside it)");
}

// Snappy pages through libsnappy: what it compressed comes back; a page whose declared size is not
// the page header's, or whose elements do not decode, is one error, nothing allocated first.
TEST(Codecs, SnappyInflatesExactlyWhatThePageDeclares) {
  std::string text;
  for (int i = 0; i < 2000; ++i) text += "row " + std::to_string(i % 37) + ", ";
  std::string packed;
  snappy::Compress(text.data(), text.size(), &packed);
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(packed.data());
  EXPECT_EQ(decompress(Codec::kSnappy, bytes, packed.size(), text.size(), "page: "), text);
  EXPECT_EQ(refusal([&] { decompress(Codec::kSnappy, bytes, packed.size(), text.size() + 1, "page: "); }),
            "page: snappy data is corrupt (it inflates to " + std::to_string(text.size()) + " bytes where the page says " + std::to_string(text.size() + 1) + ")");
  std::string damaged = packed;
  damaged.resize(damaged.size() / 2);
  EXPECT_EQ(refusal([&] { decompress(Codec::kSnappy, reinterpret_cast<const std::uint8_t*>(damaged.data()), damaged.size(), text.size(), "page: "); }),
            "page: snappy data is corrupt (its elements do not decode)");
  // A preamble claiming 4 GB in five bytes.
  const std::string claim = "\xff\xff\xff\xff\x0f";
  EXPECT_NE(refusal([&] { decompress(Codec::kSnappy, reinterpret_cast<const std::uint8_t*>(claim.data()), claim.size(), 100, "page: "); })
                .find("snappy data is corrupt"),
            std::string::npos);
}

// The Jinja of chat templates renders tests/chat/jinja_cases.py's cases as Python's jinja2 renders
// them in transformers' environment (tests/fixtures/chat/jinja_cases.jsonl), and fails where it
// raised. loom_tests' ChatTemplates.* hold it to every family's real templates.
TEST(Jinja, RendersAsPythonsJinja2) {
  std::ifstream in(fs::path(LOOM_SOURCE_DIR) / "tests/fixtures/chat/jinja_cases.jsonl");
  std::size_t cases = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const auto c = nlohmann::ordered_json::parse(line);
    const std::string source = c["template"];
    ++cases;
    if (c.contains("text"))
      EXPECT_EQ(jinja::Template(source, "test").render(c["context"]).text, c["text"].get<std::string>()) << source;
    else
      EXPECT_NE(refusal([&] { jinja::Template(source, "test").render(c["context"]); }), "no error") << source;
  }
  EXPECT_GE(cases, 25u);
}

// GGUF's layout: the header padded to 32 bytes, each tensor at an aligned offset of the data, ggml's
// dimension order; llama.cpp's names for transformers' tensors. (Export.GgufIsWhatLlamaCppAndHfGgufRead
// reads a whole exported file by the specification and by Hugging Face's JS parser.)
TEST(Gguf, LayoutIsAlignedAndNamesAreLlamaCpps) {
  gguf::Metadata m;
  m.kv("general.architecture", "llama");
  m.kv_u32("llama.block_count", 2);
  const gguf::Layout layout = gguf::lay_out(m, {{"token_embd.weight", {10, 3}, gguf::kF16}, {"output_norm.weight", {3}, gguf::kF32}});
  EXPECT_EQ(layout.head.size() % gguf::kAlignment, 0u);
  EXPECT_EQ(layout.head.substr(0, 4), "GGUF");
  EXPECT_EQ(layout.offsets, (std::vector<std::uint64_t>{0, 64}));  // 60 bytes of f16, then aligned
  EXPECT_EQ(layout.data_bytes, 64u + 12u);
  EXPECT_EQ(gguf::tensor_bytes(gguf::kQ8_0, 64), 68u);
  EXPECT_EQ(gguf::tensor_name("model.layers.11.self_attn.q_proj.weight"), "blk.11.attn_q.weight");
  EXPECT_EQ(gguf::tensor_name("model.layers.x.self_attn.q_proj.weight"), "");
  EXPECT_EQ(gguf::tensor_name("lm_head.weight"), "output.weight");
}

// Only regular files are read, and only up to their bound.
TEST(RegularFiles, FoldersFifosDevicesAndOversizedFilesAreOneError) {
  const fs::path dir = temp_dir();
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0644), 0);
  EXPECT_EQ(refusal([&] { read_regular_file(dir / "fifo", 100, "data file"); }), "data file " + (dir / "fifo").string() + " is a FIFO (named pipe), not a regular file");
  EXPECT_EQ(refusal([&] { read_regular_file("/dev/zero", 100, "ref"); }), "ref /dev/zero is a character device, not a regular file");
  EXPECT_EQ(refusal([&] { read_regular_file(dir, 100, "data file"); }), "data file " + dir.string() + " is a folder, not a regular file");
  write_file(dir / "big", std::string(300, 'x'));
  EXPECT_EQ(refusal([&] { read_regular_file(dir / "big", 256, "ref"); }), "ref " + (dir / "big").string() + " is larger than the 256 B such a file may be");
  EXPECT_EQ(read_regular_file(dir / "big", 300, "ref").size(), 300u);
  EXPECT_EQ(size_text(4u << 20), "4.00 MiB");
  EXPECT_EQ(lowercase_extension("a/B.PARQUET"), ".parquet");
}

}  // namespace
}  // namespace loom::formats
