#include "cli/cli.hpp"
#include "cli/export.hpp"

#include <malloc.h>
#include <unistd.h>

#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include <boost/program_options.hpp>

#include <nlohmann/json.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <c10/util/Logging.h>
#include <spdlog/spdlog.h>

#include "config/data.hpp"
#include "config/diagnostics.hpp"
#include "loom/error.hpp"
#include "loom/kit/atomic_file.hpp"
#include "loom/kit/hub_cache.hpp"
#include "runtime/replica_outputs.hpp"
#include "loom/kit/input_file.hpp"
#include "loom/kit/json.hpp"
#include "loom/kit/kernels.hpp"
#include "loom/kit/torch_compat.hpp"
#include "loom/kit/utf8.hpp"
#include "config/pipeline.hpp"
#include "plugins/plugin_guard.hpp"
#include "plugins/plugin_registry.hpp"
#include "chat/chat_collator.hpp"
#include "chat/chat_data.hpp"
#include "cli/report.hpp"
#include "cli/run_page.hpp"
#include "distributed/distributed.hpp"
#include "runtime/evaluator.hpp"
#include "runtime/executor.hpp"
#include "distributed/launcher.hpp"
#include "cli/logits.hpp"
#include "loom/kit/safetensors.hpp"
#include "cli/run_command.hpp"
#include "runtime/folded_adapters.hpp"
#include "planner/rank_setup.hpp"
#include "generation/generate.hpp"
#include "planner/planner.hpp"
#include "runtime/rank_runtime.hpp"
#include "cli/tokenize.hpp"

