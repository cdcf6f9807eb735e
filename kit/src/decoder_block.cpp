// A decoder layer written as code: the builder its weights register through, the norm piece and
// attention over a pass's cache (decoder_block.hpp).
#include "loom/kit/decoder_block.hpp"

#include <ATen/ATen.h>

#include "loom/kit/tensor_parallel.hpp"
#include "loom/layers.hpp"

namespace loom::kit {

DecoderBlock::~DecoderBlock() = default;

at::Tensor Norm::operator()(const at::Tensor& x) const { return weight.defined() ? rms_norm_as(form, x, weight, eps, bias) : x; }

BlockBuilder::BlockBuilder(const DecoderFamily& family, const DecoderConfig& config, std::size_t layer, at::TensorOptions options,
                           Communicator* tensor_group, BaseWeight base_weight, Communicator* expert_group)
    : family_(family),
      config_(config),
      layer_(layer),
      prefix_(family.names.layers + std::to_string(layer) + "."),
      options_(options),
      tensor_group_(tensor_group != nullptr && tensor_group->size() > 1 ? tensor_group : nullptr),
      base_weight_(std::move(base_weight)),
      expert_group_(expert_group != nullptr && expert_group->size() > 1 ? expert_group : nullptr) {}

std::shared_ptr<Experts> BlockBuilder::experts(const ExpertActivation& activation, bool biases) {
  if (experts_) throw std::logic_error(prefix_ + ": a layer of two mixtures of experts");
  const MoeConfig& m = config_.moe;
  // Each expert's hidden units split over the tensor group as a dense MLP's are; under expert
  // parallelism each rank holds its run of the experts.
  const std::int64_t here = m.num_experts / (expert_group_ ? expert_group_->size() : 1);
  const std::int64_t units = m.expert_intermediate_size / (tensor_group_ ? tensor_group_->size() : 1);
  // An adapter that stores the base its own way (4-bit) stores the experts too, each stacked
  // weight as the matrix of its experts' rows.
  std::shared_ptr<LinearWeight> gate_up, down;
  const std::string stacked = prefix_ + family_.names.experts;
  if (base_weight_ && options_.device().type() != c10::DeviceType::Meta) {
    gate_up = base_weight_(LinearInfo{stacked + ".gate_up_proj", config_.hidden_size, here * 2 * units, ParallelStyle::kReplicated}, options_);
    down = base_weight_(LinearInfo{stacked + ".down_proj", units, here * config_.hidden_size, ParallelStyle::kReplicated}, options_);
  }
  experts_ = std::make_shared<Experts>(config_, RouterSettings{m.top_k, m.normalize, family_.moe.weights_in_hidden_dtype}, here, units, options_,
                                       std::move(gate_up), std::move(down), tensor_group_, expert_group_, activation, biases);
  return experts_;
}

Experts::Experts(const DecoderConfig& config, const RouterSettings& routing, std::int64_t experts_here, std::int64_t units, const at::TensorOptions& o,
                 std::shared_ptr<LinearWeight> stored_gate_up, std::shared_ptr<LinearWeight> stored_down, Communicator* tensor_group,
                 Communicator* expert_group, const ExpertActivation& activation, bool biases)
    : routing_(routing), tp_(tensor_group), ep_(expert_group), activation_(activation) {
  router = register_parameter("router", at::empty({config.moe.num_experts, config.hidden_size}, o));
  if (stored_gate_up) stored_gate_up_ = register_module("gate_up_stored", std::move(stored_gate_up));
  if (stored_down) stored_down_ = register_module("down_stored", std::move(stored_down));
  const auto stacked_tensor = [&](const char* name, const std::shared_ptr<LinearWeight>& stored, std::vector<std::int64_t> shape) {
    return stored ? at::zeros({1, 1, 1}, o).expand(shape) : register_parameter(name, at::empty(shape, o));
  };
  gate_up_ = stacked_tensor("gate_up", stored_gate_up_, {experts_here, 2 * units, config.hidden_size});
  down_ = stacked_tensor("down", stored_down_, {experts_here, config.hidden_size, units});
  if (biases) {
    gate_up_bias_ = register_parameter("gate_up_bias", at::zeros({experts_here, 2 * units}, o));
    down_bias_ = register_parameter("down_bias", at::zeros({experts_here, config.hidden_size}, o));
  }
}

ExpertsMatrix Experts::matrix(bool down) const {
  const at::Tensor& t = stacked(down);
  return stored(down) ? ExpertsMatrix(*(down ? stored_down_ : stored_gate_up_), t.size(0), t.size(1), t.size(2)) : ExpertsMatrix(t);
}

at::Tensor Experts::stacked_values(bool down) {
  if (!stored(down)) return stacked(down);
  at::Tensor& staging = down ? staging_down_ : staging_gate_up_;
  if (!staging.defined()) staging = at::empty(stacked(down).sizes(), router.options());
  return staging;
}

void Experts::finish_stacked(bool down, const at::Tensor& values) {
  if (!stored(down)) return;
  at::Tensor& staging = down ? staging_down_ : staging_gate_up_;
  const at::Tensor v = values.defined() ? values : staging;
  (down ? stored_down_ : stored_gate_up_)->assign("weight", v.reshape({-1, v.size(2)}));
  staging = at::Tensor();
}

// Under tensor parallelism each rank runs its part of every expert's units: the routing weights'
// and the input's gradients, partial on each rank, are summed over the group, the outputs too.
at::Tensor Experts::forward(const at::Tensor& m, const LayerPass& pass) const {
  const at::Tensor flat = m.reshape({-1, m.size(-1)});
  Routing routing = route_with ? route_with(flat, router) : route(flat, router, routing_);
  if (pass.router_sums != nullptr) *pass.router_sums = *pass.router_sums + router_sums(routing.logits, routing.experts, pass.token_mask);
  const ExpertsMatrix gate_up = matrix(false), down = matrix(true);
  if (ep_ != nullptr)
    return grouped_experts(flat, routing, gate_up, down, gate_up_delta, down_delta, *ep_, activation_, gate_up_bias_, down_bias_).view(m.sizes());
  if (tp_ == nullptr) return grouped_experts(flat, routing, gate_up, down, gate_up_delta, down_delta, activation_, gate_up_bias_, down_bias_).view(m.sizes());
  const at::Tensor whole_weights = routing.weights;  // for down's bias, which every rank adds alike
  routing.weights = copy_to_tensor_region(routing.weights, tp_);
  const at::Tensor out = grouped_experts(copy_to_tensor_region(flat, tp_), routing, gate_up, down, gate_up_delta, down_delta, activation_, gate_up_bias_);
  const at::Tensor summed = reduce_from_tensor_region(out, tp_);
  if (!down_bias_.defined()) return summed.view(m.sizes());
  // down's bias once, after the ranks' parts are summed: each row's picks' biases, weighted.
  const at::Tensor picked = down_bias_.index_select(0, routing.experts.reshape({-1})).view({flat.size(0), routing.experts.size(1), -1});
  return (summed + (picked * whole_weights.unsqueeze(-1)).sum(1).to(summed.scalar_type())).view(m.sizes());
}

std::shared_ptr<AdaptableLinear> BlockBuilder::linear(const std::string& name, std::int64_t in, std::int64_t out, bool bias, ParallelStyle style,
                                                      const std::vector<std::int64_t>& pieces) {
  const TensorShard shard{style, tensor_group_};
  // The adapter's weight (a 4-bit base) for this rank's part, split as a dense one would be.
  const bool column = style == ParallelStyle::kColumn;
  const std::int64_t in_part = shard.split() && !column ? part_length(in, shard) : in;
  const std::int64_t out_part = shard.split() && column ? part_length(out, shard, pieces) : out;
  std::shared_ptr<AdaptableLinear> made;
  if (base_weight_ && options_.device().type() != c10::DeviceType::Meta)
    if (auto base = base_weight_(LinearInfo{prefix_ + name, in_part, out_part, style}, options_)) {
      if (shard.split()) base = std::make_shared<SplitWeight>(std::move(base), shard, pieces);
      made = std::make_shared<AdaptableLinear>(std::move(base), in, out, bias ? at::zeros({out_part}, options_) : at::Tensor());
    }
  if (!made) made = make_linear(in, out, bias, options_, shard, pieces);
  linears_.emplace_back(name, made);
  declared_.push_back({name, in, out, style});
  return made;
}

at::Tensor BlockBuilder::weight(const std::string& name, const std::vector<std::int64_t>& shape, float init, ParallelStyle style) {
  if (shape.empty()) throw std::logic_error(prefix_ + name + ": a weight of no dimensions");
  const bool split = style == ParallelStyle::kColumn && tensor_group_ != nullptr;
  std::vector<std::int64_t> here = shape;
  if (split) here[0] = part_length(shape[0], TensorShard{style, tensor_group_});
  at::Tensor t = at::full(here, init, options_);
  t.set_requires_grad(true);
  const auto row = name.find("{}.");
  if (row == std::string::npos && name.find("{}") != std::string::npos)
    throw std::logic_error(prefix_ + name + ": a row's index \"{}\" must stand before a \".\"");
  if (row != std::string::npos) weights_.push_back({name.substr(0, row) + name.substr(row + 3), name, t, init, split, shape});
  else weights_.push_back({name, "", t, init, split, shape});
  return t;
}

Norm BlockBuilder::norm(const std::string& name, NormForm form, const std::vector<std::int64_t>& shape, ParallelStyle style) {
  const std::vector<std::int64_t> n = shape.empty() ? std::vector<std::int64_t>{config_.hidden_size} : shape;
  Norm out{form, weight(name + ".weight", n, norm_identity(form), style), at::Tensor(), config_.rms_norm_eps};
  if (norm_has_bias(form)) out.bias = weight(name + ".bias", n, 0.0f, style);
  return out;
}

GroupedQueryAttention grouped_query_attention(BlockBuilder& b, const std::string& prefix, bool qkv_bias, bool o_bias) {
  const DecoderConfig& c = b.config();
  const std::int64_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  GroupedQueryAttention a;
  a.q = b.linear(prefix + "q_proj", c.hidden_size, q, qkv_bias, ParallelStyle::kColumn);
  a.k = b.linear(prefix + "k_proj", c.hidden_size, kv, qkv_bias, ParallelStyle::kColumn);
  a.v = b.linear(prefix + "v_proj", c.hidden_size, kv, qkv_bias, ParallelStyle::kColumn);
  a.o = b.linear(prefix + "o_proj", q, c.hidden_size, o_bias, ParallelStyle::kRow);
  a.head_dim = c.head_dim;
  return a;
}

GroupedQueryAttention::Heads GroupedQueryAttention::project(const at::Tensor& h) const {
  const auto heads = [&](const std::shared_ptr<AdaptableLinear>& proj) { return proj->forward(h).view({h.size(0), h.size(1), -1, head_dim}); };
  return {heads(q), heads(k), heads(v)};
}

at::Tensor GroupedQueryAttention::operator()(const at::Tensor& h, const LayerPass& pass, const AttendOptions& options) const {
  const Heads x = project(h);
  return o->forward(attend(pass, x.q, x.k, x.v, options));
}

bool any_trains(std::initializer_list<AdaptableLinear*> linears) {
  for (auto* l : linears)
    if (l != nullptr)
      for (const auto& p : l->parameters())
        if (p.requires_grad()) return true;
  return false;
}

at::Tensor Mlp::operator()(const at::Tensor& h) const {
  const auto rows = [this](const at::Tensor& x) {
    if (!gate) return down->forward(activate(activation, up->forward(x)));
    const at::Tensor g = gate->forward(x), u = up->forward(x);
    return down->forward(activation == Activation::kSilu ? swiglu(g, u) : geglu(g, u, activation == Activation::kGeluTanh));
  };
  return mlp_over_row_chunks(h, up->out_features, {gate.get(), up.get(), down.get()}, rows);
}

namespace {

// An MLP of linears `gate` ("": none), `up` and `down`, registered in that order, of `units`
// hidden units (0: intermediate_size).
Mlp mlp(BlockBuilder& b, const std::string& gate, const std::string& up, const std::string& down, bool bias, std::int64_t units = 0) {
  const DecoderConfig& c = b.config();
  const std::int64_t width = units > 0 ? units : c.intermediate_size;
  Mlp m;
  if (!gate.empty()) m.gate = b.linear(gate, c.hidden_size, width, bias, ParallelStyle::kColumn);
  m.up = b.linear(up, c.hidden_size, width, bias, ParallelStyle::kColumn);
  m.down = b.linear(down, width, c.hidden_size, bias, ParallelStyle::kRow);
  m.activation = c.activation;
  return m;
}

}  // namespace

Mlp gated_mlp(BlockBuilder& b, const std::string& prefix, bool bias, std::int64_t units) {
  return mlp(b, prefix + "gate_proj", prefix + "up_proj", prefix + "down_proj", bias, units);
}

at::Tensor shared_by_heads(const at::Tensor& x, Communicator* tensor_group) { return copy_to_tensor_region(x, tensor_group); }
at::Tensor shared_by_heads(const at::Tensor& x, const LayerPass& pass) { return shared_by_heads(x, pass.tensor_group); }
Mlp plain_mlp(BlockBuilder& b, const std::string& up, const std::string& down, bool bias) { return mlp(b, "", up, down, bias); }

at::Tensor activate(Activation activation, const at::Tensor& x) {
  switch (activation) {
    case Activation::kGelu: return at::gelu(x);
    case Activation::kGeluTanh: return at::gelu(x, "tanh");
    case Activation::kSilu: break;
  }
  return at::silu(x);
}

at::Tensor remember(const LayerPass& p, const at::Tensor& x) {
  if (p.cache == nullptr) return x;
  if (p.ring_slots.defined()) throw std::logic_error("remember: layer " + std::to_string(p.layer) + " keeps a ring (a sliding window); attend() caches it");
  StaticKVCache& cache = *p.cache;
  if (cache.keys.size() <= p.layer) {
    cache.keys.resize(p.layer + 1);
    cache.values.resize(p.layer + 1);
  }
  at::Tensor& held = cache.keys[p.layer];
  if (!held.defined()) held = at::zeros({cache.rows, 1, cache.capacity, x.size(-1)}, x.options());
  // Advanced indices around a full slice put their [B, T] first: x goes in as [B, T, 1, W].
  held.index_put_({c10::optional<at::Tensor>(p.cache_rows), c10::optional<at::Tensor>(), c10::optional<at::Tensor>(p.cache_columns)}, x.unsqueeze(2));
  if (p.fresh) return x;
  return (p.read_rows.defined() ? held.index_select(0, p.read_rows) : held).squeeze(1);
}

at::Tensor attend(const LayerPass& p, const at::Tensor& q_given, const at::Tensor& k_in, const at::Tensor& v_in, const AttendOptions& o) {
  const auto batch = q_given.size(0), len = q_given.size(1);
  // Soft-capped scores and sinks need the exact formula. Another scale alone does not: q takes
  // the difference, so every kernel (SDPA, flash, the decode step's) scales as it always does.
  const bool exact = o.extras.softcap > 0 || o.extras.sinks.defined();
  const bool rescaled = !exact && o.extras.scale > 0;
  const at::Tensor q_in = rescaled ? q_given * (o.extras.scale * std::sqrt(static_cast<double>(q_given.size(-1)))) : q_given;
  // [B, T, heads, d] to attention's [B, heads, T, d], turned as the family turns it.
  const auto turned = [&](const at::Tensor& t) {
    const at::Tensor heads_first = t.transpose(1, 2);
    switch (o.rotary) {
      case Rotary::kHalf: return apply_rotary(heads_first, p.cos, p.sin);
      case Rotary::kInterleaved: return apply_rotary_interleaved(heads_first, p.cos, p.sin);
      case Rotary::kNone: break;
    }
    return heads_first;
  };
  // The exact formula needs the pattern where the shell chose segments (and so made none).
  const auto allowed_or_made = [&](const at::Tensor& allowed) {
    return allowed.defined() || !exact || p.segments == nullptr ? allowed : attention_allowed(p.attention_mask, len, p.window);
  };
  const auto attended = [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed) {
    return exact ? attention_exact(q, k, v, allowed_or_made(allowed), o.extras) : attention(q, k, v, allowed);
  };
  const auto out = [&](const at::Tensor& a) { return a.transpose(1, 2).reshape({batch, len, -1}); };
  if (p.cache == nullptr) {
    const at::Tensor q = turned(q_in), k = turned(k_in), v = v_in.transpose(1, 2);
    if (p.segments != nullptr && !exact) return out(segment_attention(q, k, v, *p.segments, p.window));
    return out(attended(q, k, v, p.allowed));
  }
  // Through a cache made once: this pass's keys and values are written in place at their columns,
  // then attention reads the rows' whole cache, or only the pass's own tokens when the rows held
  // nothing before it. A sliding layer whose window is shorter than the cache keeps a ring.
  StaticKVCache& cache = *p.cache;
  if (cache.keys.size() <= p.layer) {
    cache.keys.resize(p.layer + 1);
    cache.values.resize(p.layer + 1);
  }
  at::Tensor& keys = cache.keys[p.layer];
  at::Tensor& values = cache.values[p.layer];
  const bool ring = p.ring_slots.defined();
  if (!keys.defined()) {
    const std::int64_t slots = ring ? p.window : cache.capacity;
    keys = at::zeros({cache.rows, k_in.size(2), slots, k_in.size(3)}, k_in.options());
    values = at::zeros({cache.rows, v_in.size(2), slots, v_in.size(3)}, v_in.options());
  }
  const at::Tensor& slots = ring ? p.ring_slots : p.cache_columns;
  // A decode step on a GPU: rotary, the cache write and attention in one kernel.
  if (len == 1 && !p.fresh && !p.read_rows.defined() && o.rotary == Rotary::kHalf && !exact) {
    const at::Tensor a = decode_step_attention(q_in, k_in, v_in, p.cos, p.sin, keys, values, ring ? p.ring_allowed : p.allowed, slots);
    if (a.defined()) return out(a);
  }
  const at::Tensor q = turned(q_in), k = turned(k_in), v = v_in.transpose(1, 2);
  // Advanced indices around a full slice put their [B, T] first: the values go in as [B, T, heads, d].
  const auto write = [&](const at::Tensor& k_part, const at::Tensor& v_part, const at::Tensor& at_rows, const at::Tensor& at_columns) {
    const c10::List<c10::optional<at::Tensor>> where{c10::optional<at::Tensor>(at_rows), c10::optional<at::Tensor>(),
                                                     c10::optional<at::Tensor>(at_columns)};
    keys.index_put_(where, k_part.transpose(1, 2));
    values.index_put_(where, v_part.transpose(1, 2));
  };
  // A ring takes a pass's latest `window` tokens only: earlier ones would share their slots.
  const auto write_latest = [&] {
    const auto n = std::min(len, p.window);
    write(k.narrow(2, len - n, n), v.narrow(2, len - n, n), p.cache_rows.narrow(1, len - n, n), slots.narrow(1, len - n, n));
  };
  if (p.fresh) {
    if (ring) write_latest();
    else write(k, v, p.cache_rows, p.cache_columns);
    if (p.segments != nullptr && !exact) return out(segment_attention(q, k, v, *p.segments, p.window));
    return out(attended(q, k, v, p.allowed));
  }
  const auto held = [&](const at::Tensor& t) { return p.read_rows.defined() ? t.index_select(0, p.read_rows) : t; };
  if (ring && len > 1) {
    // Several tokens into a ring: attend over what it held before them and the pass's own, then
    // write; writing first would overwrite columns the pass's first tokens still see.
    const at::Tensor a = attended(q, at::cat({held(keys), k}, 2), at::cat({held(values), v}, 2), p.ring_allowed);
    write_latest();
    return out(a);
  }
  write(k, v, p.cache_rows, slots);
  const at::Tensor& seen = ring ? p.ring_allowed : p.allowed;
  if (len == 1 && !p.read_rows.defined() && !exact) return out(decode_attention(q, keys, values, seen));
  return out(attended(q, held(keys), held(values), seen));
}

BlockShape block_shape(const DecoderFamily& family, const DecoderConfig& config, std::size_t layer) {
  BlockBuilder built(family, config, layer, at::TensorOptions().device(c10::DeviceType::Meta), nullptr, nullptr);
  family.block(built);
  std::uint64_t count = 0;
  for (const auto& w : built.weights()) {
    std::uint64_t values = 1;
    for (const std::int64_t d : w.shape) values *= static_cast<std::uint64_t>(d);
    count += values;
  }
  for (const auto& [name, linear] : built.linears()) {
    count += static_cast<std::uint64_t>(linear->in_features) * static_cast<std::uint64_t>(linear->out_features);
    if (linear->bias.defined()) count += static_cast<std::uint64_t>(linear->out_features);
  }
  if (const auto& experts = built.made_experts())
    for (const at::Tensor* t : {static_cast<const at::Tensor*>(&experts->router), &experts->stacked(false), &experts->stacked(true), &experts->bias(false),
                                &experts->bias(true)})
      if (t->defined()) count += static_cast<std::uint64_t>(t->numel());
  return {built.declared(), count};
}

}  // namespace loom::kit
