// Hostile and careless input through the CLI, one test per class of failure a probe of 1,180
// invocations found: each is one clear line (or one diagnostic per problem) and exit 2, within
// seconds, and no library's own words reach the user.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "cli/export.hpp"
#include "config/data.hpp"
#include "loom/error.hpp"
#include "loom/kit/torch_compat.hpp"
#include "loom/kit/utf8.hpp"
#include "parquet_footer.hpp"
#include "test_support.hpp"

namespace loom::test {
namespace {
namespace fs = std::filesystem;


// Exit 2 with `fragment` in the message, in loom's own words, and the error last.
void expect_refused(const CommandResult& r, const std::string& fragment) {
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, fragment)) << r.err;
  for (const char* library : {"json.exception", "basic_", "boost::", "std::", "terminate", "what()"})
    EXPECT_FALSE(contains(r.err, library)) << r.err;
  const auto last = r.err.rfind('\n', r.err.size() >= 2 ? r.err.size() - 2 : 0);
  EXPECT_EQ(r.err.compare(last == std::string::npos ? 0 : last + 1, 6, "loom: "), 0) << r.err;
}

std::string nested(std::size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

// A valid pipeline for a tiny random model over `dir`/data.jsonl, plus `extra` lines.
fs::path pipeline(const fs::path& dir, const std::string& extra = "", const std::string& data = "{\"text\": \"hello world\"}\n") {
  write_file(dir / "data.jsonl", data);
  write_file(dir / "p.toml", "[model]\nplugin = \"llama\"\ninit = \"random\"\nhidden_size = 32\nintermediate_size = 64\nnum_hidden_layers = 1\n"
                             "num_attention_heads = 2\nvocab_size = 300\nmax_position_embeddings = 2048\n"
                             "[tokenizer]\nplugin = \"bytes\"\n[placement]\nplugin = \"single\"\n" +
                                 extra + (contains(extra, "[data]") ? "" : "[data]\ntrain = \"data.jsonl\"\n") +
                                 (contains(extra, "[collator]") ? "" : "[collator]\nplugin = \"completion-only\"\nresponse_template = \"hello\"\n"));
  return dir / "p.toml";
}

// A model folder with a config.json of this text.
fs::path model_folder(const fs::path& dir, const std::string& config) {
  write_file(dir / "model/config.json", config);
  return dir / "model";
}

const std::string kConfig = R"({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
  "num_attention_heads": 2, "vocab_size": 300})";

TEST(HostileInput, DeeplyNestedJsonIsRefusedEverywhere) {
  const fs::path dir = temp_dir();
  // A data line.
  expect_refused(run_loom({"validate", pipeline(dir, "", "{\"text\": " + nested(100000) + "}\n").string()}), "JSON nested more than 64 levels deep");
  // config.json.
  const auto model = model_folder(dir, R"({"model_type": "llama", "hidden_size": )" + nested(200000) + "}");
  write_file(dir / "m.toml", "[model]\nplugin = \"llama\"\npath = \"" + model.string() + "\"\n[placement]\nplugin = \"single\"\n");
  expect_refused(run_loom({"plan", (dir / "m.toml").string()}), "config.json:1:");
  expect_refused(run_loom({"plan", (dir / "m.toml").string()}), ": JSON nested more than 64 levels deep");
  // A safetensors header.
  const std::string header = R"({"w": {"dtype": "F32", "shape": )" + nested(100000) + R"(, "data_offsets": [0, 0]}})";
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[static_cast<std::size_t>(i)] = static_cast<char>((header.size() >> (8 * i)) & 0xFF);
  write_file(dir / "model/model.safetensors", bytes + header);
  write_file(dir / "model/config.json", kConfig);
  write_file(dir / "g.toml", "[model]\nplugin = \"llama\"\npath = \"" + model.string() + "\"\n[tokenizer]\nplugin = \"bytes\"\n[placement]\nplugin = \"single\"\n");
  expect_refused(run_loom({"generate", (dir / "g.toml").string(), "--prompt", "x"}), "JSON nested more than 64 levels deep");
  // tokenizer.json, and a line for `loom tokenize --decode`.
  write_file(dir / "tok/tokenizer.json", R"({"model": {"type": "BPE", "vocab": {"a": )" + nested(100000) + R"(}, "merges": []}})");
  expect_refused(run_loom({"tokenize", "--tokenizer", (dir / "tok").string(), "a"}), "JSON nested more than 64 levels deep");
  write_file(dir / "ids.txt", nested(100000) + "\n");
  write_file(dir / "tok2/tokenizer.json", R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})");
  expect_refused(run_loom({"tokenize", "--tokenizer", (dir / "tok2").string(), "--decode", "--file", (dir / "ids.txt").string()}),
                 "ids.txt:1:65: JSON nested more than 64 levels deep");
}