namespace loom::core {
namespace po = boost::program_options;
namespace fs = std::filesystem;
namespace {

constexpr int kExitOk = 0;
constexpr int kExitInternal = 1;
constexpr int kExitUser = 2;
constexpr int kExitMismatch = 4;  // `loom logits --compare`: the logits differ past the tolerance

const char* kUsage =
    "usage: loom [--log-level LEVEL] COMMAND [ARGS]\n"
    "\n"
    "commands:\n"
    "  run PIPELINE       validate, plan and run a pipeline; writes run.json to the output folder\n"
    "  validate PIPELINE  check a pipeline and its plugins; report every problem as file:line:col\n"
    "  plan PIPELINE      show where every block of the model goes and the memory it needs there\n"
    "  generate PIPELINE  continue --prompt TEXT with the pipeline's model (and --adapter DIR)\n"
    "  eval PIPELINE      loss, perplexity and exact-match of the model (and --adapter DIR) on a data file\n"
    "  export PIPELINE    the model (an --adapter DIR merged in) as a Hugging Face folder, --output DIR\n"
    "  logits PIPELINE    the model's logits for --inputs FILE (token ids), written or compared\n"
    "  tokenize           token ids of text with --tokenizer PATH (a tokenizer.json or its folder)\n"
    "  plugins            list the plugins found; `plugins describe NAME` shows a plugin's options\n"
    "  report RUN_DIR     write a run folder's page (curves, plan, outputs, manifest) as one HTML file\n"
    "\n"
    "global options:\n"
    "  --help             this text (or `loom COMMAND --help`)\n"
    "  --version          versions of loom, its SDK, LibTorch, CUDA and NCCL\n"
    "  --log-level LEVEL  trace, debug, info (default), warn, error or off\n"
    "\n"
    "Plugins are searched beside the loom binary, then in LOOM_PLUGIN_PATH (folders separated by ':'),\n"
    "then in the pipeline's [plugins] paths.\n";

struct Command {
  std::string name;
  std::vector<std::string> args;
  bool help = false;
};

po::variables_map parse(const Command& cmd, po::options_description& options, po::positional_options_description& positional) {
  po::variables_map vm;
  po::store(po::command_line_parser(cmd.args).options(options).positional(positional).run(), vm);
  po::notify(vm);
  return vm;
}

void add_pipeline_options(po::options_description& options) {
  options.add_options()("pipeline", po::value<std::string>()->required(), "pipeline TOML file")(
      "set", po::value<std::vector<std::string>>()->composing(), "override a pipeline key: --set SECTION.KEY=VALUE (repeatable)");
}

std::vector<std::string> overrides_of(const po::variables_map& vm) {
  return vm.count("set") ? vm["set"].as<std::vector<std::string>>() : std::vector<std::string>{};
}

// --adapter DIR loads through the plugin the pipeline's [adapter] names.
void require_adapter_section(const po::variables_map& vm, const Session& session) {
  if (vm.count("adapter") && !session.adapter)
    throw UserError("--adapter needs an [adapter] section naming the adapter's plugin (e.g. plugin = \"lora\")");
}

// --adapter DIR: an adapter folder, or a run or checkpoint folder holding one in adapter/.
std::string adapter_folder(const fs::path& given) {
  std::error_code ec;
  if (!fs::exists(given / "adapter_config.json", ec) && fs::exists(given / "adapter" / "adapter_config.json", ec)) {
    spdlog::info("--adapter {}: the adapter in {}", given.string(), (given / "adapter").string());
    return (given / "adapter").string();
  }
  return given.string();
}

// The options commands take by position (named in the synopsis, not as --options).
bool positional_option(const std::string& name) { return name == "pipeline" || name == "run-dir" || name == "action" || name == "name"; }

bool wants_help(const Command& cmd, const po::options_description& options, const std::string& synopsis) {
  if (!cmd.help) return false;
  po::options_description shown(cmd.name + " options");
  for (const auto& option : options.options())
    if (!positional_option(option->long_name())) shown.add(option);
  std::cout << "usage: loom " << synopsis << "\n\n" << shown;
  return true;
}

// validate's checks; what it read of each data file goes into `data` (JSON) and `records` (text).
void validate_pipeline(const fs::path& file, const std::vector<std::string>& overrides, nlohmann::json& result, std::string& records) {
  auto registry = load_default_registry();
  const GpuCapabilities no_gpus;  // validation does not depend on this machine's devices
  Session session = open_session(load_pipeline(file, overrides, registry, Purpose::kRun), registry, &no_gpus);
  check_inputs(session);
  const int replica = session.config.parallel.replica();
  const int world = std::max(requested_world(session.config), replica);
  const Mesh mesh = resolve_mesh(session.config, world);
  // The plan's structure as plan and run check it (stages over pipeline ranks, tensor splits,
  // schedules), on one host of `world` ranks with 8 GPUs each and no memory limits: validation
  // does not depend on the machine it runs on (a login node without GPUs), `loom plan` does.
  Inventory unbounded;
  constexpr std::uint64_t kUnbounded = std::uint64_t{1} << 50;
  for (int i = 0; i < 8 * world; ++i) unbounded.devices.push_back({"cuda:" + std::to_string(i), kUnbounded, "any GPU"});
  unbounded.devices.push_back({"cpu", kUnbounded, "any host"});
  make_mesh_plan(session, unbounded, mesh, world);
  // Every record of every data file, read as the run will read it but none kept: a bad line 500 is
  // found here, not when training reaches it.
  Diagnostics diagnostics;
  const auto& data = session.spec.section("data");
  const RunConfig& c = session.config;
  std::size_t train_records = 0;  // held out by eval_split
  for (const char* key : {"train", "eval"}) {
    const bool train = std::string(key) == "train";
    std::vector<fs::path> paths = train ? c.train_files : std::vector<fs::path>();
    if (!train && c.eval_file) paths.push_back(*c.eval_file);
    for (const auto& path : paths) {
      try {
        const Dataset read = load_data(path, c.format, c.skip_bad_lines, static_cast<std::size_t>(-1), /*keep_samples=*/false, c.samples_with_records);
        result["data"][key].push_back({{"file", path.string()}, {"records", read.records}, {"skipped", read.skipped_lines}});
        records += "\n  [data] " + std::string(key) + ": " + path.string() + ": " + std::to_string(read.records) + " records" +
                   (read.skipped_lines > 0 ? ", " + std::to_string(read.skipped_lines) + " bad ones skipped (on_bad_line = \"skip\")" : "");
        if (train && c.eval_split > 0) train_records += held_out_count(c.eval_split, read.records);
      } catch (const UserError& e) {
        diagnostics.add(data.location_of(key), std::string("[data] ") + key + ": " + e.what());
      }
    }
  }
  if (c.eval_split > 0 && diagnostics.empty()) {
    // What split_off will refuse when the run starts: a split that leaves either side empty.
    for (const auto& file : result["data"]["train"]) {
      const std::size_t n = file["records"], held = held_out_count(c.eval_split, n);
      if (held == 0 || held >= n)
        diagnostics.add(data.location_of("eval_split"), "[data] eval_split holds out " + std::to_string(held) + " of the " + std::to_string(n) +
                                                             " records of " + file["file"].get<std::string>() + ", leaving " +
                                                             (held == 0 ? "no evaluation" : "nothing to train on"));
    }
    diagnostics.throw_if_any();
    result["data"]["held_out"] = train_records;
    records += "\n  [data] eval_split: " + std::to_string(train_records) + " of the training records held out";
  }
  diagnostics.throw_if_any();
  for (const auto& [section, plugin] : session.plugins) result["plugins"][section] = plugin->name;
}

int cmd_validate(const Command& cmd) {
  po::options_description options("validate options");
  add_pipeline_options(options);
  options.add_options()("json", po::bool_switch(),
                        "print {\"ok\", \"problems\": [{\"file\", \"line\", \"column\", \"message\"}], \"plugins\", \"data\"} (exit codes as without it)");
  if (wants_help(cmd, options, "validate PIPELINE [--json] [--set SECTION.KEY=VALUE]...")) return kExitOk;
  po::positional_options_description positional;
  positional.add("pipeline", 1);
  const auto vm = parse(cmd, options, positional);
  const fs::path file = vm["pipeline"].as<std::string>();
  nlohmann::json result = {{"pipeline", file.string()}, {"ok", true}, {"problems", nlohmann::json::array()}};
  std::string records;
  if (!vm["json"].as<bool>()) {
    validate_pipeline(file, overrides_of(vm), result, records);
    std::string parts;
    for (const auto& [section, plugin] : result["plugins"].items()) parts += (parts.empty() ? "" : ", ") + section + " '" + plugin.get<std::string>() + "'";
    std::cout << file.string() << ": ok (" << parts << ")" << records << "\n";
    return kExitOk;
  }
  // The problems as data: a pipeline's each at its place, any other refusal as one message.
  try {
    validate_pipeline(file, overrides_of(vm), result, records);
  } catch (const PipelineError& e) {
    result["ok"] = false;
    for (const auto& d : e.diagnostics())
      result["problems"].push_back({{"file", d.where.file}, {"line", d.where.line}, {"column", d.where.column}, {"message", d.message}});
  } catch (const std::exception& e) {  // any other refusal (a UserError), or a file the checks could not read
    result["ok"] = false;
    result["problems"].push_back({{"message", e.what()}});
  }
  std::cout << result.dump(2) << "\n";
  return result["ok"].get<bool>() ? kExitOk : kExitUser;
}

Inventory inventory_from(const po::variables_map& vm, GpuCapabilities& gpus) {
  if (vm.count("devices")) return parse_inventory(vm["devices"].as<std::string>(), &gpus);
  gpus = detect_gpu_capabilities();
  return detect_inventory();
}

// Where LoRA's settings fit nowhere, whether the same adapter over a 4-bit base would: the words
// that say so (and with which recomputation), or "" (not LoRA, or no fit either).
std::string fits_with_qlora(const po::variables_map& vm, PluginRegistry& registry, const GpuCapabilities& gpus, const Inventory& inventory,
                            const Mesh& mesh, int local_world, const Session& session) {
  if (!session.adapter || session.spec.section(kKindAdapter).plugin != "lora" || registry.find(kKindAdapter, "qlora") == nullptr) return "";
  try {
    auto overrides = overrides_of(vm);
    overrides.emplace_back("adapter.plugin=\"qlora\"");
    const Session quantized = open_session(load_pipeline(vm["pipeline"].as<std::string>(), overrides, registry, Purpose::kPlan), registry, &gpus);
    const MeshPlan::Fit fit = fit_limits(quantized, inventory, mesh, local_world);
    const std::string with = "; [adapter] plugin = \"qlora\" (the base in 4 bits) makes the settings fit";
    if (fit.longest >= fit.max_length) return with;
    if (fit.fits_with_recompute) return with + " with [train] activation_checkpointing = \"every-layer\"";
    if (fit.fits_with_offload) return with + " with [train] activation_checkpointing = \"offload\"";
  } catch (const UserError&) {
  }
  return "";
}

int cmd_plan(const Command& cmd) {
  po::options_description options("plan options");
  add_pipeline_options(options);
  options.add_options()("json", po::bool_switch(), "print the plan as JSON")(
      "freeze", po::bool_switch(), "print the plan as a manual [placement] section to pin it")(
      "devices", po::value<std::string>(),
      "simulated devices instead of this machine's, e.g. \"cuda:0=16GiB,cuda:1=16GiB,cpu=64GiB\"; a GPU's compute capability after @ "
      "(\"cuda:0=15GiB@7.5\": a T4) decides [run] dtype = \"auto\"")(
      "nproc-per-node", po::value<int>(), "plan for this many processes per host, as `loom run --nproc-per-node N` starts them");
  if (wants_help(cmd, options, "plan PIPELINE [--json | --freeze] [--devices LIST] [--nproc-per-node N] [--set SECTION.KEY=VALUE]...")) return kExitOk;
  po::positional_options_description positional;
  positional.add("pipeline", 1);
  const auto vm = parse(cmd, options, positional);
  GpuCapabilities gpus;
  const Inventory inventory = inventory_from(vm, gpus);  // a bad --devices is reported before any file is read
  auto registry = load_default_registry();
  Session session = open_session(load_pipeline(vm["pipeline"].as<std::string>(), overrides_of(vm), registry, Purpose::kPlan), registry, &gpus);
  // The processes: --nproc-per-node on one host, else what [parallel] asks for explicitly, and at
  // least one model replica's pipeline x tensor ranks.
  const int per_node = vm.count("nproc-per-node") ? vm["nproc-per-node"].as<int>() : 0;
  if (vm.count("nproc-per-node") && (per_node < 1 || per_node > 1024)) throw UserError("--nproc-per-node " + std::to_string(per_node) + ": use 1 to 1024");
  const int replica = session.config.parallel.replica();
  const int world = per_node > 0 ? per_node : std::max({1, requested_world(session.config), replica});
  const Mesh mesh = resolve_mesh(session.config, world);
  const int local_world = per_node > 0 ? per_node : world;
  MeshPlan mesh_plan;
  try {
    mesh_plan = make_mesh_plan(session, inventory, mesh, local_world, /*from_data=*/true);
  } catch (const UserError& e) {
    // What does fit with these settings, where anything does (a plan refused for another reason fits nothing).
    const MeshPlan::Fit fit = fit_limits(session, inventory, mesh, local_world);
    const std::string quantized = fit.fits_with_recompute || fit.fits_with_offload ? std::string() : fits_with_qlora(vm, registry, gpus, inventory, mesh, local_world, session);
    if (fit.longest == 0 && fit.most_rows == 0 && !fit.fits_with_recompute && !fit.fits_with_offload && quantized.empty()) throw;
    throw UserError(std::string(e.what()) + "; with these settings " + fit_text(fit) + quantized);
  }
  mesh_plan.fit = fit_limits(session, inventory, mesh, local_world);
  const Plan& plan = mesh_plan.plan();
  if (vm["freeze"].as<bool>()) {
    // The plan is written for the placement that takes a block -> device `map`, found by that option.
    const auto pinning = registry.declaring(kKindPlacement, "map", kStringMap);
    if (pinning.empty()) throw UserError("--freeze: no placement plugin takes a block -> device `map` option, so a plan cannot be pinned (see `loom plugins`)");
    const std::string pinned_by = pinning.front()->name;
    std::cout << freeze_plan(plan, pinned_by);
    // The plugins' versions too, as a line to put under [plugins]: a plan pinned across upgrades
    // should be made by the same plugins. A comment, so the output can be pasted as it is.
    std::string pins;
    for (const auto& kind : plugin_kinds()) {
      const auto it = session.spec.sections.find(kind);
      if (it == session.spec.sections.end() || it->second.plugin.empty()) continue;
      const std::string name = kind == kKindPlacement ? pinned_by : it->second.plugin;
      if (const LoadedPlugin* p = registry.find(kind, name)) pins += (pins.empty() ? "" : ", ") + ("\"" + kind + "/" + name + "\" = \"" + p->version + "\"");
    }
    std::cout << "# to pin the plugins as well, under [plugins]: versions = { " << pins << " }\n";
  }
  else if (vm["json"].as<bool>())
    std::cout << plan_json(mesh_plan).dump(2) << "\n";
  else
    std::cout << plan_text(mesh_plan);
  return kExitOk;
}

// `argv` without --nproc-per-node, started as `n` local workers (after the mesh is checked to fit).
int launch_without_nproc(const Session& session, int n, const std::vector<std::string>& argv) {
  if (rendezvous_from_env()) throw UserError("--nproc-per-node inside a launched process (RANK or SLURM_PROCID is set): launch with one or the other");
  resolve_mesh(session.config, n);  // the mesh must fit before any worker starts
  std::vector<std::string> args;
  for (std::size_t i = 0; i < argv.size(); ++i) {
    if (argv[i] == "--nproc-per-node") {
      ++i;
      continue;
    }
    if (argv[i].rfind("--nproc-per-node=", 0) == 0) continue;
    args.push_back(argv[i]);
  }
  return launch_local_workers(n, args);
}

int cmd_run(const Command& cmd, const std::vector<std::string>& argv, const std::optional<Rendezvous>& given) {
  po::options_description options("run options");
  add_pipeline_options(options);
  options.add_options()("output", po::value<std::string>(), "output folder (default: [run] output_dir)")(
      "resume", po::bool_switch(), "continue the run in the output folder")(
      "dry-run", po::bool_switch(), "validate, plan and write run.json, then stop before training")(
      "json", po::bool_switch(), "print the run's summary as JSON on stdout (the progress lines go to stderr)")(
      "nproc-per-node", po::value<int>(), "start this many worker processes on this host (one per GPU, or CPU processes), as torchrun would");

  if (wants_help(cmd, options, "run PIPELINE [--set SECTION.KEY=VALUE]... [--output DIR] [--resume] [--dry-run] [--json] [--nproc-per-node N]"))
    return kExitOk;
  po::positional_options_description positional;
  positional.add("pipeline", 1);
  const auto vm = parse(cmd, options, positional);
  auto overrides = overrides_of(vm);
  if (vm.count("output")) overrides.push_back("run.output_dir=" + nlohmann::json(vm["output"].as<std::string>()).dump());

  RunCommand run;
  run.pipeline = vm["pipeline"].as<std::string>();
  run.overrides = std::move(overrides);
  run.resume = vm["resume"].as<bool>();
  run.dry_run = vm["dry-run"].as<bool>();
  run.json = vm["json"].as<bool>();
  run.argv = argv;
  if (vm.count("nproc-per-node")) {
    auto registry = load_default_registry();
    Session session = open_session(load_pipeline(run.pipeline, run.overrides, registry, Purpose::kRun), registry);
    check_inputs(session);
    return launch_without_nproc(session, vm["nproc-per-node"].as<int>(), argv);
  }
  if (given) return run_rank(run, given);
  const auto rendezvous = rendezvous_from_env();
  // Ranks other than 0 say only what goes wrong; rank 0 speaks for the run.
  if (rendezvous && rendezvous->rank != 0 && spdlog::get_level() < spdlog::level::warn) spdlog::set_level(spdlog::level::warn);
  return run_rank(run, rendezvous);
}

// A pipeline's model set up on this rank to infer: its plan over this machine's devices (split over
// `rendezvous`'s ranks as [parallel] says), the base as the pipeline's adapter stores it (4-bit
// under qlora), `adapter` (a folder, or "") folded into its weights for good, and the runtime that
// runs its blocks, in evaluation mode (without `fold_adapter` the adapter is loaded beside the base).
struct InferenceModel {
  InferenceModel(Session& session, const std::optional<Rendezvous>& rendezvous, const std::string& adapter, const std::string& command,
                 bool fold_adapter = true)
      : mesh_plan(make_mesh_plan(session, detect_inventory(), rendezvous ? resolve_mesh(session.config, rendezvous->world) : Mesh{},
                                 rendezvous ? rendezvous->local_world : 1)),
        setup(set_up_rank(session, mesh_plan, rendezvous)) {
    share_cores(session, rendezvous ? rendezvous->local_world : 1);
    executor = load_executor(*session.model, setup.plan, mesh_plan.request().dtype, session.config.seed, false, setup.pipeline_rank,
                             setup.parallel.get(), session.adapter.get());
    if (setup.parallel->rank() == 0) log_compact_base(executor->model());
    if (!adapter.empty()) session.adapter->load(executor->model(), adapter_folder(adapter));
    if (!adapter.empty() && fold_adapter) {
      // Nothing trains the adapter after this: where evaluation would fold it (a float32 base, an
      // adapter a good share of the layer), it goes into the weights for good, with no copy.
      folded.emplace(executor->model(), FoldFor::kGood);
      spdlog::info("{}: the adapter folded into the weights of {} layer(s)", command, folded->layers());
    }
    // The rank's groups talk on its GPU under NCCL, else on the CPU.
    for (const auto& d : executor->devices())
      if (d.is_cuda()) {
        comm_device = d;
        break;
      }
    runtime = RankRuntime::for_plan(*executor, setup.plan, setup.pipeline_rank, setup.parallel->pipeline(), comm_device,
                                    session.structure.hidden_size, scalar_type(mesh_plan.request().dtype));
    executor->model().set_training(false);
  }
  const MeshPlan mesh_plan;
  RankSetup setup;
  std::unique_ptr<Executor> executor;
  std::optional<FoldedAdapters> folded;
  c10::Device comm_device{c10::kCPU};
  std::unique_ptr<RankRuntime> runtime;
};

// `loom generate --ids` prompts: decimal token ids separated by spaces or commas, each an id of the
// model's vocabulary; one error naming the prompt and the word otherwise.
std::vector<std::vector<std::int64_t>> token_id_prompts(const std::vector<std::string>& prompts, std::int64_t vocab_size) {
  std::vector<std::vector<std::int64_t>> out;
  const auto separator = [](char c) { return c == ' ' || c == ',' || c == '\t' || c == '\n'; };
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const std::string where = (prompts.size() == 1 ? std::string("--prompt") : "--prompt " + std::to_string(i + 1)) + " (--ids)";
    std::vector<std::int64_t>& list = out.emplace_back();
    const std::string& text = prompts[i];
    for (std::size_t at = 0; at < text.size();) {
      if (separator(text[at])) {
        ++at;
        continue;
      }
      std::size_t end = at;
      while (end < text.size() && !separator(text[end])) ++end;
      const std::string word = text.substr(at, end - at);
      std::int64_t id = 0;
      const auto [rest, error] = std::from_chars(word.data(), word.data() + word.size(), id);
      if (error != std::errc() || rest != word.data() + word.size() || id < 0)
        throw UserError(where + ": '" + kit::replace_invalid_utf8(word.substr(0, 40)) + "' is not a token id; give decimal ids separated by spaces or commas");
      if (id >= vocab_size) throw UserError(where + ": token id " + word + " is past the model's vocabulary of " + std::to_string(vocab_size) + " ids");
      list.push_back(id);
      at = end;
    }
    if (list.empty()) throw UserError(where + " holds no token ids; give decimal ids separated by spaces or commas");
  }
  return out;
}

// The special tokens the answers drew that their text leaves out (an end of sequence, say), a few
// of them, as "'</s>' (answers 1, 2)"; empty when the text shows every token drawn.
std::string special_tokens_left_out(const Tokenizer& tokenizer, const std::vector<Generated>& answers, bool templated) {
  if (templated) return "";  // a templated answer's text keeps its special tokens
  std::map<std::int64_t, std::vector<std::size_t>> left_out;
  std::map<std::int64_t, bool> special;  // each id asked once, however often the answers drew it
  const auto is_special = [&](std::int64_t id) {
    const auto [it, added] = special.emplace(id, false);
    if (added) it->second = tokenizer.decode({id}, true).empty() && !tokenizer.decode({id}, false).empty();
    return it->second;
  };
  for (std::size_t i = 0; i < answers.size(); ++i)
    for (const auto id : answers[i].ids)
      if (is_special(id)) {
        auto& where = left_out[id];
        if (where.empty() || where.back() != i + 1) where.push_back(i + 1);
      }
  std::string out;
  std::size_t named = 0;
  for (const auto& [id, where] : left_out) {
    if (named++ == 3) return out + ", ...";
    std::string list;
    for (const auto a : where) list += (list.empty() ? "" : ", ") + std::to_string(a);
    out += (out.empty() ? "'" : ", '") + kit::replace_invalid_utf8(tokenizer.decode({id}, false)) + "' (answer" + (where.size() > 1 ? "s " : " ") + list + ")";
  }
  return out;
}

int cmd_generate(const Command& cmd, const std::vector<std::string>& argv, const std::optional<Rendezvous>& given) {
  po::options_description options("generate options");
  add_pipeline_options(options);
  options.add_options()("prompt", po::value<std::vector<std::string>>()->required(), "text to continue (repeatable)")(
      "adapter", po::value<std::string>(), "adapter folder to apply (written by loom or PEFT)")(
      "max-new-tokens", po::value<std::int64_t>()->default_value(64), "longest continuation")(
      "temperature", po::value<double>()->default_value(0.0), "0: greedy; above 0: sample")(
      "top-p", po::value<double>()->default_value(1.0), "nucleus sampling threshold when sampling")(
      "top-k", po::value<std::int64_t>()->default_value(0), "when sampling, only the k likeliest tokens (0: all)")(
      "rows", po::value<std::int64_t>()->default_value(kDefaultGenerationRows), "prompts decoded together; more wait for a row that has ended")(
      "prompt-chunk", po::value<std::int64_t>()->default_value(GenerationSettings{}.prompt_chunk),
      "tokens a prompt pass takes at once: longer prompts pass in pieces, each attending to what the earlier ones cached, so a pass's "
      "memory stays bounded (0: a whole prompt at once)")(
      "eager", po::bool_switch(), "run each decode step op by op, not as a replayed CUDA graph (same tokens; for comparison)")(
      "ignore-eos", po::bool_switch(), "the end-of-sequence token ends no answer: each runs to --max-new-tokens (for benchmarks)")(
      "warmup", po::bool_switch(), "generate a few tokens from the same prompts first, untimed, so the timing line shows warm kernels (for benchmarks)")(
      "chat", po::bool_switch(), "each --prompt is a user message, rendered with the pipeline's chat template and a generation prompt; "
                                 "the answer (printed alone) ends with the assistant's turn")(
      "system", po::value<std::string>(), "with --chat: a system message before each prompt")(
      "json", po::bool_switch(), "print a JSON array of {\"prompt\", \"answer\", \"prompt_ids\", \"ids\"} instead of the texts (the prompt's "
                                 "ids as the model read them, the answer's as drawn)")(
      "ids", po::bool_switch(), "each --prompt is token ids (decimal, separated by spaces or commas), used as they are with no special "
                                "tokens added, and each answer prints as the ids drawn (with --json beside its text): a check of greedy "
                                "tokens needs no detokenizing")(
      "nproc-per-node", po::value<int>(), "start this many worker processes, for a model split by [parallel] pipeline or tensor");
  if (wants_help(cmd, options,
                 "generate PIPELINE --prompt TEXT [--chat [--system TEXT]] [--adapter DIR] [--max-new-tokens N] [--temperature T] [--top-p P] "
                 "[--top-k K] [--rows N] [--prompt-chunk N] [--eager] [--ignore-eos] [--warmup] [--json] [--ids] [--nproc-per-node N] "
                 "[--set SECTION.KEY=VALUE]..."))
    return kExitOk;
  po::positional_options_description positional;
  positional.add("pipeline", 1);
  const auto vm = parse(cmd, options, positional);
  GenerationSettings g;
  g.max_new_tokens = vm["max-new-tokens"].as<std::int64_t>();
  g.temperature = vm["temperature"].as<double>();
  g.top_p = vm["top-p"].as<double>();
  g.top_k = vm["top-k"].as<std::int64_t>();
  g.max_rows = vm["rows"].as<std::int64_t>();
  g.ignore_eos = vm["ignore-eos"].as<bool>();
  g.prompt_chunk = vm["prompt-chunk"].as<std::int64_t>();
  if (g.max_new_tokens < 1) throw UserError("--max-new-tokens must be at least 1");
  if (g.top_k < 0) throw UserError("--top-k must be 0 (all tokens) or more");
  if (g.max_rows < 1) throw UserError("--rows must be at least 1");
  if (g.prompt_chunk < 0) throw UserError("--prompt-chunk must be 0 (a whole prompt at once) or more");
  if (!(std::isfinite(g.temperature) && g.temperature >= 0)) throw UserError("--temperature must be a number from 0 (greedy) up");
  if (!(g.top_p > 0 && g.top_p <= 1)) throw UserError("--top-p must be in (0, 1]");
  auto registry = load_default_registry();
  Session session = open_session(load_pipeline(vm["pipeline"].as<std::string>(), overrides_of(vm), registry, Purpose::kPlan), registry);
  if (!session.tokenizer) throw UserError("generate needs a [tokenizer] section");
  check_machine(session);
  g.seed = session.config.seed;
  g.max_positions = session.structure.max_positions;
  require_adapter_section(vm, session);
  const bool chat = vm["chat"].as<bool>(), ids = vm["ids"].as<bool>();
  if (vm.count("system") && !chat) throw UserError("--system goes with --chat");
  if (ids && chat) throw UserError("--ids takes prompts as token ids and --chat renders text through a template: use one of them");
  std::vector<std::string> prompts = vm["prompt"].as<std::vector<std::string>>();
  const std::vector<std::vector<std::int64_t>> prompt_ids = ids ? token_id_prompts(prompts, session.structure.vocab_size) : std::vector<std::vector<std::int64_t>>{};
  const std::vector<std::string> user_prompts = prompts;  // as given (--chat renders `prompts` through the template)
  // Text from the command line reaches the tokenizer and, with --chat, the template's JSON context.
  const auto must_be_text = [](const std::string& text, const std::string& what) {
    if (const std::size_t bad = kit::invalid_utf8_at(text); bad != std::string_view::npos)
      throw UserError(what + ": byte " + std::to_string(bad) + " is not UTF-8; give the text in UTF-8");
  };
  if (!ids)
    for (std::size_t i = 0; i < prompts.size(); ++i) must_be_text(prompts[i], prompts.size() == 1 ? "--prompt" : "--prompt " + std::to_string(i + 1));
  if (vm.count("system")) must_be_text(vm["system"].as<std::string>(), "--system");
  if (chat) {
    // The template the data path uses: [data]'s chat template, the tokenizer's default otherwise.
    const ChatTemplate rendering = session.chat ? *session.chat
                                                : chat_template_for(*session.tokenizer, session.config.chat_template,
                                                                    session.config.chat_template_file, session.config.template_variables);
    for (auto& p : prompts) {
      Conversation c;
      if (vm.count("system")) c.messages.push_back({{"role", "system"}, {"content", vm["system"].as<std::string>()}});
      c.messages.push_back({{"role", "user"}, {"content", p}});
      const std::string prompt = rendering.render(c, true);
      if (g.stop_texts.empty())  // the template's end of an assistant turn, from a turn rendered with it
        if (std::string end = turn_end_marker(rendering, c); !end.empty()) g.stop_texts.push_back(std::move(end));
      p = prompt;
    }
    g.templated = true;
  }
  if (vm.count("nproc-per-node")) return launch_without_nproc(session, vm["nproc-per-node"].as<int>(), argv);
  // One process holds the whole model; launched processes split it as [parallel] says (every data
  // replica generates the same text; rank 0 prints it).
  InferenceModel model(session, given ? given : rendezvous_from_env(), vm.count("adapter") ? vm["adapter"].as<std::string>() : "", "generate");
  const MeshPlan& mesh_plan = model.mesh_plan;
  const RankSetup& setup = model.setup;
  const auto& runtime = model.runtime;
  g.cuda_graph = !vm["eager"].as<bool>() && runtime->graph_capturable(*setup.parallel);
  g.before_cache = [&](std::int64_t rows, std::int64_t capacity) {
    check_generation_cache(mesh_plan, setup.pipeline_rank, rows, capacity);
    return rows;
  };
  const NextLogits next = [&](const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& mask, CachedPass& pass) {
    return runtime->last_logits(ids, positions, mask, pass);
  };
  // The prompts as --ids gave them, or as text the tokenizer encodes.
  const auto complete = [&](const GenerationSettings& settings) {
    return ids ? generate_completions(next, *session.tokenizer, prompt_ids, settings) : generate_completions(next, *session.tokenizer, prompts, settings);
  };
  if (vm["warmup"].as<bool>()) {  // the first run of each kernel loads it and sets up its library's state
    GenerationSettings warm = g;
    warm.max_new_tokens = std::min<std::int64_t>(g.max_new_tokens, 17);  // past the first look, where a graph is captured
    complete(warm);
  }
  const auto answers = complete(g);
  if (setup.parallel->rank() != 0) return kExitOk;
  if (vm["json"].as<bool>()) {
    nlohmann::json out = nlohmann::json::array();
    // JSON holds only UTF-8: a byte the text form prints as it came (an untrained or byte-level
    // model samples any) is U+FFFD here, as Python's decode(errors="replace") gives it.
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      nlohmann::json answer = {{"answer", kit::replace_invalid_utf8(answers[i].text)}, {"prompt_ids", answers[i].prompt_ids}, {"ids", answers[i].ids}};
      if (!ids) answer["prompt"] = kit::replace_invalid_utf8(user_prompts[i]);
      out.push_back(std::move(answer));
    }
    std::cout << out.dump(2) << "\n";
    return kExitOk;
  }
  if (ids) {  // one line of ids an answer
    for (const auto& a : answers) {
      std::string line;
      for (const auto id : a.ids) line += (line.empty() ? "" : " ") + std::to_string(id);
      std::cout << line << "\n";
    }
    return kExitOk;
  }
  // Several answers are set apart by an empty line (an answer may hold lines of its own).
  for (std::size_t i = 0; i < prompts.size(); ++i) std::cout << (i > 0 ? "\n" : "") << (chat ? "" : prompts[i]) << answers[i].text << "\n";
  if (const std::string left_out = special_tokens_left_out(*session.tokenizer, answers, g.templated); !left_out.empty())
    std::cerr << "note: the text leaves out special tokens the answers drew: " << left_out << "; --ids prints every token\n";
  return kExitOk;
}

