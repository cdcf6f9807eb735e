#include "loom/schedule.hpp"

namespace loom {

const char* stage_op_name(StageOp op) {
  switch (op) {
    case StageOp::kForward: return "forward";
    case StageOp::kBackward: return "backward";
    case StageOp::kRecvActivation: return "recv-activation";
    case StageOp::kSendActivation: return "send-activation";
    case StageOp::kRecvGradient: return "recv-gradient";
    case StageOp::kSendGradient: return "send-gradient";
  }
  return "?";
}

}  // namespace loom