// Found by the fuzz targets: numbers past a double (the JSON library throws a different exception
// for them than for syntax), and non-ASCII outside TOML strings (toml++ 3.3 reaches undefined
// behaviour for some code points there).
TEST(HostileInput, FuzzFindingsStayFixed) {
  const fs::path dir = temp_dir();
  expect_refused(run_loom({"validate", pipeline(dir, "", "{\"text\": 5000e000020000000001}\n").string()}),
                 "data.jsonl:1:10: not valid JSON: the number \"5000e000020000000001\" is out of range");
  const auto model = model_folder(dir, R"({"model_type": "llama", "hidden_size": 88888888888888.8888e888})");
  write_file(dir / "m.toml", "[model]\nplugin = \"llama\"\npath = \"" + model.string() + "\"\n[placement]\nplugin = \"single\"\n");
  expect_refused(run_loom({"plan", (dir / "m.toml").string()}), "config.json:1:40: not valid JSON: the number");
  write_file(dir / "tok/tokenizer.json", R"({"model": {"type": "BPE", "vocab": {"a": 5555e5555555555}, "merges": []}})");
  expect_refused(run_loom({"tokenize", "--tokenizer", (dir / "tok").string(), "a"}), "is out of range");
  write_file(dir / "u.toml", "[model]\nplugin = \"llama\"\nplu-i\xd2\x93 = 1\n");
  expect_refused(run_loom({"validate", (dir / "u.toml").string()}), "u.toml:3:6: a non-ASCII character outside a string or comment");
  // A quote inside an invalid bare value starts no string for the parser, which reads on.
  write_file(dir / "v.toml", "[train]\nbatch_size = 2m\"\"\"x=\xcb\x92\"\"\"\n");
  expect_refused(run_loom({"validate", (dir / "v.toml").string()}), "v.toml:2:21: a non-ASCII character outside a string or comment");
  expect_refused(run_loom({"validate", pipeline(dir).string(), "--set", "train.lr=\xc3\xa9"}), "a non-ASCII character outside a quoted string");
  // Valid TOML: after a line-ending backslash in a multi-line string toml++ asks its whitespace
  // table about the next character, which must not be a non-ASCII one; loom writes it as an escape.
  const auto continued = pipeline(dir, "[data]\ntrain = \"data.jsonl\"\nformat = \"\"\"\\\n  \xce\x87 {text}\"\"\"\n");
  auto resolved = run_loom({"run", continued.string(), "--dry-run", "--output", (dir / "dry").string()});
  ASSERT_EQ(resolved.exit_code, 0) << resolved.err;
  EXPECT_EQ(nlohmann::json::parse(read_file(dir / "dry/run.json"))["pipeline"]["data"]["format"], "\u0387 {text}");
  // Any other backslash before a non-ASCII character in a multi-line string is not an escape, and
  // toml++ asks the same table about it.
  write_file(dir / "e.toml", "[data]\nformat = \"\"\"a\\\\ b \\\xef\xb3\xbf\"\"\"\n");
  expect_refused(run_loom({"validate", (dir / "e.toml").string()}), "e.toml:2:19: a backslash followed by a non-ASCII character is not a TOML escape");
  // toml++ scans a bare value ahead to its terminator, through quotes, into a character its table
  // mishandles (U+FEBF): the structure is checked on an ASCII stand-in first.
  write_file(dir / "b.toml", "[run]\nseed = +=m&['p\xef\xba\xbflu\\[\n");
  expect_refused(run_loom({"validate", (dir / "b.toml").string()}), "b.toml:2:8: TOML syntax error");
  const auto set = run_loom({"validate", pipeline(dir).string(), "--set", "run.seed=+=m&['p\xef\xba\xbflu\\["});
  EXPECT_EQ(set.exit_code, 2) << set.err;
  // Non-ASCII in strings and comments is fine.
  const auto r = run_loom({"validate", pipeline(dir, "# caf\xc3\xa9\n[data]\ntrain = \"data.jsonl\"\nformat = \"\xc3\xa9 {text}\"\n").string()});
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

TEST(HostileInput, TargetModuleRegexesAreBoundedAndBudgeted) {
  const fs::path dir = temp_dir();
  const auto with_targets = [&](const std::string& pattern) {
    return pipeline(dir, "[adapter]\nplugin = \"lora\"\ntarget_modules = " + nlohmann::json(pattern).dump() + "\n");
  };
  auto r = run_loom({"validate", with_targets(std::string(100000, 'a')).string()});
  expect_refused(r, "target_modules: a regular expression of 100000 bytes is longer than the 4096 allowed");
  expect_refused(run_loom({"validate", with_targets(std::string(2000, '(') + std::string(2000, ')')).string()}), "does not compile");
  // The probe's catastrophic patterns: PCRE2 settles them at once (std::regex took 13 s and more).
  for (const std::string catastrophic : {"(.*)*X", "(.|.)*X", ".*.*.*.*.*.*.*.*.*.*.*.*X"})
    expect_refused(run_loom({"validate", with_targets(catastrophic).string()}), "matches no linear layer of this model");
  // One that does backtrack past the budget is stopped at the first name.
  expect_refused(run_loom({"validate", with_targets("(.?){30}.{30}").string()}),
                 "failed on model.layers.0.self_attn.q_proj: match limit exceeded (the pattern backtracks too much; simplify it)");
  // A sane regex still works.
  r = run_loom({"validate", with_targets(R"(.*\.(q_proj|v_proj))").string()});
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

TEST(HostileInput, OnlyRegularFilesAreRead) {
  const fs::path dir = temp_dir();
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0644), 0);
  const auto with_train = [&](const std::string& path) { return pipeline(dir, "[data]\ntrain = \"" + path + "\"\n"); };
  expect_refused(run_loom({"validate", with_train(dir.string()).string()}), "is a folder, not a data file nor a folder written by datasets' save_to_disk (it has no state.json)");
  expect_refused(run_loom({"validate", with_train("/dev/zero").string()}), "is a character device, not a regular file");
  expect_refused(run_loom({"validate", with_train((dir / "fifo").string()).string()}), "is a FIFO (named pipe), not a regular file");
  expect_refused(run_loom({"validate", "/proc/self/mem"}), "cannot read: Input/output error");
  // Weights: model.safetensors a FIFO.
  const auto model = model_folder(dir, kConfig);
  ASSERT_EQ(::mkfifo((model / "model.safetensors").c_str(), 0644), 0);
  write_file(dir / "g.toml", "[model]\nplugin = \"llama\"\npath = \"" + model.string() + "\"\n[tokenizer]\nplugin = \"bytes\"\n[placement]\nplugin = \"single\"\n");
  expect_refused(run_loom({"generate", (dir / "g.toml").string(), "--prompt", "x"}), "model.safetensors is a FIFO (named pipe), not a regular file");
  // loom tokenize --file.
  write_file(dir / "tok/tokenizer.json", R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})");
  for (const std::string& file : {std::string("/dev/zero"), dir.string(), (dir / "fifo").string()})
    expect_refused(run_loom({"tokenize", "--tokenizer", (dir / "tok").string(), "--file", file}), "not a regular file");
}