// The held-out loss, perplexity and greedy exact-match of the pipeline's model (and an adapter) on a
// data file, as a run's evaluation computes them, over every sample unless told otherwise.
int cmd_eval(const Command& cmd, const std::vector<std::string>& argv, const std::optional<Rendezvous>& given) {
  po::options_description options("eval options");
  add_pipeline_options(options);
  options.add_options()("data", po::value<std::string>(), "data file to evaluate on, in any of [data] train's forms (default: [data] eval, or the "
                                                          "records [data] eval_split holds out)")(
      "adapter", po::value<std::string>(), "adapter folder to apply (written by loom or PEFT; a run folder's adapter/)")(
      "samples", po::value<std::int64_t>()->default_value(0), "the first this many samples (0: all)")(
      "max-new-tokens", po::value<std::int64_t>(), "longest greedy answer for exact-match (default [train] max_new_tokens)")(
      "batch-size", po::value<std::int64_t>(), "samples a forward pass takes (default [train] batch_size)")(
      "json", po::bool_switch(), "print {\"file\", \"samples\", \"loss\", \"perplexity\", \"exact_match\", \"exact\", \"prompts\"}")(
      "nproc-per-node", po::value<int>(), "start this many worker processes, for a model split by [parallel] pipeline or tensor");
  if (wants_help(cmd, options,
                 "eval PIPELINE [--data FILE] [--adapter DIR] [--samples N] [--max-new-tokens N] [--batch-size N] [--json] [--nproc-per-node N] "
                 "[--set SECTION.KEY=VALUE]..."))
    return kExitOk;
  po::positional_options_description positional;
  positional.add("pipeline", 1);
  const auto vm = parse(cmd, options, positional);
  auto registry = load_default_registry();
  Session session = open_session(load_pipeline(vm["pipeline"].as<std::string>(), overrides_of(vm), registry, Purpose::kPlan), registry);
  if (!session.tokenizer) throw UserError("eval needs a [tokenizer] section");
  if (!session.collator)
    throw UserError("eval needs a [collator] section (or a chat [data] format): it says which tokens the loss counts and where an answer starts");
  require_adapter_section(vm, session);
  check_machine(session);
  RunConfig& c = session.config;
  EvalSettings settings{c.batch_size, vm["samples"].as<std::int64_t>(), c.max_new_tokens, c.collate, {}};
  if (vm.count("max-new-tokens")) settings.max_new_tokens = vm["max-new-tokens"].as<std::int64_t>();
  if (vm.count("batch-size")) settings.batch_size = vm["batch-size"].as<std::int64_t>();
  if (settings.max_samples < 0) throw UserError("--samples must be 0 (all) or more");
  if (settings.max_new_tokens < 1) throw UserError("--max-new-tokens must be at least 1");
  if (settings.batch_size < 1) throw UserError("--batch-size must be at least 1");
  Dataset data;
  if (vm.count("data")) {
    data = load_data(vm["data"].as<std::string>(), c.format, c.skip_bad_lines, static_cast<std::size_t>(-1), true, c.samples_with_records);
  } else if (c.eval_file) {
    data = load_data(*c.eval_file, c.format, c.skip_bad_lines, static_cast<std::size_t>(-1), true, c.samples_with_records);
  } else if (c.eval_split > 0 && c.train_file) {
    data = load_run_data(c).eval;
  } else {
    throw UserError("eval needs data: --data FILE, or [data] eval (or eval_split) in the pipeline");
  }
  if (vm.count("nproc-per-node")) return launch_without_nproc(session, vm["nproc-per-node"].as<int>(), argv);
  InferenceModel model(session, given ? given : rendezvous_from_env(), vm.count("adapter") ? vm["adapter"].as<std::string>() : "", "eval");
  settings.generation_rows = [&](std::int64_t rows, std::int64_t capacity) {
    return generation_rows_that_fit(model.mesh_plan, model.setup.pipeline_rank, rows, capacity);
  };
  Evaluator evaluator(*model.runtime, *session.collator, *session.tokenizer, *model.setup.parallel, model.comm_device, settings);
  const EvalResult e = evaluator.evaluate(data.samples);
  if (model.setup.parallel->rank() != 0) return kExitOk;
  const double perplexity = std::exp(e.loss);
  if (vm["json"].as<bool>()) {
    nlohmann::json out = {{"file", data.file}, {"samples", e.samples}, {"loss", e.loss}, {"perplexity", perplexity},
                          {"exact_match", e.prompts > 0 ? nlohmann::json(e.exact_match()) : nlohmann::json()}, {"exact", e.exact}, {"prompts", e.prompts}};
    if (data.skipped_lines > 0) out["skipped_lines"] = data.skipped_lines;
    std::cout << out.dump(2) << "\n";
    return kExitOk;
  }
  std::cout << data.file << ": " << e.samples << " samples, loss " << std::fixed << std::setprecision(4) << e.loss << ", perplexity "
            << std::setprecision(3) << perplexity;
  if (e.prompts > 0) std::cout << ", exact-match " << std::setprecision(1) << 100 * e.exact_match() << "% (" << e.exact << "/" << e.prompts << ")";
  std::cout << std::defaultfloat << std::setprecision(6) << "\n";
  return kExitOk;
}

