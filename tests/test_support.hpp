#pragma once
#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/communicator.hpp"
#include "loom/mesh.hpp"
#include "loom/model.hpp"
#include "loom/options.hpp"
#include "loom/plugin.hpp"

namespace loom::test {

// Tests that need a CUDA device, declared with LOOM_GPU_TEST instead of TEST: CTest runs each
// alone, labelled `gpu` (`ctest -L gpu`, `-LE gpu`), and reports it skipped where it skips.
const std::vector<std::string>& gpu_tests();
bool register_gpu_test(const char* name);
// The exit code of a loom_tests run whose every test skipped (CTest's SKIP_RETURN_CODE).
inline constexpr int kAllSkipped = 77;
// A GoogleTest TEST that needs a CUDA device; its body skips (GTEST_SKIP, saying why) without one,
// after whatever it checks on the CPU.
#define LOOM_GPU_TEST(suite, name)                                                                              \
  [[maybe_unused]] static const bool loom_gpu_test_##suite##_##name = ::loom::test::register_gpu_test(#suite "." #name); \
  TEST(suite, name)

// Whether `text` holds `part`.
inline bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Polls `done` every `every` until it holds (true) or `limit` passes (false).
bool wait_until(const std::function<bool()>& done, std::chrono::seconds limit, std::chrono::milliseconds every = std::chrono::milliseconds(20));

struct CommandResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

// Runs `loom ARGS` inside this test process: the CLI's own entry point (run_cli) with stdout and
// stderr captured and stdin empty, `env` entries set for the call only (an empty value unsets the
// variable) and `cwd` as the working folder. Every command loom has runs this way except a launch
// (`run` or `generate` with --nproc-per-node starts copies of the running program, which here is
// the test binary: that throws std::logic_error naming run_loom_process and run_loom_ranks).
CommandResult run_loom(const std::vector<std::string>& args, const std::map<std::string, std::string>& env = {},
                       const std::filesystem::path& cwd = {});
// As run_loom, in a child process running the built `loom` binary: for what needs a process of its
// own (the launcher, exit codes from signals, environments such as torchrun's).
CommandResult run_loom_process(const std::vector<std::string>& args, const std::map<std::string, std::string>& env = {},
                               const std::filesystem::path& cwd = {});
// `loom run` or `loom generate` (`args` without --nproc-per-node) over `world` ranks, each a thread
// of this process with its own rendezvous on a free loopback port: the collectives (Gloo), the
// trainer and the runtime are the real ones, only the launcher and its processes are not. Ranks
// share the process's random generator, so pipelines run this way keep dropout off. Returns the
// first non-zero exit code of a rank (0 when all succeed), with the output of all.
CommandResult run_loom_ranks(const std::vector<std::string>& args, int world);
// As run_loom_process, with no file the child writes allowed past `max_file_bytes` (ulimit -f): a disk
// that fills up, as far as one process can tell.
CommandResult run_loom_with_file_limit(const std::vector<std::string>& args, std::uint64_t max_file_bytes);

// Limits a child starts with (0: the parent's): its file size (ulimit -f), open files (ulimit -n)
// and address space (ulimit -v: what a hostile file could make it allocate; under AddressSanitizer,
// its resident memory).
struct ChildLimits {
  std::uint64_t file_bytes = 0;
  std::uint64_t open_files = 0;
  std::uint64_t address_bytes = 0;
  std::chrono::seconds wall{0};  // past it the child is killed and exit_code is -1 (a hang)
};
CommandResult run_loom_with_limits(const std::vector<std::string>& args, const std::map<std::string, std::string>& env, const ChildLimits& limits);

// The processes, not ended, whose environment holds `variable` ("NAME=VALUE") exactly: what a test
// started (its children and theirs, reparented or not) by a mark set in the environment.
std::vector<int> live_processes_with(const std::string& variable);

// Starts `loom` without waiting; output goes to the given files. Returns the child's pid.
int start_loom(const std::vector<std::string>& args, const std::filesystem::path& out, const std::filesystem::path& err);
// As start_loom, with `env` set in the child (an empty value unsets the variable).
int start_loom_with_env(const std::vector<std::string>& args, const std::filesystem::path& out, const std::filesystem::path& err,
                        const std::map<std::string, std::string>& env);
// Waits for a child; its exit code, or 128 + signal.
int wait_child(int pid);
// As wait_child, but kills the child and returns -1 if it has not exited within `limit`: a hang
// fails the test instead of holding CI.
int wait_child_within(int pid, std::chrono::seconds limit);

// Starts `loom run PIPELINE --output OUT --nproc-per-node 2` (its output in OUT.out and OUT.err),
// SIGKILLs its rank 1 once OUT/checkpoints/latest exists, and returns the launcher's exit code
// (-1 when rank 1 could not be found or the launcher hung).
int kill_rank_one_after_checkpoint(const std::filesystem::path& pipeline, const std::filesystem::path& out);

// A free TCP port on the loopback interface.
int free_port();
// Runs `body` on one thread per rank of `mesh`, each connected to the others over Gloo; failures
// of any rank are reported as the test's. `timeout` is the ranks' [run] timeout for their
// collectives; joining may take a minute whatever it is (threads start late on a loaded machine).
void on_ranks(const Mesh& mesh, const std::function<void(Parallel&)>& body, std::chrono::seconds timeout = std::chrono::seconds(60));

// A tiny copy task (the answer repeats the prompt's word, so a small model learns it in seconds):
// writes train.jsonl (84 records) and eval.jsonl (12, pairs the training never saw) into `dir`
// and returns the pipeline sections for a small random Llama learning it on the CPU: [model],
// [tokenizer], [data], [collator] and [placement] single. Callers add [run], [adapter], [train].
std::string copy_task(const std::filesystem::path& dir);

// The tensors, by PEFT key, of a LoRA adapter of rank `r` on every linear of the copy task's
// Llama with `layers` layers (hidden 32, 4 heads and 2 K/V heads of 8, MLP 64), and with
// `embedding` its trained embedding (vocabulary 259): the shapes PEFT gives them.
std::map<std::string, std::vector<std::int64_t>> copy_task_adapter_shapes(int layers, std::int64_t r, bool embedding);

// The copy task's pipeline in `dir` (written as dir/p.toml, returned): a Llama of `layers` decoder
// layers, tied or untied, with the [placement] section `placement`, `adapter` and `train` lines and
// `extra` sections; [run] seed 7, dropout off, so ranks draw no random numbers one process would
// draw differently.
std::filesystem::path copy_task_pipeline(const std::filesystem::path& dir, int layers, bool tied, const std::string& placement,
                                         const std::string& adapter, const std::string& train, const std::string& extra = "");

// Which of `prompts` `loom generate` output answered exactly: each line is a prompt and its
// continuation, compared with the answer as the trainer's exact-match compares them (surrounding
// whitespace trimmed). A GoogleTest failure when the output does not hold the prompts in order.
std::vector<bool> exact_answers(const std::string& generated, const std::vector<std::string>& prompts, const std::vector<std::string>& answers);

// Six samples of the copy task's training data (abab, cdab, ...) as `prompts` and `answers`.
struct Samples {
  std::vector<std::string> prompts, answers;
};
// Runs the copy task's `pipeline` (with `overrides`) for 100 steps into `out`, evaluated on six of
// the samples it trains on (written as seen.jsonl beside the pipeline), and expects it to answer at
// least half of them, and the exact-match it reports to be what `loom generate` answers with its
// saved adapter. Returns the samples; `generated` is loom generate's output.
Samples expect_trained_samples_answered(const std::filesystem::path& pipeline, const std::filesystem::path& out,
                                        const std::vector<std::string>& overrides, std::string& generated);

// The last eval row of a metrics.jsonl.
nlohmann::json last_eval(const std::filesystem::path& metrics);
// Every tensor of an HF folder or adapter (one file or shards), by name.
std::map<std::string, at::Tensor> tensors_of(const std::filesystem::path& dir);
// The same names and shapes in both, each tensor within `tolerance` of b's largest value (a
// GoogleTest expectation).
void expect_same_tensors(const std::filesystem::path& a, const std::filesystem::path& b, double tolerance);
// The same names and shapes in both, each tensor's difference within `tolerance` of b's norm (the
// bulk of the values, where a few elements may differ more; a GoogleTest expectation).
void expect_close_in_norm(const std::filesystem::path& a, const std::filesystem::path& b, double tolerance);
// expect_close_in_norm's tolerance for weights trained where ranks sum in another order than one
// process (tensor, data and expert ranks, packed rows). Element by element no bound holds: AdamW
// turns the rounding of a near-zero gradient into a whole step of lr either way, every step (7.5
// mode on the GPU, tied LoRA's v_proj lora_A ended 1.49e-2 of 0.21 apart with its losses within
// 3e-5). The rounding the losses show (1e-5 relative) moves the bulk little: 1.5e-3 of the norm at
// most on the CPU's layouts (2026-12-07); a lost or doubled share of a gradient moves it by tens
// of percents.
inline constexpr double kReorderedNorm = 2e-2;

// How far float32 results through the model of `config` (a config.json) may lie apart when
// computed by other kernels or in another order of summation (another LibTorch, another CPU's
// BLAS, tensor ranks), relative to the magnitude of what they sum: every sum or dot product on a
// token's way rounds by at most its length times float32's epsilon (Higham's bound). Per layer:
// the projections' inputs (hidden, three times: q/k/v, o, gate/up), a head's scores (head_dim),
// attention over `tokens`, down's input and SwiGLU (intermediate, twice); then the head (hidden),
// the softmax (vocabulary) and a row's sum over its `tokens`.
double float32_path_bound(const std::filesystem::path& config, std::int64_t tokens);

// tests/fixtures/parity/NAME, or tests/fixtures/families/NAME for "families/NAME" (written by
// tests/parity/make_family_fixtures.py with transformers 5.17 and PEFT 0.21).
std::filesystem::path parity_fixture(const std::string& name);
// A fixture's name as a GoogleTest parameter's name ('-' and '/' made '_').
std::string fixture_test_name(std::string name);
// The saved folder `mine` holds every tensor of `theirs`' model.safetensors under its name with
// its values, and no other (GoogleTest expectations); the values theirs holds.
std::uint64_t expect_same_checkpoint(const std::filesystem::path& mine, const std::filesystem::path& theirs);

// A parity fixture's inputs.json (tests/parity/make_fixtures.py).
struct ParityInputs {
  at::Tensor ids, mask, positions;
};
ParityInputs read_parity_inputs(const std::filesystem::path& dir);
// Max |a - b| over the positions the mask marks real (padded positions differ by design: loom lets
// a padding query attend to itself, HF spreads it over every key).
double max_real_error(const at::Tensor& a, const at::Tensor& b, const at::Tensor& mask);

// metrics.jsonl's rows without the wall-clock tokens_per_s; with `training_only`, no eval rows.
std::vector<nlohmann::json> metrics_rows(const std::filesystem::path& metrics, bool training_only);

// The training losses of two metrics.jsonl files equal within `tolerance` relative, step by step,
// and falling (a GoogleTest expectation).
void expect_same_losses(const std::filesystem::path& a, const std::filesystem::path& b, double tolerance);

// A fresh, empty folder under the system temp folder, unique to this test.
// Every adapted layer of `model` (base frozen): its forward (the adapter's WholeProduct or
// DeltaAddedInPlace path) gives the output and the input, A and B gradients that base.forward(x) +
// delta(x) gives, within `tolerance`; with WholeProduct, as one autograd node. Returns the layers
// checked.
int expect_adapted_layers_equal_their_sums(LoadedModel& model, double tolerance);

std::filesystem::path temp_dir();
void write_file(const std::filesystem::path& path, const std::string& content);
std::string read_file(const std::filesystem::path& path);

std::filesystem::path source_dir();
std::filesystem::path test_plugin_dir(const std::string& test_case);
std::filesystem::path builtin_plugin_dir();

// A built-in plugin's object, made with its defaults overridden by `given` (the registry that
// loaded it lives for the whole test process).
std::unique_ptr<Plugin> make_plugin_object(const std::string& kind, const std::string& name,
                                           const std::map<std::string, OptionValue>& given);
template <typename T>
std::unique_ptr<T> make_plugin(const std::string& kind, const std::string& name, const std::map<std::string, OptionValue>& given = {}) {
  auto object = make_plugin_object(kind, name, given);
  return std::unique_ptr<T>(dynamic_cast<T*>(object.release()));
}

// The built-in model plugin that reads the HF folder `folder` (by its config.json's model_type).
std::string model_plugin_of(const std::filesystem::path& folder);

// The built-in llama plugin's model for a config.json with this text (written to a temp folder).
std::unique_ptr<Model> llama_from_config(const std::string& config_json);

// A small byte-level tokenizer.json (GPT-2's byte alphabet, "ab", "abc", the special "<eos>" as 258)
// to break in one place per test.
nlohmann::json tiny_tokenizer();

}  // namespace loom::test