TEST(HostileInput, LimitsSayWhatRealModelsNeed) {
  const fs::path dir = temp_dir();
  expect_refused(run_loom({"validate", pipeline(dir, "[train]\nthreads = 1024\n").string()}), "[train] threads = 1024 is more than this machine's");
  write_file(dir / "eval.jsonl", "{\"text\": \"hi\"}\n");
  expect_refused(run_loom({"validate", pipeline(dir, "[data]\ntrain = \"data.jsonl\"\neval = \"eval.jsonl\"\nmax_length = 64\n[train]\nmax_new_tokens = 65536\n").string(),
                            "--set", "model.max_position_embeddings=256"}),
                 "would pass the model's 256 positions; use at most 192");
  expect_refused(run_loom({"validate", pipeline(dir).string(), "--set", "model.max_position_embeddings=256"}),
                 "[data] max_length = 1024 is longer than the model's 256 positions");
  expect_refused(run_loom({"generate", pipeline(dir).string(), "--set", "model.max_position_embeddings=16", "--prompt", "hello", "--max-new-tokens", "100"}),
                 "a prompt of 6 tokens and 100 new ones pass the model's 16 positions; ask for at most 10 new tokens");
  // A cache the machine cannot hold is refused before it is made.
  std::vector<std::string> huge = {"generate", pipeline(dir).string(), "--set", "model.max_position_embeddings=16000000", "--max-new-tokens", "15999000"};
  for (int i = 0; i < 64; ++i) huge.insert(huge.end(), {"--prompt", "x"});
  expect_refused(run_loom(huge), "generation's KV cache of 64 rows of 15999002 positions needs");
  const auto model = model_folder(dir, R"({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 10000000,
    "num_attention_heads": 2, "vocab_size": 300})");
  write_file(dir / "m.toml", "[model]\nplugin = \"llama\"\npath = \"" + model.string() + "\"\n[placement]\nplugin = \"single\"\n");
  expect_refused(run_loom({"plan", (dir / "m.toml").string()}), "num_hidden_layers = 10000000 is more than the 1024 loom plans for");
  expect_refused(run_loom({"validate", pipeline(dir).string(), "--set", "model.num_hidden_layers=10000000"}), "must be at most 1024");
}