// The model, an adapter merged into it, written as a Hugging Face folder (transformers loads it as a
// published one): shards, their index, config.json, generation_config.json, the tokenizer's files.
int cmd_export(const Command& cmd, const std::vector<std::string>& argv, const std::optional<Rendezvous>& given) {
  po::options_description options("export options");
  add_pipeline_options(options);
  options.add_options()("output", po::value<std::string>()->required(), "the folder to write (it must not exist)")(
      "adapter", po::value<std::string>(), "adapter folder to merge into the weights (written by loom or PEFT; a run folder's adapter/)")(
      "dtype", po::value<std::string>(), "fp32, bf16 or fp16: the weights' dtype in the folder (default [run] dtype)")(
      "max-shard-size", po::value<std::string>()->default_value("5GiB"), "the largest safetensors file, e.g. \"2GB\" (0: one file)")(
      "format", po::value<std::string>()->default_value("hf"), "hf (a Hugging Face folder) or gguf (one file for llama.cpp)")(
      "gguf-type", po::value<std::string>()->default_value("f16"), "gguf: the matrices' type: f32, f16, bf16 or q8_0 (norms stay f32)")(
      "json", po::bool_switch(), "print {\"output\", \"tensors\", \"shards\", \"bytes\", \"dtype\", \"files\"}")(
      "nproc-per-node", po::value<int>(), "start this many worker processes, for a model split by [parallel] pipeline or tensor");
  if (wants_help(cmd, options,
                 "export PIPELINE --output DIR|FILE [--adapter DIR] [--format hf|gguf] [--dtype fp32|bf16|fp16] [--max-shard-size SIZE] "
                 "[--gguf-type f32|f16|bf16|q8_0] [--json] [--nproc-per-node N] [--set SECTION.KEY=VALUE]..."))
    return kExitOk;
  po::positional_options_description positional;
  positional.add("pipeline", 1);
  const auto vm = parse(cmd, options, positional);
  HfExport to;
  to.output = fs::path(vm["output"].as<std::string>()).lexically_normal();
  if (to.output.filename().empty()) to.output = to.output.parent_path();
  if (vm.count("dtype")) {
    const std::string d = vm["dtype"].as<std::string>();
    if (d != "fp32" && d != "bf16" && d != "fp16") throw UserError("--dtype " + d + ": use fp32, bf16 or fp16");
    to.dtype = parse_dtype(d);
  }
  const std::string format = vm["format"].as<std::string>();
  if (format != "hf" && format != "gguf") throw UserError("--format " + format + ": use hf (a Hugging Face folder) or gguf (a file for llama.cpp)");
  GgufExport gguf;
  gguf.output = to.output;
  gguf.type = vm["gguf-type"].as<std::string>();
  check_gguf_type(gguf.type);  // before the model loads
  const std::string shard = vm["max-shard-size"].as<std::string>();
  to.max_shard_bytes = shard == "0" ? 0 : parse_bytes(shard);
  check_export_output(to.output, "--output");  // before anything loads
  auto registry = load_default_registry();
  Session session = open_session(load_pipeline(vm["pipeline"].as<std::string>(), overrides_of(vm), registry, Purpose::kPlan), registry);
  require_adapter_section(vm, session);
  check_machine(session);
  if (!to.dtype) to.dtype = session.config.dtype;
  to.model_folder = model_folder_of(session);
  to.tokenizer_folder = tokenizer_folder_of(session);
  if (vm.count("nproc-per-node")) return launch_without_nproc(session, vm["nproc-per-node"].as<int>(), argv);
  InferenceModel model(session, given ? given : rendezvous_from_env(), vm.count("adapter") ? vm["adapter"].as<std::string>() : "", "export",
                       /*fold_adapter=*/false);
  if (vm.count("adapter")) session.adapter->merge(model.executor->model());
  // Every rank writes its part as a run's outputs are written (gathered by rank 0), then rank 0
  // lays the folder out. The saved folder's name is this export's own (rank 0's draw, shared), so
  // two exports to one output never write into (or remove) each other's.
  std::uint64_t token = 0;
  if (model.setup.parallel->rank() == 0) token = std::random_device{}() & 0xFFFFFFFFFFull;
  token = static_cast<std::uint64_t>(sum_over(model.setup.parallel->world(), {static_cast<double>(token)}, model.comm_device)[0]);
  const fs::path saved = private_sibling(to.output, "saved", token + 1);
  ReplicaOutputs outputs(*model.setup.parallel, !model.setup.plan.schedule.empty(), model.comm_device);
  try {
    outputs.save_model(model.executor->model(), saved);
    model.setup.parallel->world().barrier();
  } catch (...) {
    if (model.setup.parallel->rank() == 0) kit::remove_tree(saved);  // a full disk leaves nothing behind
    throw;
  }
  if (model.setup.parallel->rank() != 0) return kExitOk;
  if (format == "gguf") {
    gguf.tokenizer_folder = to.tokenizer_folder;
    gguf.model_folder = to.model_folder;
    gguf.name = to.model_folder.empty() ? "loom export" : to.model_folder.filename().string();
    GgufExportResult written;
    try {
      written = write_gguf_export(saved, gguf);
    } catch (...) {
      kit::remove_tree(saved);
      throw;
    }
    kit::remove_tree(saved);
    for (const auto& note : written.notes) spdlog::warn("gguf: {}", note);
    if (!written.tokenizer)
      spdlog::warn("gguf: no tokenizer.json in {} : the file holds no vocabulary, which llama.cpp needs to load it ([tokenizer] path names one)",
                   to.tokenizer_folder.empty() ? std::string("the pipeline") : to.tokenizer_folder.string());
    if (vm["json"].as<bool>()) {
      std::cout << nlohmann::json{{"output", to.output.string()}, {"format", "gguf"}, {"architecture", written.architecture}, {"type", gguf.type},
                                  {"tensors", written.tensors}, {"bytes", written.bytes}, {"tokenizer", written.tokenizer}, {"notes", written.notes}}
                       .dump(2)
                << "\n";
      return kExitOk;
    }
    std::cout << "exported " << to.output.string() << ": GGUF, " << written.architecture << ", " << written.tensors << " tensors in " << gguf.type
              << ", " << format_bytes(written.bytes) << (written.tokenizer ? ", with its tokenizer" : ", without a tokenizer") << "\n";
    return kExitOk;
  }
  HfExportResult result;
  try {
    result = write_hf_export(saved, to);
  } catch (...) {
    kit::remove_tree(saved);
    throw;
  }
  kit::remove_tree(saved);
  if (vm["json"].as<bool>()) {
    std::cout << nlohmann::json{{"output", to.output.string()}, {"tensors", result.tensors}, {"shards", result.shards}, {"bytes", result.bytes},
                                {"dtype", dtype_name(*to.dtype)}, {"files", result.copied}}
                     .dump(2)
              << "\n";
    return kExitOk;
  }
  std::string files;
  for (const auto& f : result.copied) files += (files.empty() ? "" : ", ") + f;
  std::cout << "exported " << to.output.string() << ": " << result.tensors << " tensors, " << dtype_name(*to.dtype) << ", " << format_bytes(result.bytes)
            << " in " << result.shards << (result.shards == 1 ? " file" : " shards") << "; " << files << "\n";
  return kExitOk;
}

