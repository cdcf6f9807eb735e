#pragma once
// Pipeline schedules as data: for each rank of a model replica, the list of what it does in one
// optimizer step (forward or backward of micro-batch m on stage s, and the sends and receives that
// move activations and their gradients between stages). A placement plugin makes the schedule
// (loom/kit/schedule.hpp has loom's); the host checks it and runs it with one runtime, whatever
// the schedule.
#include <string>
#include <vector>

#include "loom/export.hpp"

namespace loom {

enum class StageOp {
  kForward,         // run stage s on micro-batch m
  kBackward,        // backward of stage s for micro-batch m
  kRecvActivation,  // post the receive of stage s's input for m (from the rank of stage s - 1)
  kSendActivation,  // send stage s's output for m (to the rank of stage s + 1)
  kRecvGradient,    // post the receive of the gradient of stage s's output for m (from stage s + 1)
  kSendGradient,    // send the gradient of stage s's input for m (to the rank of stage s - 1)
};
LOOM_API const char* stage_op_name(StageOp op);

struct StageAction {
  StageOp op = StageOp::kForward;
  int stage = 0;
  int micro_batch = 0;
  bool operator==(const StageAction& o) const { return op == o.op && stage == o.stage && micro_batch == o.micro_batch; }
};

struct PipelineSchedule {
  std::string name;  // "gpipe", "1f1b", "interleaved-1f1b"; empty: no pipeline, blocks run in order
  int stages = 0;
  int micro_batches = 0;
  std::vector<int> stage_rank;                   // the replica rank of each stage
  std::vector<std::vector<StageAction>> actions;  // per replica rank, in order
  bool empty() const { return stages == 0; }
};

}  // namespace loom