// qlora's own options: each bad value is one error at its line and column, saying what to use.
TEST(HostileInput, QloraOptionsSayWhereAndWhatToUse) {
  const fs::path dir = temp_dir();
  const std::string adapter = "[adapter]\nplugin = \"qlora\"\n";  // the adapter's option is on line 16
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"quant_type = \"int4\"", "p.toml:16:14: [adapter] quant_type: \"int4\" is not one of \"nf4\", \"fp4\""},
      {"quant_type = \"nf5\"", "did you mean \"nf4\"?"},
      {"compute_dtype = \"fp8\"", "p.toml:16:17: [adapter] compute_dtype: \"fp8\" is not one of \"\", \"bf16\", \"fp16\", \"fp32\""},
      {"quantize = \"everything\"", "\"everything\" is not one of \"all-linear\", \"targets\""},
      {"blocksize = 8", "p.toml:16:13: [adapter] blocksize: 8 is out of range: must be at least 16"},
      {"blocksize = 1000000", "1000000 is out of range: must be at most 4096"},
      {"double_quant = \"yes\"", "p.toml:16:16:"},
  };
  for (const auto& [line, fragment] : cases) {
    SCOPED_TRACE(line);
    expect_refused(run_loom({"validate", pipeline(dir, adapter + line + "\n").string()}), fragment);
  }
}

TEST(HostileInput, FileContentErrorsAreInLoomsWords) {
  const fs::path dir = temp_dir();
  const auto model = model_folder(dir, R"({"model_type": 5})");
  write_file(dir / "m.toml", "[model]\nplugin = \"llama\"\npath = \"" + model.string() + "\"\n[placement]\nplugin = \"single\"\n");
  expect_refused(run_loom({"plan", (dir / "m.toml").string()}), "config.json: model_type: expected a string, found the integer 5");
  for (const std::string& rope : {std::string("\"garbage\""), std::string("[1, 2]")}) {
    write_file(model / "config.json", kConfig.substr(0, kConfig.size() - 1) + ", \"rope_scaling\": " + rope + "}");
    expect_refused(run_loom({"plan", (dir / "m.toml").string()}), "config.json: rope_scaling: expected an object");
  }
  write_file(dir / "tok/tokenizer.json", R"({"model": null})");
  expect_refused(run_loom({"tokenize", "--tokenizer", (dir / "tok").string(), "a"}), "it has no \"model\" object");
  // Junk libraries on the plugin path: one line each, the loader's words.
  write_file(dir / "junk/junk.so", "not a library");
  const auto r = run_loom({"validate", pipeline(dir, "[plugins]\npaths = [\"" + (dir / "junk").string() + "\"]\n").string()});
  expect_refused(r, "junk.so: refused: not a loadable shared library (file too short)");
}

