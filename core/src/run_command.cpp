#include "run_command.hpp"

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <ctime>
#include <iomanip>
#include <iostream>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "loom/atomic_file.hpp"
#include "loom/error.hpp"
#include "loom/json.hpp"
#include "plugin_registry.hpp"
#include "report.hpp"
#include "session.hpp"
#include "trainer.hpp"

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

nlohmann::json read_manifest(const fs::path& path) {
  auto manifest = json::read_file(path, 64u << 20, "run manifest");
  if (!manifest.is_object()) throw UserError(path.string() + ": not a run manifest (expected a JSON object)");
  return manifest;
}

// --resume continues only the run that started in the folder: the resolved pipeline must match.
void check_resumable(const fs::path& manifest_path, const nlohmann::json& resolved, const fs::path& out_dir) {
  const auto previous = read_manifest(manifest_path);
  if (previous.value("pipeline", nlohmann::json()) == resolved) return;
  std::string changed;
  const nlohmann::json before = previous.value("pipeline", nlohmann::json::object());
  const auto lookup = [&](const std::string& section, const std::string& key) {
    const auto s = before.find(section);
    if (s == before.end() || !s->is_object()) return nlohmann::json();
    const auto k = s->find(key);
    return k == s->end() ? nlohmann::json() : *k;
  };
  for (const auto& [section, values] : resolved.items())
    for (const auto& [key, value] : values.items())
      if (lookup(section, key) != value) changed += (changed.empty() ? "" : ", ") + section + "." + key;
  for (const auto& [section, values] : before.items())
    if (!resolved.contains(section)) changed += (changed.empty() ? "" : ", ") + section;
  throw UserError("--resume: the pipeline differs from the one that started " + out_dir.string() + (changed.empty() ? "" : " (changed: " + changed + ")") +
                  "; resume with the same pipeline or start a new run with --output");
}

void print_summary(const TrainReport& report, const fs::path& out_dir) {
  std::cout << "\ndone: " << report.steps << " steps, final training loss " << report.final_loss << "\n";
  if (report.exact_match)
    std::cout << "held-out exact-match: " << std::fixed << std::setprecision(1) << 100 * *report.exact_match << std::defaultfloat << std::setprecision(6)
              << "% of " << report.exact_match_samples << " samples\n";
  if (report.eval_loss) std::cout << "held-out loss: " << *report.eval_loss << "\n";
  if (report.skipped_samples > 0)
    std::cout << "skipped samples: " << report.skipped_samples << " (no response template, or too long for [data] max_length)\n";
  if (report.skipped_lines > 0) std::cout << "skipped data lines: " << report.skipped_lines << "\n";
  std::cout << "manifest:  " << (out_dir / "run.json").string() << "\nmetrics:   " << (out_dir / "metrics.jsonl").string() << "\n";
  if (!report.adapter_dir.empty()) std::cout << "adapter:   " << report.adapter_dir.string() << " (PEFT format)\n";
  if (!report.merged_dir.empty()) std::cout << "weights:   " << report.merged_dir.string() << " (HF format)\n";
}

}  // namespace

int run_rank(const RunCommand& command, const std::optional<Rendezvous>& rendezvous) {
  auto registry = load_default_registry();
  Session session = open_session(load_pipeline(command.pipeline, command.overrides, registry, Purpose::kRun), registry);
  check_inputs(session);
  const int world = rendezvous ? rendezvous->world : 1, rank = rendezvous ? rendezvous->rank : 0;
  const int local_world = rendezvous ? rendezvous->local_world : 1;
  const Mesh mesh = resolve_mesh(session.spec, world);
  const bool main_rank = rank == 0;
  const fs::path out_dir = session.spec.section("run").options.get_string("output_dir");
  const fs::path manifest_path = out_dir / "run.json";
  const nlohmann::json resolved = session.spec.resolved();

  std::error_code ec;
  const bool has_run = fs::exists(manifest_path, ec);
  if (command.resume) {
    if (!has_run) throw UserError("--resume: " + out_dir.string() + " holds no run to resume (no run.json)");
    check_resumable(manifest_path, resolved, out_dir);
  } else if (has_run) {
    throw UserError(out_dir.string() + " already holds a run (run.json); pass --resume to continue it or --output NEW_DIR to start another");
  }

  const Inventory inventory = detect_inventory();
  const MeshPlan mesh_plan = make_mesh_plan(session, inventory, mesh, local_world);
  spdlog::info("plan:\n{}", plan_text(mesh_plan));
  // Every rank has checked the folder before any writes to it: connecting waits for all.
  RankSetup setup = set_up_rank(session, mesh_plan, rendezvous);

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
                                   {"seed", session.spec.section("run").options.get_int("seed")},
                                   {"plan", plan_json(mesh_plan)}};
  const bool created_out_dir = !fs::exists(out_dir, ec);
  if (main_rank) {
    fs::create_directories(out_dir, ec);
    if (ec) throw UserError("cannot create output folder " + out_dir.string() + ": " + ec.message());
    write_file_atomically(manifest_path, manifest.dump(2) + "\n");
    spdlog::info("wrote {}", manifest_path.string());
  }
  if (command.dry_run) {
    if (main_rank) std::cout << "dry run: pipeline valid, plan and manifest written to " << manifest_path.string() << "\n";
    return 0;
  }
  share_cores(session, local_world);
  // A new run that fails before its first step leaves the folder as it found it, so the same
  // command can simply be run again once the problem is fixed.
  bool started = command.resume;
  TrainReport report;
  try {
    report = train(session, RankContext{&setup.plan, setup.pipeline_rank, setup.parallel.get()}, out_dir, command.resume, [&] { started = true; });
  } catch (...) {
    if (!started && main_rank) {
      for (const char* name : {"run.json", "metrics.jsonl", "checkpoints"}) remove_tree(out_dir / name);
      if (created_out_dir) fs::remove(out_dir, ec);  // only when empty
    }
    throw;
  }
  if (!main_rank) return report.stopped_by != 0 ? 128 + report.stopped_by : 0;
  if (report.stopped_by != 0) {
    std::cout << "\nstopped by " << (report.stopped_by == SIGINT ? "SIGINT" : "SIGTERM") << " after step " << report.steps
              << " with a checkpoint; continue with:\n  loom run " << command.pipeline.string() << " --output " << out_dir.string() << " --resume"
              << (std::getenv("LOOM_NPROC_PER_NODE") ? std::string(" --nproc-per-node ") + std::getenv("LOOM_NPROC_PER_NODE") : "") << "\n";
    return 128 + report.stopped_by;
  }
  print_summary(report, out_dir);
  return 0;
}

}  // namespace loom::core
