// Placement plugin `pipeline`: cuts the model's blocks into stages balanced by compute
// (flops_per_token), gives stage s to pipeline rank s % ranks, and makes the schedule (GPipe,
// 1F1B or interleaved 1F1B) the host runs. Memory counts the activations the schedule keeps in
// flight on each stage; a stage that does not fit is refused before any weight loads.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <map>

#include "loom/error.hpp"
#include "loom/kit/memory.hpp"
#include "loom/kit/schedule.hpp"
#include "loom/placement.hpp"
#include "loom/plugin.hpp"
#include "loom/schedule.hpp"

namespace loom::pipeline_placement {
namespace {

std::vector<OptionSpec> options() {
  return {
      OptionSpec::string("schedule", "1f1b",
                         "\"gpipe\" (every forward, then every backward: keeps all micro-batches' activations), \"1f1b\" (stage s keeps at "
                         "most ranks - s), \"interleaved-1f1b\" (several stages per rank: a smaller bubble)")
          .one_of({"gpipe", "1f1b", "interleaved-1f1b"}),
      OptionSpec::integer("stages", 0, "pipeline stages; 0: [parallel] pipeline x stages_per_rank (in one process: one per GPU)")
          .at_least(0)
          .at_most(1 << 12),
      OptionSpec::integer("stages_per_rank", 0, "stages each rank runs (interleaved-1f1b); 0: 2 for interleaved-1f1b, else 1")
          .at_least(0)
          .at_most(64),
      OptionSpec::string_list("cuts", StringList{},
                              "manual cut points: the blocks where stages 1, 2, ... begin, e.g. [\"layers.16\"]; empty: balanced by compute"),
      OptionSpec::string("device", "", "the device each rank runs its stages on, as the rank sees it (\"cuda:0\", \"cpu\"); empty: its first GPU, else the cpu"),
      OptionSpec::string("reserve", "1GiB", "headroom kept free on every GPU (CUDA context, allocator fragmentation, communication buffers)"),
  };
}

class PipelinePlacement final : public Placement {
 public:
  PipelinePlacement(std::string schedule, int stages, int per_rank, StringList cuts, std::string device, std::uint64_t reserve)
      : schedule_(std::move(schedule)), stages_(stages), per_rank_(per_rank), cuts_(std::move(cuts)), device_(std::move(device)), reserve_(reserve) {}