TEST(HostileInput, WhatRunWouldFindValidateFinds) {
  const fs::path dir = temp_dir();
  for (const std::string format : {"{instruction", "}{", "{} x", ""})
    expect_refused(run_loom({"validate", pipeline(dir, "[data]\ntrain = \"data.jsonl\"\nformat = " + nlohmann::json(format).dump() + "\n").string()}),
                   "[data] format");
  if (kit::compat::cuda_device_count() == 0)
    expect_refused(run_loom({"validate", pipeline(dir, "[run]\ndtype = \"fp16\"\n").string()}), "[run] dtype = \"fp16\" computes on CUDA devices only");
  expect_refused(run_loom({"validate", pipeline(dir, "", "").string()}), "holds no records");
  expect_refused(run_loom({"validate", pipeline(dir, "", "{\"other\": 1}\n").string()}), "record has no field 'text'");
  const std::string collator = "[collator]\nplugin = \"completion-only\"\nresponse_template = ";
  expect_refused(run_loom({"validate", pipeline(dir, collator + "[99999999999, -1]\n").string()}), "-1 is not a token id");
  expect_refused(run_loom({"validate", pipeline(dir, collator + "[200, 201]\n").string()}), "kept none of the first 1 samples");
  expect_refused(run_loom({"validate", pipeline(dir, collator + "\"### OUTPUT:\"\n").string()}), "training would learn nothing");
  expect_refused(run_loom({"validate", pipeline(dir).string(), "--set", "train.lr=1\nthreads=7"}), "the value holds a line break");
  // A run that fails before its first step leaves no run.json: the same command runs again.
  write_file(dir / "weights/config.json", kConfig);
  write_file(dir / "weights/model.safetensors", "garbage that is no safetensors file");
  write_file(dir / "w.toml", "[model]\nplugin = \"llama\"\npath = \"weights\"\n[tokenizer]\nplugin = \"bytes\"\n[placement]\nplugin = \"single\"\n"
                             "[data]\ntrain = \"data.jsonl\"\n[collator]\nplugin = \"completion-only\"\nresponse_template = \"hello\"\n");
  for (int attempt = 0; attempt < 2; ++attempt) {
    expect_refused(run_loom({"run", (dir / "w.toml").string(), "--output", (dir / "out").string()}), "not a valid safetensors file");
    EXPECT_FALSE(fs::exists(dir / "out/run.json"));
  }
}

TEST(HostileInput, CheckpointStateIsCheckedAgainstTheRun) {
  const fs::path dir = temp_dir();
  const auto p = pipeline(dir, "[train]\nmax_steps = 4\ncheckpoint_every = 2\nbatch_size = 1\n");
  ASSERT_EQ(run_loom({"run", p.string(), "--output", (dir / "o").string()}).exit_code, 0);
  const fs::path state = dir / "o/checkpoints/step-00000004/trainer.json";
  const auto good = nlohmann::json::parse(read_file(state));
  const auto resume = [&] { return run_loom({"run", p.string(), "--output", (dir / "o").string(), "--resume"}); };
  for (const auto& [key, value, message] : std::vector<std::tuple<std::string, nlohmann::json, std::string>>{
           {"step", -5, "step: expected an integer of at least 0, found the integer -5"},
           {"step", 9223372036854775807LL, "step: 9223372036854775807 is not the step of step-00000004"},
           {"index", 99999999999999LL, "index: expected an integer from 0 to 1"},
           {"epoch", -1, "epoch: expected an integer from 0 to"},
           {"loss_scale", 0, "loss_scale: must be a positive finite number"}}) {
    auto damaged = good;
    damaged[key] = value;
    write_file(state, damaged.dump());
    expect_refused(resume(), message);
  }
  write_file(state, good.dump());
  write_file(dir / "o/checkpoints/latest", "../../../etc\n");
  expect_refused(resume(), "holds \"../../../etc\", not the name of a checkpoint");
  std::string junk;
  for (int i = 0; i < 200; ++i) junk.push_back(static_cast<char>(i * 37 + 11));
  write_file(dir / "o/checkpoints/latest", junk);
  const auto r = resume();
  expect_refused(r, "not the name of a checkpoint");
  EXPECT_EQ(r.err.find('\x1b'), std::string::npos) << "raw bytes reached the terminal";
  write_file(dir / "o/checkpoints/latest", "step-00000003\n");
  expect_refused(resume(), "names step-00000003, which is not a checkpoint folder");
  fs::remove(dir / "o/checkpoints/latest");
  ASSERT_EQ(::mkfifo((dir / "o/checkpoints/latest").c_str(), 0644), 0);
  expect_refused(resume(), "is a FIFO (named pipe), not a regular file");
}

// Round four: the readers added since the last round (Parquet, the hub cache, the objectives'
// records, export, the command reward), probed as a hostile user would.

// Six thousand columns over one megabyte: reading each chunk before checking them took 6 GB.
TEST(HostileInput, ParquetChunksAreCheckedBeforeAnyIsRead) {
  const fs::path dir = temp_dir();
  std::vector<std::string> names = {"text"};
  for (int i = 1; i < 6000; ++i) names.push_back("c" + std::to_string(i));
  write_file(dir / "overlap.parquet", parquet_with_shared_chunk(names, 1 << 20));
  ChildLimits limits;
  limits.address_bytes = std::uint64_t{4} << 30;
  limits.wall = std::chrono::seconds(60);
  const auto r = run_loom_with_limits({"validate", pipeline(dir, "[data]\ntrain = \"overlap.parquet\"\n").string()}, {}, limits);
  expect_refused(r, "overlap.parquet: row group 0: two column chunks overlap (at bytes 4 and 4); the file is damaged");
  // A chunk that runs past the file is refused as well, before any is read.
  write_file(dir / "past.parquet", parquet_with_shared_chunk({"text"}, 8, 1 << 20));
  expect_refused(run_loom({"validate", pipeline(dir, "[data]\ntrain = \"past.parquet\"\n").string()}),
                 "past.parquet: row group 0, column 'text': its chunk (1048576 bytes at 4) lies past the end of the file");
}