// One process, the whole model: for parity checks of a model family (and an adapter) against
// transformers on a model small enough to hold.
int cmd_logits(const Command& cmd) {
  po::options_description options("logits options");
  add_pipeline_options(options);
  options.add_options()("inputs", po::value<std::string>()->required(),
                        "JSON file of token ids: {\"input_ids\": [[...]], \"attention_mask\": [[...]], \"position_ids\": [[...]]} (the last two optional)")(
      "adapter", po::value<std::string>(), "adapter folder to apply (written by loom or PEFT)")(
      "output", po::value<std::string>(), "write the logits [rows, tokens, vocabulary] in fp32 to this safetensors file, as \"logits\"")(
      "compare", po::value<std::string>(), "a safetensors file whose \"logits\" the model's must match over the real (unmasked) tokens")(
      "tolerance", po::value<double>()->default_value(1e-4), "the largest difference --compare accepts");
  if (wants_help(cmd, options, "logits PIPELINE --inputs FILE [--adapter DIR] [--output FILE] [--compare FILE [--tolerance T]]")) return kExitOk;
  po::positional_options_description positional;
  positional.add("pipeline", 1);
  const auto vm = parse(cmd, options, positional);
  if (!vm.count("output") && !vm.count("compare")) throw UserError("logits needs --output FILE, --compare FILE or both");
  const double tolerance = vm["tolerance"].as<double>();
  if (!(tolerance >= 0)) throw UserError("--tolerance must be a number from 0 up");
  auto registry = load_default_registry();
  Session session = open_session(load_pipeline(vm["pipeline"].as<std::string>(), overrides_of(vm), registry, Purpose::kPlan), registry);
  check_machine(session);
  require_adapter_section(vm, session);
  const TokenInputs in = read_token_inputs(vm["inputs"].as<std::string>(), session.structure.vocab_size, session.structure.max_positions);
  const auto seed = session.config.seed;
  const MeshPlan mesh_plan = make_mesh_plan(session, detect_inventory(), Mesh{}, 1);
  RankSetup setup = set_up_rank(session, mesh_plan, std::nullopt);
  auto executor = load_executor(*session.model, setup.plan, mesh_plan.request().dtype, seed, false, 0, setup.parallel.get(), session.adapter.get());
  if (vm.count("adapter")) session.adapter->load(executor->model(), adapter_folder(vm["adapter"].as<std::string>()));
  executor->model().set_training(false);
  torch::NoGradGuard no_grad;
  const at::Tensor logits = executor->forward(in.ids, in.positions, in.mask).to(at::kCPU, at::kFloat);
  std::cout << "logits: " << logits.size(0) << " x " << logits.size(1) << " x " << logits.size(2) << "\n";
  if (vm.count("output")) {
    kit::write_safetensors(vm["output"].as<std::string>(), {{"logits", logits}}, {{"format", "pt"}});
    std::cout << "written: " << vm["output"].as<std::string>() << "\n";
  }
  if (!vm.count("compare")) return kExitOk;
  const std::string expected_path = vm["compare"].as<std::string>();
  const kit::SafetensorsFile expected_file(expected_path);
  if (expected_file.find("logits") == nullptr) throw UserError(expected_path + ": holds no tensor \"logits\"");
  const at::Tensor expected = expected_file.tensor("logits");
  if (expected.sizes() != logits.sizes())
    throw UserError(expected_path + ": logits of shape " + c10::str(expected.sizes()) + ", the model gives " + c10::str(logits.sizes()));
  const double difference = max_real_difference(logits, expected, in.mask);
  const bool same = difference <= tolerance;  // false for NaN too
  std::cout << "largest difference over " << in.mask.sum().item<std::int64_t>() << " real tokens: " << difference << (same ? " <= " : " > ")
            << tolerance << (same ? " (match)" : " (MISMATCH)") << "\n";
  return same ? kExitOk : kExitMismatch;
}