  Plan plan(const PlacementRequest& request) const override {
    const auto& blocks = request.model.blocks;
    const int ranks = static_cast<int>(request.ranks.size());
    Plan plan;
    plan.strategy = "pipeline/" + schedule_;
    // One process: the stages run in turn on its devices, as a device map; no schedule.
    const bool one_process = ranks == 1;
    int per_rank = per_rank_ > 0 ? per_rank_ : (schedule_ == "interleaved-1f1b" ? 2 : 1);
    int stages = stages_;
    std::vector<std::string> rank_device(static_cast<std::size_t>(ranks));
    for (int r = 0; r < ranks; ++r) rank_device[static_cast<std::size_t>(r)] = device_of(request.ranks[static_cast<std::size_t>(r)]);
    std::vector<std::string> one_process_devices;
    if (one_process) {
      for (const auto& d : request.ranks[0].devices)
        if (d.device != "cpu" && (device_.empty() || d.device == device_)) one_process_devices.push_back(d.device);
      if (one_process_devices.empty()) one_process_devices.push_back(rank_device[0]);
      if (stages == 0) stages = static_cast<int>(one_process_devices.size());
    } else {
      if (stages == 0) stages = ranks * per_rank;
      if (stages_ > 0 && per_rank_ == 0) per_rank = stages / ranks;
      if (stages != ranks * per_rank)
        throw UserError("stages = " + std::to_string(stages) + " on " + std::to_string(ranks) + " pipeline ranks: each rank runs the same number of stages, so use " +
                        std::to_string(ranks * per_rank) + " (ranks x stages_per_rank) or a multiple of " + std::to_string(ranks));
    }
    if (!cuts_.empty()) stages = static_cast<int>(cuts_.size()) + 1;
    if (!one_process && stages != ranks * per_rank)
      throw UserError("cuts makes " + std::to_string(stages) + " stages; " + std::to_string(ranks) + " pipeline ranks with stages_per_rank = " +
                      std::to_string(per_rank) + " need " + std::to_string(ranks * per_rank) + " (give " + std::to_string(ranks * per_rank - 1) + " cut points)");
    if (static_cast<std::size_t>(stages) > blocks.size())
      throw UserError(std::to_string(stages) + " stages for a model of " + std::to_string(blocks.size()) + " blocks; use at most " + std::to_string(blocks.size()));

    // The schedule does not depend on the cuts; what each stage keeps in flight bounds the cuts.
    std::vector<int> peaks(static_cast<std::size_t>(stages), 1);
    std::vector<std::uint64_t> room(static_cast<std::size_t>(stages), 0);  // 0: no bound
    if (!one_process) {
      plan.schedule = kit::make_schedule(schedule_, ranks, per_rank, static_cast<int>(request.micro_batches));
      peaks = kit::in_flight_per_stage(plan.schedule);
      for (int st = 0; st < stages; ++st) {
        const int rank = plan.schedule.stage_rank[static_cast<std::size_t>(st)];
        room[static_cast<std::size_t>(st)] =
            usable(request, {"", rank_device[static_cast<std::size_t>(rank)], rank, st}) / static_cast<std::uint64_t>(per_rank);
      }
    }
    const std::vector<std::size_t> first = cuts_.empty() ? balanced_cuts(request, peaks, room) : manual_cuts(request);
    std::vector<int> stage_of(blocks.size(), 0);
    for (std::size_t s = 0; s < first.size(); ++s)
      for (std::size_t i = first[s]; i < (s + 1 < first.size() ? first[s + 1] : blocks.size()); ++i) stage_of[i] = static_cast<int>(s);
    std::vector<std::int64_t> in_flight(blocks.size(), 0);
    if (!one_process)
      for (std::size_t i = 0; i < blocks.size(); ++i) in_flight[i] = peaks[static_cast<std::size_t>(stage_of[i])];
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      const int s = stage_of[i];
      const int rank = one_process ? 0 : plan.schedule.stage_rank[static_cast<std::size_t>(s)];
      const std::string device = one_process ? one_process_devices[static_cast<std::size_t>(s) * one_process_devices.size() / static_cast<std::size_t>(stages)]
                                             : rank_device[static_cast<std::size_t>(rank)];
      plan.blocks.push_back({blocks[i].name, device, rank, s});
    }
    // A tied group split over devices of one process would need two copies there: keep it whole.
    if (one_process)
      for (std::size_t i = 0; i < blocks.size(); ++i)
        for (std::size_t j = 0; j < i; ++j)
          if (!blocks[i].tied_group.empty() && blocks[i].tied_group == blocks[j].tied_group && plan.blocks[i].device != plan.blocks[j].device) {
            plan.notes.push_back(blocks[i].name + " shares its weights with " + blocks[j].name + ", so it runs on " + plan.blocks[j].device + " too");
            plan.blocks[i].device = plan.blocks[j].device;
          }
    plan.devices = kit::device_usage(request, plan.blocks, in_flight);
    check_memory(request, plan, stage_of, in_flight);
    describe(request, plan, stages, per_rank, first, one_process);
    return plan;
  }

 private:
  std::string device_of(const Inventory& inventory) const { return rank_device(inventory, device_); }

  std::uint64_t usable(const PlacementRequest& request, const BlockPlacement& b) const {
    const auto* cap = request.ranks.at(static_cast<std::size_t>(b.rank)).find(b.device);
    if (!cap) return 0;
    const std::uint64_t reserve = b.device == "cpu" ? 0 : reserve_;
    return cap->capacity_bytes > reserve ? cap->capacity_bytes - reserve : 0;
  }

