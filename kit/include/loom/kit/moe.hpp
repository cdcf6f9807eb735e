#pragma once
// What every mixture-of-experts family needs once: the router (softmax over its logits in fp32,
// top-k, renormalised where the family says), the experts as one stacked tensor per projection,
// run grouped by expert (each token's rows gathered once, one product per expert's group, the
// outputs weighted and scattered back), and transformers' load-balancing loss. Kit 3.3.
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "loom/export.hpp"
#include "loom/layers.hpp"
#include "loom/model.hpp"
#include "loom/kit/version.hpp"  // recorded in the descriptor of a plugin that uses the kit

namespace loom::kit {

struct RouterSettings {
  std::int64_t top_k = 2;
  bool normalize = true;            // the top-k probabilities rescaled to sum to 1 (norm_topk_prob)
  bool weights_in_hidden_dtype = false;  // rounded to the hidden dtype before weighting (Qwen3-MoE); Mixtral weights in fp32
};

struct Routing {
  at::Tensor logits;   // [N, E] in the hidden dtype: the load-balancing loss reads them
  at::Tensor weights;  // [N, k]: fp32, or the hidden dtype (weights_in_hidden_dtype)
  at::Tensor experts;  // [N, k] int64, each row's experts in order of probability
};

// Routes hidden [N, H] through router [E, H] as transformers' TopKRouter does.
LOOM_API Routing route(const at::Tensor& hidden, const at::Tensor& router, const RouterSettings& settings);

// DeepSeek-V3's router (its noaux_tc top-k), kit 3.8: sigmoid scores of hidden [N, H] through router
// [E, H] in fp32; experts chosen by score + correction_bias [E], from the `top_groups` best of
// `groups` equal groups (a group ranked by the sum of its two best biased scores; the others'
// scores set to 0, as transformers masks them, not to -inf); the weights are the chosen experts'
// unbiased scores, divided by their sum (+ 1e-20) where `normalize`, times `scale`
// (routed_scaling_factor). fp32 weights; logits [N, E] are the router's raw products.
struct GroupedSigmoidRouting {
  std::int64_t top_k = 8;
  std::int64_t groups = 1;      // n_group
  std::int64_t top_groups = 1;  // topk_group
  bool normalize = true;        // norm_topk_prob
  double scale = 1.0;           // routed_scaling_factor
};
LOOM_API Routing route_sigmoid_grouped(const at::Tensor& hidden, const at::Tensor& router, const at::Tensor& correction_bias,
                                       const GroupedSigmoidRouting& settings);
// gpt-oss's router, kit 3.8: logits = hidden router^T + bias ([E], undefined: none); each row's top_k
// logits, their softmax the weights (in the hidden dtype, as transformers computes it).
LOOM_API Routing route_top_k_softmax(const at::Tensor& hidden, const at::Tensor& router, const at::Tensor& bias, std::int64_t top_k);

// A low-rank delta on a stacked experts weight W [E, out, in], the SDK's (loom/model.hpp).
using ExpertsLowRank = ExpertsDelta;
// From PEFT's layout of a LoRA on a 3-D parameter (target_parameters; PEFT 0.20 on, transformers 5's
// [E, out, in] experts): lora_A [E * r, in], expert e's rows e*r .. e*r + r - 1; lora_B [out, E * r],
// expert e's columns e, E + e, 2E + e, ... (its rank-major reshape). And back.
LOOM_API ExpertsLowRank experts_low_rank_from_peft(const at::Tensor& lora_a, const at::Tensor& lora_b, std::int64_t experts, double scale);
LOOM_API std::pair<at::Tensor, at::Tensor> experts_low_rank_to_peft(const ExpertsLowRank& delta);

// A stacked experts weight [E, out, in] as the grouped products read it: a tensor, or a frozen
// LinearWeight holding it as the [E x out, in] matrix of the experts' rows one after another (a
// 4-bit one: BaseStoringAdapter's weight for a stacked experts weight). A stored one is
// dequantized (dense()) for each product and again for the backward's, never kept between (kit 3.5).
struct ExpertsMatrix {
  at::Tensor tensor;
  LinearWeight* stored = nullptr;
  std::int64_t experts = 0, out = 0, in = 0;
  ExpertsMatrix(const at::Tensor& t) : tensor(t), experts(t.size(0)), out(t.size(1)), in(t.size(2)) {}  // NOLINT: a tensor is one
  ExpertsMatrix(LinearWeight& weight, std::int64_t experts, std::int64_t out, std::int64_t in)
      : stored(&weight), experts(experts), out(out), in(in) {}
  at::Tensor values() const;     // [E, out, in]: the tensor, or a dense copy of the stored one
  at::ScalarType dtype() const;  // what values() holds
};

// How each expert's gate_up product becomes down's input (kit 4.1): transformers' SwiGLU of the
// gate rows then the up rows by default; gpt-oss interleaves them (gate 0, up 0, gate 1, ...) and
// clamps its SwiGLU (clamped_swiglu, blocks.hpp: gate at most `limit`, up within +-limit,
// gate * sigmoid(alpha * gate) * (up + 1)).
struct ExpertActivation {
  bool interleaved = false;  // gate and up rows alternate (a tensor rank's run of rows stays whole pairs)
  double limit = 0;          // > 0: clamped_swiglu with this limit and `alpha`
  double alpha = 1.702;
};

// The experts' SwiGLU MLPs on hidden [N, H]: gate_up [E, 2I, H] (each expert's gate rows, then its
// up rows, or as `activation` says), down [E, H, I], each product with its expert's bias where one
// is given (gate_up_bias [E, 2I], down_bias [E, H]: gpt-oss's; kit 4.1); each row's k experts'
// outputs times its routing weights, summed: [N, H]
// in hidden's dtype. Differentiable in hidden, the routing weights and both weights. The rows are
// sorted by expert once; on a GPU of compute capability 8.0 and up in bf16 (LibTorch 2.9 and
// later) every group is in one grouped GEMM for gate_up and one for down, with no host sync;
// otherwise each expert's group is one product pair.
// With `gate_up_delta` and `down_delta` (either may be empty), each product adds its low-rank delta
// inside the same grouping: two more grouped products of rank r each, differentiable in A and B.
LOOM_API at::Tensor grouped_experts(const at::Tensor& hidden, const Routing& routing, const ExpertsMatrix& gate_up, const ExpertsMatrix& down,
                                    const ExpertsLowRank& gate_up_delta = {}, const ExpertsLowRank& down_delta = {},
                                    const ExpertActivation& activation = {}, const at::Tensor& gate_up_bias = at::Tensor(),
                                    const at::Tensor& down_bias = at::Tensor());

// Whether grouped_experts runs a stacked experts weight [E, out, in] (with its adapter's delta, if
// any) in grouped GEMMs on its GPU, counting each expert's rows there with no host sync: a CUDA
// graph can then record a pass through it (one process; the exchange over an expert group reads
// its sizes on the host). An undefined weight (another rank's block) asks nothing.
LOOM_API bool experts_run_on_device(const at::Tensor& weight, const ExpertsDelta* delta);

// The same with the experts shared out over `group` (ExpertParallel::expert(), offering AllToAll):
// gate_up, down and the deltas hold this rank's E/N experts, rank r experts r*E/N onwards, while
// the routing picks among all E. Each pick's row travels to its expert's rank and its output back
// (all-to-all, differentiable both ways: the backward exchanges the gradients the same way). Every
// rank of the group calls it together, with the same graph, since its backward exchanges too.
LOOM_API at::Tensor grouped_experts(const at::Tensor& hidden, const Routing& routing, const ExpertsMatrix& gate_up, const ExpertsMatrix& down,
                                    const ExpertsLowRank& gate_up_delta, const ExpertsLowRank& down_delta, Communicator& group,
                                    const ExpertActivation& activation = {}, const at::Tensor& gate_up_bias = at::Tensor(),
                                    const at::Tensor& down_bias = at::Tensor());

// What the load-balancing loss reads of some layers' routers, over their real rows, in fp32: the
// top-k picks each expert got [E], each expert's routing probabilities summed [E] (with their
// graph), and the rows counted []. Layers' sums add, so a model carries them from layer to layer
// (kit 3.4).
struct RouterSums {
  at::Tensor picks, probabilities, rows;
  RouterSums operator+(const RouterSums& other) const;  // either may be empty (undefined tensors)
};
// One router's sums: logits [N, E], its picks `experts` [N, k] (Routing::experts), rows where
// `mask` [N] is 0 (padding) left out; an undefined mask counts every row.
LOOM_API RouterSums router_sums(const at::Tensor& logits, const at::Tensor& experts, const at::Tensor& mask = at::Tensor());
// transformers' load_balancing_loss_func from the sums of every MoE layer: E times the sum over
// experts of (the share of picks the expert got) x (its mean routing probability). fp32 scalar.
LOOM_API at::Tensor load_balancing_loss(const RouterSums& sums);
// The same from every MoE layer's router logits [N, E] (the same N rows each), each row's top_k
// taken from the softmax as transformers takes them.
LOOM_API at::Tensor load_balancing_loss(const std::vector<at::Tensor>& router_logits, std::int64_t num_experts, std::int64_t top_k,
                                        const at::Tensor& mask = at::Tensor());

}  // namespace loom::kit