// A ref in the hub cache is 40 hex digits: a FIFO is not waited on, /dev/zero or a huge file is not
// read whole (a ref read by getline took 2.3 GB before "does not hold a commit").
TEST(HostileInput, HubCacheRefsAreSmallRegularFiles) {
  const fs::path dir = temp_dir();
  const fs::path cache = dir / "hub", refs = cache / "models--org--tiny/refs";
  fs::create_directories(refs);
  fs::create_directories(cache / "models--org--tiny/snapshots");
  write_file(dir / "m.toml", "[model]\nplugin = \"llama\"\npath = \"org/tiny\"\n[placement]\nplugin = \"single\"\n");
  ChildLimits limits;
  limits.address_bytes = std::uint64_t{4} << 30;
  limits.wall = std::chrono::seconds(60);
  const auto plan = [&] { return run_loom_with_limits({"plan", (dir / "m.toml").string()}, {{"HF_HUB_CACHE", cache.string()}}, limits); };
  ASSERT_EQ(::mkfifo((refs / "main").c_str(), 0644), 0);
  expect_refused(plan(), "the hub cache's ref " + (refs / "main").string() + " is a FIFO (named pipe), not a regular file");
  fs::remove(refs / "main");
  fs::create_symlink("/dev/zero", refs / "main");
  expect_refused(plan(), "is a character device, not a regular file");
  fs::remove(refs / "main");
  {
    std::ofstream sparse(refs / "main");
    sparse << std::string(100, 'a');
  }
  fs::resize_file(refs / "main", std::uintmax_t{8} << 30);  // sparse: 8 GB of zeros that take no disk
  expect_refused(plan(), "is larger than the 256 B such a file may be");
  fs::resize_file(refs / "main", 0);
  write_file(refs / "main", std::string(40, 'a') + "\n");
  expect_refused(plan(), "revision \"main\" is commit " + std::string(40, 'a') + ", whose snapshot");
}

// Text is UTF-8 in every format and for every objective: a CSV of Latin-1 bytes is one error naming
// its line and column, for SFT as for DPO and GRPO (whose records went into JSON and threw).
TEST(HostileInput, TextIsUtf8ForEveryObjective) {
  const fs::path dir = temp_dir();
  write_file(dir / "pairs.csv", "instruction,chosen,rejected,output\nwhat,yes,no,yes\ncaf\xe9,oui,non,oui\n");
  const std::string model = "[model]\nplugin = \"llama\"\ninit = \"random\"\nhidden_size = 32\nintermediate_size = 64\nnum_hidden_layers = 1\n"
                            "num_attention_heads = 2\nvocab_size = 300\nmax_position_embeddings = 256\n[tokenizer]\nplugin = \"bytes\"\npad_token = \"eos\"\n"
                            "[placement]\nplugin = \"single\"\n[data]\ntrain = \"pairs.csv\"\nformat = \"{instruction} \"\n";
  const std::string message = "pairs.csv:3: column \"instruction\" holds bytes that are not UTF-8 text (byte 4 of the field); save the file as UTF-8";
  write_file(dir / "sft.toml", model + "[collator]\nplugin = \"all-tokens\"\n");
  expect_refused(run_loom({"validate", (dir / "sft.toml").string()}), message);
  write_file(dir / "dpo.toml", model + "[objective]\nplugin = \"dpo\"\n");
  expect_refused(run_loom({"validate", (dir / "dpo.toml").string()}), message);
  write_file(dir / "grpo.toml", model + "[objective]\nplugin = \"grpo\"\nanswer_field = \"output\"\n[reward.right]\nplugin = \"exact-answer\"\nfield = \"output\"\n");
  expect_refused(run_loom({"validate", (dir / "grpo.toml").string()}), message);
}