  // The first block of each stage: the contiguous split whose largest stage compute (flops per
  // token; a block without matmuls counts one) is smallest while each stage's memory, with the
  // `in_flight` micro-batches its schedule keeps, stays within its `room` (0: unbounded). When no
  // split fits, the one balanced by compute alone (check_memory then says what does not fit).
  static std::vector<std::size_t> balanced_cuts(const PlacementRequest& request, const std::vector<int>& in_flight,
                                                const std::vector<std::uint64_t>& room) {
    const auto& blocks = request.model.blocks;
    const std::size_t stages = in_flight.size(), n = blocks.size();
    std::vector<std::uint64_t> cost;
    for (const auto& b : blocks) cost.push_back(std::max<std::uint64_t>(1, b.flops_per_token));
    // Greedy under a bound: each stage takes blocks while under it (and its room), leaving one
    // block for each later stage.
    const auto split = [&](std::uint64_t bound, bool memory, std::vector<std::size_t>* out) {
      std::size_t i = 0;
      for (std::size_t s = 0; s < stages; ++s) {
        if (i >= n) return false;
        if (out) out->push_back(i);
        const std::size_t keep = stages - s - 1;
        std::uint64_t load = 0, held = 0, working = 0;
        const auto fits = [&](std::size_t b) {
          if (!memory || room[s] == 0) return true;
          const kit::BlockMemory m = kit::block_memory(request, b, in_flight[s]);
          return held + m.weights + m.trainable_state + m.activations + std::max(working, m.working) <= room[s];
        };
        const auto take = [&](std::size_t b) {
          const kit::BlockMemory m = kit::block_memory(request, b, in_flight[s]);
          load += cost[b];
          held += m.weights + m.trainable_state + m.activations;
          working = std::max(working, m.working);
        };
        if (!fits(i)) return false;
        take(i++);
        while (i + keep < n && load + cost[i] <= bound && fits(i)) take(i++);
      }
      return i == n;
    };
    std::uint64_t total = 0;
    for (auto c : cost) total += c;
    const bool memory = split(total, true, nullptr);
    std::uint64_t lo = *std::max_element(cost.begin(), cost.end()), hi = total;
    while (lo < hi) {
      const std::uint64_t mid = lo + (hi - lo) / 2;
      if (split(mid, memory, nullptr)) hi = mid;
      else lo = mid + 1;
    }
    std::vector<std::size_t> first;
    split(hi, memory, &first);
    return first;
  }

  std::vector<std::size_t> manual_cuts(const PlacementRequest& request) const {
    const auto& blocks = request.model.blocks;
    std::vector<std::size_t> first{0};
    for (const auto& name : cuts_) {
      std::size_t at = blocks.size();
      for (std::size_t i = 0; i < blocks.size(); ++i)
        if (blocks[i].name == name) at = i;
      if (at == blocks.size()) {
        std::string hint = blocks.size() > 2 ? " (blocks: " + blocks.front().name + ", " + blocks[1].name + " .. " + blocks.back().name + ")" : "";
        throw UserError("cuts names '" + name + "', which is not a block of this model" + hint);
      }
      if (at <= first.back())
        throw UserError("cuts must name blocks in model order after the first block; '" + name + "' does not come after " + blocks[first.back()].name);
      first.push_back(at);
    }
    return first;
  }

  void check_memory(const PlacementRequest& request, const Plan& plan, const std::vector<int>& stage_of, const std::vector<std::int64_t>& in_flight) const {
    for (const auto& u : plan.devices) {
      std::size_t any = 0;
      while (any < plan.blocks.size() && !(plan.blocks[any].rank == u.rank && plan.blocks[any].device == u.device)) ++any;
      const std::uint64_t cap = usable(request, plan.blocks[any]);
      if (u.total() <= cap) continue;
      // Each run of one stage's blocks on this device, with what its schedule keeps in flight.
      const auto here = [&](std::size_t i) { return plan.blocks[i].rank == u.rank && plan.blocks[i].device == u.device; };
      std::string stages;
      for (std::size_t i = 0; i < plan.blocks.size(); ++i) {
        if (!here(i) || (i > 0 && here(i - 1) && stage_of[i - 1] == stage_of[i])) continue;
        std::size_t last = i;
        while (last + 1 < plan.blocks.size() && here(last + 1) && stage_of[last + 1] == stage_of[i]) ++last;
        stages += (stages.empty() ? "stage " : ", stage ") + std::to_string(stage_of[i]) + " (" + plan.blocks[i].block +
                  (last > i ? ".." + plan.blocks[last].block : "") + ", " + std::to_string(in_flight[i] > 0 ? in_flight[i] : 1) +
                  " micro-batch(es) in flight)";
      }
      std::string help = "fewer samples per micro-batch ([train] batch_size) with more micro-batches ([train] grad_accum)";
      if (schedule_ == "gpipe") help += ", schedule = \"1f1b\" (keeps at most ranks - s micro-batches in flight on stage s instead of all)";
      if (request.checkpoint_every != 1) help += ", [train] activation_checkpointing = \"every-layer\"";
      help += ", more pipeline ranks ([parallel] pipeline)";
      throw UserError(stages + " on rank " + std::to_string(u.rank) + " " + u.device + " needs " + format_bytes(u.total()) + " (weights " +
                      format_bytes(u.weights) + ", trainable state " + format_bytes(u.trainable_state) + ", activations " +
                      format_bytes(u.activations) + ", working " + format_bytes(u.working) + ") and " + u.device + " has " + format_bytes(cap) +
                      " usable; it would help to use " + help);
    }
  }