int cmd_tokenize(const Command& cmd) {
  po::options_description options("tokenize options");
  options.add_options()("tokenizer", po::value<std::string>()->required(), "a Hugging Face model folder or its tokenizer.json")(
      "plugin", po::value<std::string>(), "tokenizer plugin that reads PATH (default: the one tokenizer plugin with a `path` option)")(
      "file", po::value<std::string>(), "read inputs from this file, one per line (- for standard input)")(
      "text", po::value<std::string>(), "the input, when there is no --file")(
      "decode", po::bool_switch(), "inputs are JSON arrays of ids; print the text of each as a JSON string")(
      "no-special", po::bool_switch(), "leave out the tokenizer's special tokens (encode) / drop them (decode)")(
      "json-lines", po::bool_switch(), "each input line is a JSON string, so inputs may hold newlines")(
      "round-trip", po::bool_switch(), "print a JSON object per input: its ids with and without special tokens and the text each decodes to")(
      "stats", po::bool_switch(), "print the load time, lines, bytes, tokens and time spent in the tokenizer to stderr");
  if (wants_help(cmd, options, "tokenize --tokenizer PATH [--file F | TEXT] [--decode | --round-trip] [--no-special] [--json-lines] [--stats]")) return kExitOk;
  po::positional_options_description positional;
  positional.add("text", 1);
  const auto vm = parse(cmd, options, positional);
  if (vm.count("file") == vm.count("text")) throw UserError("tokenize takes either --file F or one TEXT argument");
  const auto registry = load_default_registry();
  std::string plugin_name;
  if (vm.count("plugin"))
    plugin_name = vm["plugin"].as<std::string>();
  else {
    const auto readers = registry.declaring(kKindTokenizer, "path", kString);
    std::string names;
    for (const auto* p : readers) names += (names.empty() ? "" : ", ") + p->name;
    if (readers.size() != 1)
      throw UserError(readers.empty() ? "no tokenizer plugin takes a `path` option, so none reads --tokenizer PATH (see `loom plugins`)"
                                      : "tokenizer plugins " + names + " all read a path: name one with --plugin");
    plugin_name = readers.front()->name;
  }
  const LoadedPlugin* plugin = registry.find(kKindTokenizer, plugin_name);
  if (!plugin)
    throw UserError("no tokenizer plugin named '" + plugin_name + "'" + did_you_mean(plugin_name, registry.names_of_kind(kKindTokenizer)) +
                    " (see `loom plugins`)");
  Options o;
  for (const auto& spec : plugin->schema)
    if (spec.default_value) o.set(spec.name, *spec.default_value);
  o.set("path", fs::absolute(vm["tokenizer"].as<std::string>()).lexically_normal().string());
  const auto load_start = std::chrono::steady_clock::now();
  const auto tokenizer = create_guarded<Tokenizer>(registry, *plugin, o);
  if (vm["stats"].as<bool>()) {
    char seconds[32];
    std::snprintf(seconds, sizeof seconds, "%.3f", std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count());
    std::cerr << "loom tokenize: " << plugin_name << " loaded " << vm["tokenizer"].as<std::string>() << " in " << seconds << " s\n";
  }
  TokenizeSettings settings;
  settings.decode = vm["decode"].as<bool>();
  settings.json_lines = vm["json-lines"].as<bool>();
  settings.specials = !vm["no-special"].as<bool>();
  settings.stats = vm["stats"].as<bool>();
  settings.round_trip = vm["round-trip"].as<bool>();
  if (settings.round_trip && (settings.decode || !settings.specials))
    throw UserError("--round-trip encodes with and without special tokens and decodes both; it takes neither --decode nor --no-special");
  if (vm.count("text")) {
    std::istringstream in(vm["text"].as<std::string>());
    tokenize_stream(*tokenizer, in, std::cout, settings, "TEXT", /*one_input=*/true);
  } else if (const auto file = vm["file"].as<std::string>(); file == "-") {
    tokenize_stream(*tokenizer, std::cin, std::cout, settings, "<stdin>");
  } else {
    ::close(kit::open_regular_file(file, "--file"));
    std::ifstream in(file, std::ios::binary);
    if (!in) throw UserError("cannot read --file " + file);
    tokenize_stream(*tokenizer, in, std::cout, settings, file);
  }
  return kExitOk;
}