// An untrained byte-level model samples bytes that are no UTF-8: the text form prints them as they
// came, the JSON form replaces each with U+FFFD (JSON holds nothing else).
TEST(HostileInput, GenerateJsonReplacesBytesThatAreNotUtf8) {
  const fs::path dir = temp_dir();
  const auto p = pipeline(dir).string();
  const std::vector<std::string> ask = {"generate", p, "--prompt", "hello", "--max-new-tokens", "48", "--temperature", "1", "--ignore-eos"};
  const auto text = run_loom(ask);
  ASSERT_EQ(text.exit_code, 0) << text.err;
  ASSERT_NE(kit::invalid_utf8_at(text.out), std::string::npos) << "the seed's sample holds only UTF-8: this checks nothing";
  auto with_json = ask;
  with_json.push_back("--json");
  const auto json = run_loom(with_json);
  ASSERT_EQ(json.exit_code, 0) << json.err;
  const auto answers = nlohmann::json::parse(json.out);
  const std::string answer = answers.at(0).at("answer").get<std::string>();
  EXPECT_EQ(answers.at(0).at("prompt"), "hello");
  std::string printed = text.out.substr(std::string("hello").size());
  printed.pop_back();  // the line's end
  EXPECT_EQ(answer, kit::replace_invalid_utf8(printed));
}

// Where an export goes is checked before anything loads; a failed write leaves no temporary folder;
// the export's temporary names are its own, and it never replaces what appeared at its output.
TEST(HostileInput, ExportChecksItsOutputFirstAndLeavesNothingBehind) {
  const fs::path dir = temp_dir();
  const auto p = pipeline(dir).string();
  write_file(dir / "afile", "x");
  expect_refused(run_loom({"export", p, "--output", (dir / "afile/out").string()}), "afile/out: " + (dir / "afile").string() + " is not a folder");
  expect_refused(run_loom({"export", p, "--output", (dir / "afile").string()}), "--output " + (dir / "afile").string() + " already exists");
  if (::geteuid() != 0) {  // root writes anywhere
    fs::create_directories(dir / "locked");
    fs::permissions(dir / "locked", fs::perms::owner_read | fs::perms::owner_exec);
    expect_refused(run_loom({"export", p, "--output", (dir / "locked/out").string()}), "cannot write in " + (dir / "locked").string());
  }
  // A disk that fills up as the weights are written: one error, and nothing left beside the output.
  fs::create_directories(dir / "full");
  const auto r = run_loom_with_file_limit({"export", p, "--output", (dir / "full/out").string()}, 4096);
  expect_refused(r, "File too large");
  EXPECT_TRUE(fs::is_empty(dir / "full")) << fs::directory_iterator(dir / "full")->path();
  for (const std::string format : {"hf", "gguf"}) {
    const auto ok = run_loom({"export", p, "--output", (dir / ("ok-" + format)).string(), "--format", format});
    EXPECT_EQ(ok.exit_code, 0) << ok.err;
  }
  std::set<std::string> left;
  for (const auto& e : fs::directory_iterator(dir)) left.insert(e.path().filename().string());
  for (const auto& name : left) EXPECT_NE(name.front(), '.') << name << " was left behind";
  // Two exports' temporary names differ; the last move refuses an output that appeared meanwhile,
  // even an empty folder, which rename(2) would replace.
  EXPECT_NE(core::private_sibling(dir / "out", "export"), core::private_sibling(dir / "out", "export"));
  fs::create_directories(dir / "mine/weights");
  fs::create_directories(dir / "theirs");
  try {
    core::rename_without_replacing(dir / "mine", dir / "theirs", "--output");
    ADD_FAILURE() << "an output that appeared meanwhile was replaced";
  } catch (const UserError& e) {
    EXPECT_TRUE(contains(e.what(), "appeared while this export ran")) << e.what();
  }
  EXPECT_TRUE(fs::exists(dir / "mine/weights"));
  EXPECT_TRUE(fs::is_empty(dir / "theirs"));
}

// An epsilon of 0 is refused at its line; an update that makes the weights non-finite is named as
// the cause at the next step (it was "lower [train] lr", a step late and without a reason).
TEST(HostileInput, NonFiniteUpdatesNameTheirCause) {
  const fs::path dir = temp_dir();
  expect_refused(run_loom({"validate", pipeline(dir, "[train]\nadam_epsilon = 0.0\n").string()}),
                 "p.toml:15:16: [train] adam_epsilon = 0 must be above 0");
  // A weight decay past what a float holds turns every weight infinite in the first update.
  const auto r = run_loom({"run", pipeline(dir, "[train]\nmax_steps = 3\nweight_decay = 1e300\nbatch_size = 1\n").string(), "--output",
                           (dir / "out").string()});
  expect_refused(r, "step 2: the gradients are not finite because the trainable weights are not (model.");
  EXPECT_TRUE(contains(r.err, "step 1's update made them so ([train] optimizer = \"adamw\", lr = 0.0002, adam_epsilon = 1e-08, weight_decay = 1e+300)"))
      << r.err;
}