  void describe(const PlacementRequest& request, Plan& plan, int stages, int per_rank, const std::vector<std::size_t>& first, bool one_process) const {
    const auto& blocks = request.model.blocks;
    for (std::size_t s = 0; s < first.size(); ++s) {
      const std::size_t last = s + 1 < first.size() ? first[s + 1] - 1 : blocks.size() - 1;
      std::uint64_t flops = 0;
      for (std::size_t i = first[s]; i <= last; ++i) flops += blocks[i].flops_per_token;
      plan.notes.push_back("stage " + std::to_string(s) + ": " + blocks[first[s]].name + (last > first[s] ? ".." + blocks[last].name : "") + " on rank " +
                           std::to_string(plan.blocks[first[s]].rank) + " " + plan.blocks[first[s]].device + ", " + flop_text(flops) +
                           " per token");
    }
    if (one_process) {
      plan.notes.push_back("one process: the " + std::to_string(stages) +
                           " stage(s) run in turn on its devices; start [parallel] pipeline processes to run them at once");
      return;
    }
    const int ranks = static_cast<int>(request.ranks.size());
    const auto m = static_cast<double>(request.micro_batches);
    const double bubble = (ranks - 1) / (per_rank * m + ranks - 1);
    plan.notes.push_back(schedule_ + ": " + std::to_string(stages) + " stages on " + std::to_string(ranks) + " ranks, " +
                         std::to_string(request.micro_batches) + " micro-batches of " + std::to_string(request.batch_size) +
                         " per step ([train] grad_accum, batch_size); idle share at equal stage times about " +
                         std::to_string(static_cast<int>(std::lround(100 * bubble))) + "%");
    if (request.micro_batches < ranks)
      plan.notes.push_back("fewer micro-batches (" + std::to_string(request.micro_batches) + ") than pipeline ranks (" + std::to_string(ranks) +
                           "): some ranks idle most of each step; raise [train] grad_accum");
    for (std::size_t i = 0; i < blocks.size(); ++i)
      for (std::size_t j = 0; j < i; ++j)
        if (!blocks[i].tied_group.empty() && blocks[i].tied_group == blocks[j].tied_group && plan.blocks[i].rank != plan.blocks[j].rank)
          plan.notes.push_back(blocks[i].name + " shares its weights with " + blocks[j].name + ": rank " + std::to_string(plan.blocks[i].rank) +
                               " keeps a copy, their gradients summed after every step");
  }

  static std::string flop_text(std::uint64_t flops) {
    const char* units[] = {"FLOP", "KFLOP", "MFLOP", "GFLOP", "TFLOP"};
    double v = static_cast<double>(flops);
    std::size_t u = 0;
    while (v >= 1000 && u + 1 < std::size(units)) v /= 1000, ++u;
    char buf[32];
    std::snprintf(buf, sizeof buf, v < 10 ? "%.2f %s" : v < 100 ? "%.1f %s" : "%.0f %s", v, units[u]);
    return buf;
  }

  std::string schedule_;
  int stages_, per_rank_;
  StringList cuts_;
  std::string device_;
  std::uint64_t reserve_;
};

std::unique_ptr<Plugin> create(const Options& o) {
  return std::make_unique<PipelinePlacement>(o.get_string("schedule"), static_cast<int>(o.get_int("stages")), static_cast<int>(o.get_int("stages_per_rank")),
                                             o.get_string_list("cuts"), o.get_string("device").empty() ? "" : parse_device(o.get_string("device")).str(),
                                             parse_bytes(o.get_string("reserve")));
}

}  // namespace
}  // namespace loom::pipeline_placement

LOOM_PLUGIN(loom::kKindPlacement, "pipeline", "0.1.0", "pipeline stages over processes (GPipe, 1F1B, interleaved 1F1B), balanced by compute",
            loom::pipeline_placement::options, loom::pipeline_placement::create)