const LoadedPlugin& find_plugin(const PluginRegistry& registry, const std::string& query) {
  // NAME, or KIND/NAME when two kinds share a name.
  const auto slash = query.find('/');
  std::vector<const LoadedPlugin*> matches;
  std::vector<std::string> all;
  for (const auto& p : registry.plugins()) {
    all.push_back(p.name);
    const bool hit = slash == std::string::npos ? p.name == query : (p.kind == query.substr(0, slash) && p.name == query.substr(slash + 1));
    if (hit) matches.push_back(&p);
  }
  if (matches.empty()) throw UserError("no plugin named '" + query + "'" + did_you_mean(query, all) + " (see `loom plugins`)");
  if (matches.size() > 1) {
    std::string kinds;
    for (const auto* m : matches) kinds += (kinds.empty() ? "" : ", ") + m->kind + "/" + m->name;
    throw UserError("'" + query + "' names several plugins (" + kinds + "); write KIND/NAME");
  }
  return *matches.front();
}

int cmd_report(const Command& cmd) {
  po::options_description options("report options");
  options.add_options()("run-dir", po::value<std::string>()->required(), "a folder `loom run` wrote (it holds run.json)")(
      "output", po::value<std::string>(), "where to write the page (default: RUN_DIR/report.html)");
  if (wants_help(cmd, options, "report RUN_DIR [--output FILE]")) return kExitOk;
  po::positional_options_description positional;
  positional.add("run-dir", 1);
  const auto vm = parse(cmd, options, positional);
  const fs::path written = write_run_page(vm["run-dir"].as<std::string>(), vm.count("output") ? fs::path(vm["output"].as<std::string>()) : fs::path());
  std::cout << "wrote " << written.string() << "\n";
  return kExitOk;
}

// "reads config.json model_type: llama, mistral (...)" for a model plugin that declares them.
std::string model_types_line(const LoadedPlugin& p) {
  if (p.model_types.empty()) return "";
  std::string types;
  for (const auto& t : p.model_types) types += (types.empty() ? "" : ", ") + t;
  return "reads config.json model_type: " + types + " (the plugin of a [model] section that names none, by its folder's config.json)\n";
}