// Excel's "CSV UTF-8" and Windows editors start a file with a byte-order mark; a header or a schema
// that names a column twice would silently keep one of them.
TEST(HostileInput, ByteOrderMarksAreSkippedAndDuplicateColumnsRefused) {
  const fs::path dir = temp_dir();
  const std::string bom = "\xEF\xBB\xBF";
  const auto samples = [&](const std::string& name, const std::string& content) {
    write_file(dir / name, content);
    return core::load_data(dir / name, "{text}", false).samples;
  };
  const std::vector<std::string> expected = {"one", "two"};
  EXPECT_EQ(samples("a.csv", bom + "text,n\none,1\ntwo,2\n"), expected);
  EXPECT_EQ(samples("a.tsv", bom + "text\tn\none\t1\ntwo\t2\n"), expected);
  EXPECT_EQ(samples("a.jsonl", bom + "{\"text\": \"one\"}\n{\"text\": \"two\"}\n"), expected);
  EXPECT_EQ(samples("a.json", bom + "[{\"text\": \"one\"}, {\"text\": \"two\"}]"), expected);
  const auto refusal = [&](const std::string& name, const std::string& content) -> std::string {
    write_file(dir / name, content);
    try {
      core::load_data(dir / name, "{text}", false);
    } catch (const UserError& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_EQ(refusal("twice.csv", "text,n,text\na,1,b\n"),
            (dir / "twice.csv").string() + ":1: column \"text\" appears twice (columns 1 and 3); a record keeps one value a name, so rename one of them");
  EXPECT_EQ(refusal("twice.parquet", parquet_with_shared_chunk({"text", "text"}, 8)),
            (dir / "twice.parquet").string() + ": column \"text\" appears twice (columns 1 and 2); a record keeps one value a name, so rename one of them");
  // The pipeline, the chat template and config.json read past a mark too.
  write_file(dir / "data.jsonl", "{\"text\": \"hello world\"}\n");
  write_file(dir / "bom.toml", bom + read_file(pipeline(dir)));
  const auto r = run_loom({"validate", (dir / "bom.toml").string()});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const auto model = model_folder(dir, bom + kConfig);
  write_file(dir / "m.toml", "[model]\nplugin = \"llama\"\npath = \"" + model.string() + "\"\n[placement]\nplugin = \"single\"\n");
  const auto planned = run_loom({"plan", (dir / "m.toml").string()});
  EXPECT_EQ(planned.exit_code, 0) << planned.err;
}

// A datasets folder's state.json that lists one file many times made 51 M records of a 3.5 KB
// file (the rows-per-byte guard counted it once a listing).
TEST(HostileInput, DatasetsFolderReadsEachFileOnce) {
  const fs::path dir = temp_dir();
  const fs::path fixture = source_dir() / "tests/fixtures/data/columnar/datasets-folder";
  fs::create_directories(dir / "ds");
  for (const auto& e : fs::directory_iterator(fixture)) fs::copy_file(e.path(), dir / "ds" / e.path().filename());
  nlohmann::json files = nlohmann::json::array();
  for (int i = 0; i < 200000; ++i) files.push_back({{"filename", "data-00000-of-00002.arrow"}});
  write_file(dir / "ds/state.json", nlohmann::json{{"_data_files", files}}.dump());
  expect_refused(run_loom({"validate", pipeline(dir, "[data]\ntrain = \"ds\"\nformat = \"{question}\"\n").string()}),
                 "ds/state.json: lists the data file \"data-00000-of-00002.arrow\" twice; each is read once");
  // Two names of one file (a link) are the same file.
  fs::create_hard_link(dir / "ds/data-00000-of-00002.arrow", dir / "ds/copy.arrow");
  write_file(dir / "ds/state.json", R"({"_data_files": [{"filename": "data-00000-of-00002.arrow"}, {"filename": "copy.arrow"}]})");
  expect_refused(run_loom({"validate", pipeline(dir, "[data]\ntrain = \"ds\"\nformat = \"{question}\"\n").string()}),
                 "lists the data file \"copy.arrow\" and \"data-00000-of-00002.arrow\", the same file");
}

}  // namespace
}  // namespace loom::test
