#include "cli/run_command.hpp"

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <ctime>
#include <iomanip>
#include <iostream>
#include <set>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "loom/error.hpp"
#include "loom/kit/atomic_file.hpp"
#include "loom/kit/json.hpp"
#include "cli/run_page.hpp"
#include "runtime/metrics_sink.hpp"
#include "runtime/output_folder.hpp"
#include "plugins/plugin_registry.hpp"
#include "cli/report.hpp"
#include "planner/planner.hpp"
#include "planner/rank_setup.hpp"
#include "runtime/trainer.hpp"

namespace loom::core {
namespace fs = std::filesystem;
namespace {

std::string utc_now() {
  const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// What may differ on --resume: where the folder is (it is the one being resumed, wherever it was
// moved or however its path is spelled), how long a rank waits for the others or how many threads
// it computes with, how long the run goes on (the schedule then stretches to the new length from
// the resumed step) and how often it logs, evaluates, checkpoints and how many checkpoints it
// keeps; everything else changes what is trained.
bool may_change_on_resume(const std::string& section, const std::string& key) {
  // (eval_samples stays: the best checkpoint's metric was measured on those samples.)
  static const std::set<std::string> train = {"threads",          "max_steps",        "epochs",         "log_every", "eval_every",
                                              "checkpoint_every", "keep_checkpoints", "early_stopping_patience", "early_stopping_threshold"};
  return (section == "run" && (key == "output_dir" || key == "timeout")) || (section == "train" && train.count(key) > 0);
}

// --resume continues only the run that started in the folder: the resolved pipeline must match.
void check_resumable(const fs::path& manifest_path, const nlohmann::json& resolved, const fs::path& out_dir) {
  const auto previous = read_manifest(manifest_path);
  const nlohmann::json before = previous.value("pipeline", nlohmann::json::object());
  if (!before.is_object()) throw UserError(manifest_path.string() + ": its \"pipeline\" is not an object; this is not a run loom can resume");
  const auto lookup = [](const nlohmann::json& pipeline, const std::string& section, const std::string& key) {
    const auto s = pipeline.find(section);
    if (s == pipeline.end() || !s->is_object()) return nlohmann::json();
    const auto k = s->find(key);
    return k == s->end() ? nlohmann::json() : *k;
  };
  std::string changed;
  const auto note = [&](const std::string& what) { changed += (changed.empty() ? "" : ", ") + what; };
  for (const auto& [section, values] : resolved.items()) {
    if (!values.is_object()) continue;
    for (const auto& [key, value] : values.items())
      if (!may_change_on_resume(section, key) && lookup(before, section, key) != value) note(section + "." + key);
  }
  for (const auto& [section, values] : before.items()) {
    if (!resolved.contains(section)) {
      note(section);
      continue;
    }
    if (values.is_object())
      for (const auto& [key, value] : values.items())
        if (!may_change_on_resume(section, key) && !resolved[section].contains(key)) note(section + "." + key);
  }
  if (changed.empty()) return;
  throw UserError("--resume: the pipeline differs from the one that started " + out_dir.string() + " (changed: " + changed +
                  "); resume with the same pipeline or start a new run with --output");
}

// A word as a POSIX shell reads it back: as it is when that is safe, else in single quotes.
std::string shell_word(const std::string& word) {
  const bool plain = !word.empty() && word.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./=:,+@%") == std::string::npos;
  if (plain) return word;
  std::string out = "'";
  for (char c : word) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// The command that continues this run: its pipeline, every --set it was given, its folder.
std::string resume_command(const RunCommand& command, const fs::path& out_dir) {
  std::string line = "loom run " + shell_word(command.pipeline.string());
  for (const auto& o : command.overrides)
    if (o.rfind("run.output_dir=", 0) != 0) line += " --set " + shell_word(o);
  line += " --output " + shell_word(out_dir.string()) + " --resume";
  if (const char* n = std::getenv("LOOM_NPROC_PER_NODE")) line += std::string(" --nproc-per-node ") + shell_word(n);
  return line;
}

void print_summary(const TrainReport& report, const fs::path& out_dir) {
  std::cout << "\ndone: " << report.steps << " steps";
  if (report.final_loss_steps > 0)
    std::cout << ", training loss " << std::fixed << std::setprecision(4) << report.final_loss << std::defaultfloat << std::setprecision(6)
              << (report.final_loss_steps == 1 ? " (the last step)" : " (mean of the last " + std::to_string(report.final_loss_steps) + " steps)");
  std::cout << "\n";
  if (!report.stopped_early.empty()) std::cout << "stopped early: " << report.stopped_early << "\n";
  if (!report.best_checkpoint.empty()) std::cout << "best:      " << report.best_checkpoint.string() << " (its weights are the outputs)\n";
  if (report.exact_match)
    std::cout << "held-out exact-match: " << std::fixed << std::setprecision(1) << 100 * *report.exact_match << std::defaultfloat << std::setprecision(6)
              << "% of " << report.exact_match_samples << " samples\n";
  if (report.eval_loss) std::cout << "held-out loss: " << *report.eval_loss << "\n";
  if (report.skipped_samples > 0)
    std::cout << "skipped samples: " << report.skipped_samples << " (no response template, or too long for [data] max_length)\n";
  if (report.skipped_lines > 0) std::cout << "skipped data lines: " << report.skipped_lines << "\n";
  std::cout << "manifest:  " << (out_dir / "run.json").string() << "\nmetrics:   " << (out_dir / "metrics.jsonl").string()
            << "\nevents:    " << (out_dir / MetricsSink::kEventFile).string() << " (tensorboard --logdir " << shell_word(out_dir.string()) << ")\n";
  if (!report.adapter_dir.empty()) std::cout << "adapter:   " << report.adapter_dir.string() << " (PEFT format)\n";
  if (!report.merged_dir.empty()) std::cout << "weights:   " << report.merged_dir.string() << " (HF format)\n";
}

void print_summary_json(const TrainReport& report, const fs::path& out_dir, const std::string& resume) {
  const auto optional = [](const auto& v) { return v ? nlohmann::json(*v) : nlohmann::json(); };
  const auto path = [](const fs::path& p) { return p.empty() ? nlohmann::json() : nlohmann::json(p.string()); };
  nlohmann::json out = {{"steps", report.steps},
                        {"training_loss", report.final_loss_steps > 0 ? nlohmann::json(report.final_loss) : nlohmann::json()},
                        {"training_loss_steps", report.final_loss_steps},
                        {"eval_loss", optional(report.eval_loss)},
                        {"exact_match", report.exact_match_samples > 0 ? optional(report.exact_match) : nlohmann::json()},
                        {"exact_match_samples", report.exact_match_samples},
                        {"skipped_samples", report.skipped_samples},
                        {"skipped_lines", report.skipped_lines},
                        {"output_dir", out_dir.string()},
                        {"manifest", (out_dir / "run.json").string()},
                        {"metrics", (out_dir / "metrics.jsonl").string()},
                        {"adapter", path(report.adapter_dir)},
                        {"model", path(report.merged_dir)},
                        {"best_checkpoint", path(report.best_checkpoint)},
                        {"stopped_early", report.stopped_early.empty() ? nlohmann::json() : nlohmann::json(report.stopped_early)},
                        {"stopped_by", report.stopped_by == 0 ? nlohmann::json() : nlohmann::json(report.stopped_by == SIGINT ? "SIGINT" : "SIGTERM")},
                        {"resume_command", resume.empty() ? nlohmann::json() : nlohmann::json(resume)},
                        {"eval_failure", report.eval_failure.empty() ? nlohmann::json() : nlohmann::json(report.eval_failure)}};
  std::cout << out.dump(2) << std::endl;
}

// The run's page, written at its end; a page that cannot be written costs the run nothing it made.
void print_page(const fs::path& out_dir) {
  try {
    std::cout << "report:    " << write_run_page(out_dir).string() << " (loom report " << shell_word(out_dir.string()) << " writes it again)\n";
  } catch (const UserError& e) {
    spdlog::warn("the run's page was not written: {}", e.what());
  }
}

}  // namespace

nlohmann::json read_manifest(const fs::path& path) {
  auto manifest = kit::json::read_file(path, 64u << 20, "run manifest");
  if (!manifest.is_object()) throw UserError(path.string() + ": not a run manifest (expected a JSON object)");
  return manifest;
}

int run_rank(const RunCommand& command, const std::optional<Rendezvous>& rendezvous) {
  // --json: stdout holds the summary alone; the progress lines go to stderr until then.
  std::streambuf* const stdout_buffer = std::cout.rdbuf();
  struct RestoreStdout {
    std::streambuf* buffer;
    ~RestoreStdout() { std::cout.rdbuf(buffer); }
  } restore{stdout_buffer};
  if (command.json) std::cout.rdbuf(std::cerr.rdbuf());
  auto registry = load_default_registry();
  Session session = open_session(load_pipeline(command.pipeline, command.overrides, registry, Purpose::kRun), registry);
  check_inputs(session);
  const int world = rendezvous ? rendezvous->world : 1, rank = rendezvous ? rendezvous->rank : 0;
  const int local_world = rendezvous ? rendezvous->local_world : 1;
  const Mesh mesh = resolve_mesh(session.config, world);
  const bool main_rank = rank == 0;
  const fs::path out_dir = session.config.output_dir;
  const fs::path manifest_path = out_dir / "run.json";
  const nlohmann::json resolved = session.spec.resolved();

  OutputFolder::check(out_dir, command.resume);
  if (command.resume) check_resumable(manifest_path, resolved, out_dir);

  const Inventory inventory = detect_inventory();
  const MeshPlan mesh_plan = make_mesh_plan(session, inventory, mesh, local_world, /*from_data=*/true);
  spdlog::info("plan:\n{}", plan_text(mesh_plan));
  // Rank 0 holds the folder (its lock) from here to the end of the run; every rank has checked it
  // before rank 0 writes to it (connecting waits for all). A new run that fails before its first
  // step leaves the folder as it found it, so the same command can be run again once the problem
  // is fixed; a resume has nothing of its own to take back.
  std::optional<OutputFolder> folder;
  if (main_rank) folder.emplace(out_dir, command.resume);
  bool started = command.resume;
  const auto discard_unless_started = [&] {
    if (!started && folder) folder->discard_new_run();
  };
  RankSetup setup = [&] {
    try {
      return set_up_rank(session, mesh_plan, rendezvous);
    } catch (...) {
      discard_unless_started();
      throw;
    }
  }();

  nlohmann::json plugins = nlohmann::json::object();
  for (const auto& [section, p] : session.plugins)
    plugins[section] = {{"name", p->name},
                        {"version", p->version},
                        {"sdk", std::to_string(p->sdk.major) + "." + std::to_string(p->sdk.minor)},
                        {"torch", p->torch.str()},
                        {"file", fs::absolute(p->file).string()}};
  const nlohmann::json manifest = {{"loom_manifest", 1},
                                   {"created", utc_now()},
                                   {"command", command.argv},
                                   {"pipeline_file", fs::absolute(session.spec.file).string()},
                                   {"pipeline", resolved},
                                   {"versions", versions_json()},
                                   {"plugins", plugins},
                                   {"devices", inventory_json(inventory)},
                                   {"seed", session.config.seed},
                                   {"plan", plan_json(mesh_plan)}};
  // A resume's run.json is rewritten once the checkpoint has been taken up, so a refused --resume
  // leaves the run as it was.
  const auto write_manifest = [&] {
    kit::write_file_atomically(manifest_path, manifest.dump(2) + "\n");
    spdlog::info("wrote {}", manifest_path.string());
  };
  if (main_rank && !command.resume) write_manifest();
  if (command.dry_run) {
    if (main_rank && command.json) {
      std::cout.rdbuf(stdout_buffer);
      std::cout << nlohmann::json{{"dry_run", true}, {"output_dir", out_dir.string()}, {"manifest", manifest_path.string()}, {"resume", command.resume}}.dump(2)
                << std::endl;
      return 0;
    }
    if (main_rank)
      std::cout << "dry run: pipeline valid, plan " << (command.resume ? "checked against " + manifest_path.string() + ", which is left as it was"
                                                                      : "and manifest written to " + manifest_path.string()) << "\n";
    return 0;
  }
  share_cores(session, local_world);
  TrainReport report;
  try {
    const auto generation_rows = [&](std::int64_t rows, std::int64_t capacity) {
      return generation_rows_that_fit(mesh_plan, setup.pipeline_rank, rows, capacity);
    };
    report = train(session, RankContext{&setup.plan, setup.pipeline_rank, setup.parallel.get(), generation_rows}, out_dir, command.resume, [&] {
      started = true;
      if (main_rank && command.resume) write_manifest();
    });
  } catch (...) {
    discard_unless_started();
    throw;
  }
  if (!main_rank) return report.stopped_by != 0 ? 128 + report.stopped_by : report.eval_failure.empty() ? 0 : 2;
  if (command.json) {
    print_page(out_dir);
    std::cout.rdbuf(stdout_buffer);
    print_summary_json(report, out_dir, report.stopped_by != 0 ? resume_command(command, out_dir) : std::string());
    return report.stopped_by != 0 ? 128 + report.stopped_by : report.eval_failure.empty() ? 0 : 2;
  }
  if (report.stopped_by != 0) {
    std::cout << "\nstopped by " << (report.stopped_by == SIGINT ? "SIGINT" : "SIGTERM") << " after step " << report.steps
              << " with a checkpoint; continue with:\n  " << resume_command(command, out_dir) << "\n";
    print_page(out_dir);
    return 128 + report.stopped_by;
  }
  print_summary(report, out_dir);
  print_page(out_dir);
  if (!report.eval_failure.empty()) {
    std::cerr << "error: the final evaluation failed: " << report.eval_failure << "\n(training finished and its outputs are written in "
              << out_dir.string() << ")\n";
    return 2;  // the user's data or template is at fault, as every other refusal
  }
  return 0;
}

}  // namespace loom::core
