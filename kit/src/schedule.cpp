#include "loom/kit/schedule.hpp"

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <tuple>

#include "loom/error.hpp"

namespace loom::kit {

namespace {

bool is_compute(StageOp op) { return op == StageOp::kForward || op == StageOp::kBackward; }

// The compute actions of each rank, in the order the schedule runs them.
std::vector<std::vector<StageAction>> compute_orders(const std::string& kind, int ranks, int per_rank, int micro) {
  std::vector<std::vector<StageAction>> out(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    auto& list = out[static_cast<std::size_t>(r)];
    if (kind == "gpipe") {
      for (int m = 0; m < micro; ++m) list.push_back({StageOp::kForward, r, m});
      for (int m = 0; m < micro; ++m) list.push_back({StageOp::kBackward, r, m});
    } else if (kind == "1f1b") {
      const int warmup = std::min(ranks - 1 - r, micro);
      for (int m = 0; m < warmup; ++m) list.push_back({StageOp::kForward, r, m});
      for (int i = 0; i + warmup < micro; ++i) {
        list.push_back({StageOp::kForward, r, warmup + i});
        list.push_back({StageOp::kBackward, r, i});
      }
      for (int m = std::max(0, micro - warmup); m < micro; ++m) list.push_back({StageOp::kBackward, r, m});
    } else {  // interleaved-1f1b, as Megatron orders it
      const int units = micro * per_rank;
      const auto unit = [&](int k, bool forward) {
        const int chunk = (k / ranks) % per_rank;
        const int m = (k / (ranks * per_rank)) * ranks + k % ranks;
        const int c = forward ? chunk : per_rank - 1 - chunk;
        return StageAction{forward ? StageOp::kForward : StageOp::kBackward, c * ranks + r, m};
      };
      const int warmup = micro == ranks ? units : std::min(units, (ranks - r - 1) * 2 + (per_rank - 1) * ranks);
      for (int k = 0; k < warmup; ++k) list.push_back(unit(k, true));
      for (int i = 0; i + warmup < units; ++i) {
        list.push_back(unit(warmup + i, true));
        list.push_back(unit(i, false));
      }
      for (int k = std::max(0, units - warmup); k < units; ++k) list.push_back(unit(k, false));
    }
  }
  return out;
}

struct Progress {
  int stages, micro;
  std::vector<char> forward, backward;  // done, per (stage, micro-batch)
  Progress(int s, int m) : stages(s), micro(m), forward(static_cast<std::size_t>(s * m), 0), backward(static_cast<std::size_t>(s * m), 0) {}
  std::size_t at(int s, int m) const { return static_cast<std::size_t>(s * micro + m); }
  bool ready(const StageAction& a) const {
    if (a.op == StageOp::kForward) return a.stage == 0 || forward[at(a.stage - 1, a.micro_batch)];
    return forward[at(a.stage, a.micro_batch)] && (a.stage + 1 == stages || backward[at(a.stage + 1, a.micro_batch)]);
  }
  void done(const StageAction& a) { (a.op == StageOp::kForward ? forward : backward)[at(a.stage, a.micro_batch)] = 1; }
};

// Runs the compute actions of every rank in lock step (one action per rank per slot, using only
// what earlier slots finished). Calls `slot(rank, action or nullptr)` for every rank and slot.
// Throws std::logic_error when no rank can go on (the orders deadlock).
template <class Slot>
void lock_step(const std::vector<std::vector<StageAction>>& orders, int stages, int micro, Slot&& slot) {
  Progress p(stages, micro);
  std::vector<std::size_t> next(orders.size(), 0);
  for (;;) {
    std::vector<const StageAction*> now(orders.size(), nullptr);
    bool left = false;
    for (std::size_t r = 0; r < orders.size(); ++r) {
      if (next[r] >= orders[r].size()) continue;
      left = true;
      if (p.ready(orders[r][next[r]])) now[r] = &orders[r][next[r]];
    }
    if (!left) return;
    if (std::none_of(now.begin(), now.end(), [](const StageAction* a) { return a != nullptr; }))
      throw std::logic_error("pipeline schedule deadlocks: no rank can run its next action");
    for (std::size_t r = 0; r < orders.size(); ++r) {
      slot(static_cast<int>(r), now[r]);
      if (now[r]) {
        p.done(*now[r]);
        ++next[r];
      }
    }
  }
}

std::vector<std::vector<StageAction>> compute_only(const PipelineSchedule& s) {
  std::vector<std::vector<StageAction>> out;
  for (const auto& list : s.actions) {
    out.emplace_back();
    for (const auto& a : list)
      if (is_compute(a.op)) out.back().push_back(a);
  }
  return out;
}

}  // namespace

PipelineSchedule make_schedule(const std::string& kind, int ranks, int per_rank, int micro) {
  if (ranks < 1 || per_rank < 1 || micro < 1) throw UserError("a pipeline needs at least one rank, one stage per rank and one micro-batch");
  if (kind != "gpipe" && kind != "1f1b" && kind != "interleaved-1f1b")
    throw UserError("unknown pipeline schedule '" + kind + "' (gpipe, 1f1b, interleaved-1f1b)");
  // The lists grow with stages x micro-batches (and checking them with that times the ranks): a
  // bound keeps a careless [parallel] / grad_accum from a giant allocation or a long planning.
  constexpr long long kMaxPairs = 1 << 18;
  if (static_cast<long long>(ranks) * per_rank * micro > kMaxPairs)
    throw UserError("a schedule of " + std::to_string(ranks * per_rank) + " stages x " + std::to_string(micro) +
                    " micro-batches is too large to plan (at most " + std::to_string(kMaxPairs) +
                    " stage and micro-batch pairs); use fewer micro-batches per step ([train] grad_accum) or fewer stages");
  if (kind != "interleaved-1f1b" && per_rank != 1)
    throw UserError("schedule " + kind + " runs one stage per rank; use schedule = \"interleaved-1f1b\" for " + std::to_string(per_rank));
  if (kind == "interleaved-1f1b" && micro % ranks != 0)
    throw UserError("interleaved-1f1b takes micro-batches in groups of the " + std::to_string(ranks) + " pipeline ranks, and a step has " +
                    std::to_string(micro) + " ([train] grad_accum); use a multiple of " + std::to_string(ranks));
  PipelineSchedule s;
  s.name = kind;
  s.stages = ranks * per_rank;
  s.micro_batches = micro;
  for (int st = 0; st < s.stages; ++st) s.stage_rank.push_back(st % ranks);
  const auto orders = compute_orders(kind, ranks, per_rank, micro);
  s.actions.assign(static_cast<std::size_t>(ranks), {});
  // Each slot: the rank's compute, then its transfers of that slot peer by peer; between a pair
  // (lo, hi) the message lo -> hi goes before hi -> lo on both sides, so NCCL's in-order
  // point-to-point channels match. A receive is posted in the slot its data is sent.
  std::vector<const StageAction*> slot_actions(orders.size(), nullptr);
  struct Transfer {
    int peer, order;
    StageAction action;
  };
  std::vector<std::vector<Transfer>> transfers_of(static_cast<std::size_t>(ranks));
  const auto flush = [&] {
    // Messages of this slot: (from, to, sender's action, receiver's action).
    std::vector<std::tuple<int, int, StageAction, StageAction>> messages;
    for (int r = 0; r < ranks; ++r) {
      const StageAction* a = slot_actions[static_cast<std::size_t>(r)];
      if (!a) continue;
      s.actions[static_cast<std::size_t>(r)].push_back(*a);
      if (a->op == StageOp::kForward && a->stage + 1 < s.stages && s.stage_rank[static_cast<std::size_t>(a->stage + 1)] != r)
        messages.emplace_back(r, s.stage_rank[static_cast<std::size_t>(a->stage + 1)], StageAction{StageOp::kSendActivation, a->stage, a->micro_batch},
                              StageAction{StageOp::kRecvActivation, a->stage + 1, a->micro_batch});
      if (a->op == StageOp::kBackward && a->stage > 0 && s.stage_rank[static_cast<std::size_t>(a->stage - 1)] != r)
        messages.emplace_back(r, s.stage_rank[static_cast<std::size_t>(a->stage - 1)], StageAction{StageOp::kSendGradient, a->stage, a->micro_batch},
                              StageAction{StageOp::kRecvGradient, a->stage - 1, a->micro_batch});
    }
    // Each rank takes its sends and receives of the slot peer by peer, ascending; with one peer,
    // the message from the lower rank first. A rank sends at most one message a slot, so sorting
    // each rank's few by (peer, direction) gives that order.
    for (const auto& [from, to, send, recv] : messages) {
      const int lower_first = from < to ? 0 : 1;
      transfers_of[static_cast<std::size_t>(from)].push_back({to, lower_first, send});
      transfers_of[static_cast<std::size_t>(to)].push_back({from, lower_first, recv});
    }
    for (int r = 0; r < ranks; ++r) {
      auto& mine = transfers_of[static_cast<std::size_t>(r)];
      std::sort(mine.begin(), mine.end(), [](const Transfer& a, const Transfer& b) { return std::tie(a.peer, a.order) < std::tie(b.peer, b.order); });
      for (const auto& t : mine) s.actions[static_cast<std::size_t>(r)].push_back(t.action);
      mine.clear();
    }
    std::fill(slot_actions.begin(), slot_actions.end(), nullptr);
  };
  lock_step(orders, s.stages, micro, [&](int r, const StageAction* a) {
    slot_actions[static_cast<std::size_t>(r)] = a;
    if (r + 1 == ranks) flush();
  });
  return s;
}

std::string check_schedule(const PipelineSchedule& s) {
  if (s.empty()) return "";
  if (static_cast<int>(s.stage_rank.size()) != s.stages) return "stage_rank has " + std::to_string(s.stage_rank.size()) + " entries for " + std::to_string(s.stages) + " stages";
  const int ranks = static_cast<int>(s.actions.size());
  for (int st = 0; st < s.stages; ++st)
    if (s.stage_rank[static_cast<std::size_t>(st)] < 0 || s.stage_rank[static_cast<std::size_t>(st)] >= ranks)
      return "stage " + std::to_string(st) + " is on rank " + std::to_string(s.stage_rank[static_cast<std::size_t>(st)]) + " of " + std::to_string(ranks);
  std::map<std::tuple<int, int, int>, int> seen;  // (op, stage, micro-batch) -> rank
  // A transfer as both of its sides name it: (activation?, the stage that receives it, micro-batch,
  // sender); per (rank, peer), in the rank's order.
  using Message = std::tuple<bool, int, int, int>;
  std::map<std::pair<int, int>, std::vector<Message>> transfers;
  for (int r = 0; r < ranks; ++r)
    for (const auto& a : s.actions[static_cast<std::size_t>(r)]) {
      if (a.stage < 0 || a.stage >= s.stages || a.micro_batch < 0 || a.micro_batch >= s.micro_batches)
        return std::string(stage_op_name(a.op)) + " of stage " + std::to_string(a.stage) + ", micro-batch " + std::to_string(a.micro_batch) + " is out of range";
      const int home = s.stage_rank[static_cast<std::size_t>(a.stage)];
      if (home != r) return std::string(stage_op_name(a.op)) + " of stage " + std::to_string(a.stage) + " on rank " + std::to_string(r) + ", which does not run it";
      if (!seen.emplace(std::make_tuple(static_cast<int>(a.op), a.stage, a.micro_batch), r).second)
        return std::string(stage_op_name(a.op)) + " of stage " + std::to_string(a.stage) + ", micro-batch " + std::to_string(a.micro_batch) + " appears twice";
      if (is_compute(a.op)) continue;
      const bool activation = a.op == StageOp::kSendActivation || a.op == StageOp::kRecvActivation;
      const bool send = a.op == StageOp::kSendActivation || a.op == StageOp::kSendGradient;
      const int peer_stage = a.op == StageOp::kSendActivation || a.op == StageOp::kRecvGradient ? a.stage + 1 : a.stage - 1;
      if (peer_stage < 0 || peer_stage >= s.stages) return std::string(stage_op_name(a.op)) + " of stage " + std::to_string(a.stage) + " has no peer stage";
      const int peer = s.stage_rank[static_cast<std::size_t>(peer_stage)];
      if (peer == r) return std::string(stage_op_name(a.op)) + " of stage " + std::to_string(a.stage) + " between stages of one rank";
      transfers[{r, peer}].emplace_back(activation, send ? peer_stage : a.stage, a.micro_batch, send ? r : peer);
    }
  for (int st = 0; st < s.stages; ++st)
    for (int m = 0; m < s.micro_batches; ++m) {
      for (auto op : {StageOp::kForward, StageOp::kBackward})
        if (!seen.count({static_cast<int>(op), st, m}))
          return std::string(stage_op_name(op)) + " of stage " + std::to_string(st) + ", micro-batch " + std::to_string(m) + " is missing";
      const bool cross = st + 1 < s.stages && s.stage_rank[static_cast<std::size_t>(st)] != s.stage_rank[static_cast<std::size_t>(st + 1)];
      for (auto [op, stage] : {std::pair<StageOp, int>{StageOp::kSendActivation, st}, {StageOp::kRecvActivation, st + 1},
                               {StageOp::kSendGradient, st + 1}, {StageOp::kRecvGradient, st}})
        if (cross && !seen.count({static_cast<int>(op), stage, m}))
          return std::string(stage_op_name(op)) + " of stage " + std::to_string(stage) + ", micro-batch " + std::to_string(m) + " is missing";
    }
  // Between two ranks both sides list their transfers in the same order.
  for (const auto& [ends, list] : transfers) {
    const auto other = transfers.find({ends.second, ends.first});
    if (other == transfers.end() || other->second != list)
      return "ranks " + std::to_string(std::min(ends.first, ends.second)) + " and " + std::to_string(std::max(ends.first, ends.second)) +
             " list their transfers in different orders";
  }
  // Each rank runs its list in order; a compute waits for its inputs (sent by then, or computed
  // earlier on this rank); a send needs its compute done; posting a receive never waits.
  std::vector<std::size_t> next(static_cast<std::size_t>(ranks), 0);
  Progress p(s.stages, s.micro_batches);
  std::set<std::tuple<int, int, int>> sent;  // (activation?, receiving stage, micro-batch)
  for (bool moved = true; moved;) {
    moved = false;
    for (int r = 0; r < ranks; ++r) {
      auto& i = next[static_cast<std::size_t>(r)];
      while (i < s.actions[static_cast<std::size_t>(r)].size()) {
        const auto& a = s.actions[static_cast<std::size_t>(r)][i];
        bool ok = true;
        if (a.op == StageOp::kForward && a.stage > 0 && s.stage_rank[static_cast<std::size_t>(a.stage - 1)] != r)
          ok = sent.count({1, a.stage, a.micro_batch}) > 0;
        else if (a.op == StageOp::kBackward && a.stage + 1 < s.stages && s.stage_rank[static_cast<std::size_t>(a.stage + 1)] != r)
          ok = sent.count({0, a.stage, a.micro_batch}) > 0 && p.forward[p.at(a.stage, a.micro_batch)];
        else if (is_compute(a.op))
          ok = p.ready(a);
        else if (a.op == StageOp::kSendActivation)
          ok = p.forward[p.at(a.stage, a.micro_batch)];
        else if (a.op == StageOp::kSendGradient)
          ok = p.backward[p.at(a.stage, a.micro_batch)];
        if (!ok) break;
        if (is_compute(a.op)) p.done(a);
        if (a.op == StageOp::kSendActivation) sent.insert({1, a.stage + 1, a.micro_batch});
        if (a.op == StageOp::kSendGradient) sent.insert({0, a.stage - 1, a.micro_batch});
        ++i;
        moved = true;
      }
    }
  }
  for (int r = 0; r < ranks; ++r)
    if (next[static_cast<std::size_t>(r)] < s.actions[static_cast<std::size_t>(r)].size()) {
      const auto& a = s.actions[static_cast<std::size_t>(r)][next[static_cast<std::size_t>(r)]];
      return "the schedule deadlocks: rank " + std::to_string(r) + " waits forever at " + stage_op_name(a.op) + " of stage " + std::to_string(a.stage) +
             ", micro-batch " + std::to_string(a.micro_batch);
    }
  return "";
}

std::vector<int> in_flight_per_stage(const PipelineSchedule& s) {
  std::vector<int> now(static_cast<std::size_t>(s.stages), 0), peak(static_cast<std::size_t>(s.stages), 0);
  for (const auto& list : s.actions)
    for (const auto& a : list) {
      if (a.stage < 0 || a.stage >= s.stages) continue;
      auto& n = now[static_cast<std::size_t>(a.stage)];
      if (a.op == StageOp::kForward) peak[static_cast<std::size_t>(a.stage)] = std::max(peak[static_cast<std::size_t>(a.stage)], ++n);
      if (a.op == StageOp::kBackward) --n;
    }
  return peak;
}

std::string schedule_timeline(const PipelineSchedule& s) {
  if (s.empty()) return "";
  std::vector<std::string> lines(s.actions.size());
  std::size_t width = 2;
  const auto cell = [](const StageAction& a) {
    return std::string(a.op == StageOp::kForward ? "F" : "B") + std::to_string(a.stage) + "." + std::to_string(a.micro_batch);
  };
  for (const auto& list : s.actions)
    for (const auto& a : list)
      if (is_compute(a.op)) width = std::max(width, cell(a).size());
  try {
    lock_step(compute_only(s), s.stages, s.micro_batches, [&](int r, const StageAction* a) {
      std::string c = a ? cell(*a) : ".";
      c.resize(width + 1, ' ');
      lines[static_cast<std::size_t>(r)] += c;
    });
  } catch (const std::logic_error& e) {
    return std::string("(") + e.what() + ")\n";
  }
  std::ostringstream out;
  const std::size_t shown = 160 * (width + 1);  // slots printed; a longer step is cut with a note
  for (std::size_t r = 0; r < lines.size() && r < 64; ++r) {
    while (!lines[r].empty() && lines[r].back() == ' ') lines[r].pop_back();
    while (lines[r].size() >= 2 && lines[r].compare(lines[r].size() - 2, 2, " .") == 0) lines[r].resize(lines[r].size() - 2);
    out << "  rank " << r << ": " << (lines[r].size() > shown ? lines[r].substr(0, shown) + "... (" + std::to_string(lines[r].size() / (width + 1)) + " slots)" : lines[r])
        << "\n";
  }
  if (lines.size() > 64) out << "  ... (" << lines.size() - 64 << " more ranks)\n";
  return out.str();
}

}  // namespace loom::kit