int cmd_plugins(const Command& cmd) {
  po::options_description options("plugins options");
  options.add_options()("action", po::value<std::string>(), "describe | reference")("name", po::value<std::string>(), "plugin to describe")(
      "json", po::bool_switch(), "print JSON");
  if (wants_help(cmd, options, "plugins [--json] | plugins describe NAME [--json] | plugins reference")) return kExitOk;
  po::positional_options_description positional;
  positional.add("action", 1).add("name", 1);
  const auto vm = parse(cmd, options, positional);
  const bool json = vm["json"].as<bool>();
  const auto registry = load_default_registry();
  const std::string action = vm.count("action") ? vm["action"].as<std::string>() : "";
  int code = registry.refusals().empty() ? kExitOk : kExitUser;  // a refused library is a problem to fix
  if (action.empty()) {
    std::cout << (json ? plugins_json(registry).dump(2) + "\n" : plugins_text(registry));
    return code;
  }
  for (const auto& r : registry.refusals()) std::cerr << r.str() << "\n";
  if (action == "describe") {
    if (!vm.count("name")) throw UserError("plugins describe needs a plugin name (see `loom plugins`)");
    const auto& p = find_plugin(registry, vm["name"].as<std::string>());
    if (json) {
      std::cout << nlohmann::json{{"name", p.name},       {"kind", p.kind},           {"version", p.version},
                                  {"summary", p.summary}, {"file", p.file.string()}, {"model_types", p.model_types},
                                  {"options", schema_json(p.schema)}}.dump(2)
                << "\n";
    } else {
      std::cout << p.kind << " plugin '" << p.name << "' " << p.version << ": " << p.summary << "\n"
                << "file: " << p.file.string() << "\n"
                << "built against loom SDK " << p.sdk.major << "." << p.sdk.minor << ", LibTorch " << p.torch.str() << "\n"
                << model_types_line(p)
                << "\n"
                << "[" << p.kind << "]\nplugin = \"" << p.name << "\"\n\n"
                << schema_text(p.schema);
    }
    return code;
  }
  if (action == "reference") {
    std::cout << pipeline_reference_markdown(registry);
    return code;
  }
  throw UserError("unknown plugins action '" + action + "': use `loom plugins`, `loom plugins describe NAME` or `loom plugins reference`");
}

void setup_logging(const std::string& level) {
  // Commands run one after another or side by side in one process (the tests) share one logger.
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  auto logger = spdlog::get("loom");
  if (!logger) logger = spdlog::stderr_color_mt("loom");
  logger->set_pattern("%^[%l]%$ %v");
  spdlog::set_default_logger(logger);
  const auto parsed = spdlog::level::from_str(level);
  if (parsed == spdlog::level::off && level != "off")
    throw UserError("unknown --log-level '" + level + "': use trace, debug, info, warn, error or off");
  spdlog::set_level(parsed);
  // LibTorch's own log (c10d's "socket.cpp:...] The client socket has failed to connect" while a
  // rank waits for rank 0, then the same as an error line before the exception loom reports, with
  // glog's "Logging before InitGoogleLogging"): shown from warnings up only when loom's log is at
  // debug or below. Otherwise loom says what failed, once, in its own words.
  ::FLAGS_caffe2_log_level = parsed <= spdlog::level::debug ? 1 : 3;
}

constexpr const char* kOutOfMemoryAdvice =
    "The plan said this run fits (`loom plan` shows what it gave each device), so this is loom's miss, or another process took the "
    "memory: please report it with the command and its run.json. To go on now: lower [train] batch_size or [data] max_length, set "
    "[train] activation_checkpointing = \"every-layer\", or give the plan less of each GPU with [run] gpu_memory.\n";

// Runs `body` and returns its exit code; what it throws is printed to stderr as loom reports it
// (one line, or every pipeline problem) and becomes the matching exit code.
int exit_code_of(const std::function<int()>& body) {
  try {
    return body();
  } catch (const CommunicationError& e) {
    std::cerr << "loom: error: " << e.what() << "\n";
    return kExitPeerFailed;
  } catch (const PipelineError& e) {
    for (const auto& d : e.diagnostics()) std::cerr << d.str() << "\n";
    std::cerr << "loom: " << e.diagnostics().size() << (e.diagnostics().size() == 1 ? " problem" : " problems")
              << " found; nothing was run\n";
    return kExitUser;
  } catch (const UserError& e) {
    std::cerr << "loom: error: " << e.what() << "\n";
    return kExitUser;
  } catch (const po::error& e) {
    std::cerr << "loom: error: " << e.what() << " (see loom --help)\n";
    return kExitUser;
  } catch (const DeviceOutOfMemory& e) {
    std::cerr << "loom: error: " << e.what() << "\n" << kOutOfMemoryAdvice;
    return kExitInternal;
  } catch (const c10::OutOfMemoryError& e) {
    std::cerr << "loom: error: out of memory: " << e.what_without_backtrace() << "\n" << kOutOfMemoryAdvice;
    return kExitInternal;
  } catch (const PluginFault& e) {
    std::cerr << "loom: internal error: " << e.what() << "\n"
              << "This is a bug in that plugin, not a problem with your input; please report it to the plugin's authors with the command "
                 "and its run.json if any.\n";
    return kExitInternal;
  } catch (const std::exception& e) {
    std::cerr << "loom: internal error: " << e.what() << "\n"
              << "This is a bug in loom or a plugin; please report it with the command and its run.json if any.\n";
    return kExitInternal;
  }
}

}  // namespace

int run_cli(int argc, char** argv) { return run_cli(std::vector<std::string>(argv, argv + argc)); }

int run_cli(const std::vector<std::string>& all_args, const std::optional<Rendezvous>& rank) {
  const std::vector<std::string> args(all_args.begin() + std::min<std::size_t>(all_args.size(), 1), all_args.end());
  return exit_code_of([&] {
    po::options_description global("global options");
    global.add_options()("help,h", po::bool_switch(), "")("version", po::bool_switch(), "")(
        "log-level", po::value<std::string>()->default_value("info"), "")("command", po::value<std::string>(), "")(
        "args", po::value<std::vector<std::string>>(), "");
    po::positional_options_description positional;
    positional.add("command", 1).add("args", -1);
    const auto parsed = po::command_line_parser(args).options(global).positional(positional).allow_unregistered().run();
    po::variables_map vm;
    po::store(parsed, vm);
    setup_logging(vm["log-level"].as<std::string>());
    kit::capability_override();  // a malformed LOOM_DEVICE_CAPABILITY is one error, before anything runs

    if (vm["version"].as<bool>()) {
      std::cout << versions_text();
      return kExitOk;
    }
    if (!vm.count("command")) {
      (vm["help"].as<bool>() ? std::cout : std::cerr) << kUsage;
      return vm["help"].as<bool>() ? kExitOk : kExitUser;
    }
    Command cmd;
    cmd.name = vm["command"].as<std::string>();
    cmd.args = po::collect_unrecognized(parsed.options, po::include_positional);
    cmd.args.erase(cmd.args.begin());  // the command itself
    cmd.help = vm["help"].as<bool>();

    if (cmd.name == "validate") return cmd_validate(cmd);
    if (cmd.name == "plan") return cmd_plan(cmd);
    if (cmd.name == "run") return cmd_run(cmd, all_args, rank);
    if (cmd.name == "plugins") return cmd_plugins(cmd);
    if (cmd.name == "generate") return cmd_generate(cmd, all_args, rank);
    if (cmd.name == "eval") return cmd_eval(cmd, all_args, rank);
    if (cmd.name == "export") return cmd_export(cmd, all_args, rank);
    if (cmd.name == "tokenize") return cmd_tokenize(cmd);
    if (cmd.name == "logits") return cmd_logits(cmd);
    if (cmd.name == "report") return cmd_report(cmd);
    if (cmd.name == "help") {
      std::cout << kUsage;
      return kExitOk;
    }
    throw UserError("unknown command '" + cmd.name + "'" + did_you_mean(cmd.name, {"run", "validate", "plan", "plugins", "generate", "eval", "export", "logits", "tokenize", "report"}) +
                    " (see loom --help)");
  });
}

// LibTorch's CPU tensors come from malloc. glibc serves blocks above its mmap threshold with fresh
// mappings, and moves that threshold as blocks are freed, so how often a training step's
// activations fault in fresh zeroed pages depended on what the process happened to free first:
// the quickstart ran at 10k or 8.7k tokens/s by that history alone, and at 18k with the threshold
// fixed at glibc's largest (bench/RESULTS.md, "Host allocator"). Blocks up to 32 MiB are kept and
// reused; the top of the heap is returned once 256 MiB of it is free. A user's own malloc
// settings (GLIBC_TUNABLES or MALLOC_*_ variables) are left as they are.
void tune_host_allocator() {
  for (const char* name : {"GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"})
    if (std::getenv(name) != nullptr) return;
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
}


}  // namespace loom::core
