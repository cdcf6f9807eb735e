#include "generation/generate.hpp"

#include <algorithm>
#include <chrono>
#include <deque>
#include <limits>
#include <optional>

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "loom/error.hpp"
#include "loom/kit/blocks.hpp"
#include "loom/kit/torch_compat.hpp"
#include "generation/decode_graph.hpp"

namespace loom::core {
namespace {

constexpr std::int64_t kLow32 = 0xFFFFFFFF;

// A 32-bit mixer (Thomas Mueller's: two multiply-xorshift rounds, a bijection with good
// avalanche), in int64 arithmetic with every value below 2^32 so no product overflows.
at::Tensor mix32(at::Tensor h) {
  constexpr std::int64_t kMultiplier = 0x45d9f3b;
  h = ((h.__rshift__(16) ^ h) * kMultiplier) & kLow32;
  h = ((h.__rshift__(16) ^ h) * kMultiplier) & kLow32;
  return h.__rshift__(16) ^ h;
}

// Uniforms in (0, 1) [B, V], one per row, draw and token, from the seed alone.
at::Tensor hashed_uniforms(std::uint64_t seed, const at::Tensor& streams, const at::Tensor& draws, std::int64_t width) {
  const auto low = static_cast<std::int64_t>(seed & 0xFFFFFFFFull), high = static_cast<std::int64_t>(seed >> 32);
  const at::Tensor row_key = mix32(mix32(mix32(streams & kLow32) ^ low) ^ high);
  const at::Tensor draw_key = mix32(row_key ^ (draws & kLow32)).unsqueeze(1);
  const at::Tensor second_key = mix32(draw_key ^ std::int64_t{0x5bd1e995});
  const at::Tensor tokens = at::arange(width, streams.options()).unsqueeze(0);
  // Two rounds with independent keys: one round's values for two draws would be one set permuted.
  const at::Tensor bits = mix32(mix32(tokens ^ draw_key) ^ second_key);
  return (bits.__rshift__(8).to(at::kFloat) + 0.5f) * (1.0f / 16777216.0f);
}

}  // namespace

at::Tensor choose_next(const at::Tensor& logits, const GenerationSettings& settings, const at::Tensor& streams, const at::Tensor& draws) {
  const at::Tensor scores = logits.to(at::kFloat);
  if (settings.temperature <= 0) return scores.argmax(-1);
  const std::int64_t width = scores.size(-1);
  // Scaled from the largest logit down: a tiny temperature sends every other probability to 0
  // (sampling becomes greedy) instead of the largest to +inf.
  const double temperature = std::max(settings.temperature, static_cast<double>(std::numeric_limits<float>::min()));
  at::Tensor scaled = (scores - std::get<0>(scores.max(-1, true))) / temperature;
  const float minus_infinity = -std::numeric_limits<float>::infinity();
  // The k likeliest from the scores before scaling: dividing by a temperature keeps their order,
  // but one past float's range would flatten them all to 0 and keep every token.
  if (settings.top_k > 0 && settings.top_k < width)
    scaled = scaled.masked_fill(scores < std::get<0>(scores.topk(settings.top_k, -1)).narrow(-1, settings.top_k - 1, 1), minus_infinity);
  if (settings.top_p < 1.0) {
    // Most probable first (ties by id); the nucleus is the smallest prefix whose mass reaches top_p,
    // so a token stays when the mass before it is below top_p. The likeliest always stays: a top_p
    // that is 0 in float (1e-300) would otherwise cut every token.
    auto [sorted, order] = scaled.sort(/*stable=*/true, -1, /*descending=*/true);
    const at::Tensor probs = sorted.softmax(-1);
    at::Tensor cut = probs.cumsum(-1) - probs >= settings.top_p;
    cut.narrow(-1, 0, 1).fill_(false);
    sorted = sorted.masked_fill(cut, minus_infinity);
    scaled = at::empty_like(scaled).scatter_(-1, order, sorted);
  }
  const at::Tensor gumbel = -(-hashed_uniforms(settings.seed, streams.to(scores.device()), draws.to(scores.device()), width).log()).log();
  return (scaled + gumbel).argmax(-1);
}

namespace {

// The rows being decoded and everything a decode step reads and writes, on the logits' device:
// made once, changed in place (a captured graph replays on these very tensors).
struct DecodeRows {
  at::Tensor last;      // [R] the token each row feeds next
  at::Tensor position;  // [R] its position
  at::Tensor column;    // [R] its cache column
  at::Tensor mask;      // [R, capacity] 1: a column holding a real token
  at::Tensor tokens;    // [R, max_new + 1] what each row drew (the last column takes ended rows' draws)
  at::Tensor count;     // [R] tokens drawn
  at::Tensor done;      // [R] ended: end of sequence or max_new_tokens (stop texts: the host)
  at::Tensor request;   // [R] the prompt each row answers: its sampling stream
  at::Tensor bad;       // [] a live row's logits were not finite
};

class Generation {
 public:
  Generation(const NextLogits& next_logits, const Tokenizer& tokenizer, std::vector<std::vector<std::int64_t>> prompts, const GenerationSettings& settings)
      : next_logits_(next_logits), tokenizer_(tokenizer), settings_(settings), encoded_(std::move(prompts)) {
    const auto specials = tokenizer.special_tokens();
    pad_ = specials.pad.value_or(specials.eos.value_or(0));
    eos_ = settings.ignore_eos ? -1 : specials.eos.value_or(-1);
    std::int64_t longest = 0;
    for (std::size_t i = 0; i < encoded_.size(); ++i) {
      if (encoded_[i].empty())
        throw UserError("cannot generate from an empty prompt (prompt " + std::to_string(i + 1) + " of " + std::to_string(encoded_.size()) +
                        " has no tokens)");
      longest = std::max(longest, static_cast<std::int64_t>(encoded_[i].size()));
    }
    // Compared without the sum, which a huge max_new_tokens would overflow.
    if (settings.max_positions > 0 && settings.max_new_tokens > settings.max_positions - longest)
      throw UserError("a prompt of " + std::to_string(longest) + " tokens and " + std::to_string(settings.max_new_tokens) + " new ones pass the model's " +
                      std::to_string(settings.max_positions) + " positions" +
                      (longest < settings.max_positions ? "; ask for at most " + std::to_string(settings.max_positions - longest) + " new tokens"
                                                        : "; shorten the prompt"));
    cache_.rows = std::min<std::int64_t>(static_cast<std::int64_t>(encoded_.size()), std::max<std::int64_t>(1, settings.max_rows));
    if (settings.max_new_tokens > std::numeric_limits<std::int32_t>::max() - longest)
      throw UserError("a prompt of " + std::to_string(longest) + " tokens and " + std::to_string(settings.max_new_tokens) +
                      " new ones: no cache holds that many positions; ask for fewer new tokens");
    cache_.capacity = longest + settings.max_new_tokens;
    // Rows of the embedding past the tokenizer's vocabulary (padding, or a model larger than its
    // tokenizer) name no token: they are never chosen.
    choosable_ = tokenizer.vocab_size();
    for (const auto& stop : settings.stop_texts) longest_stop_ = std::max(longest_stop_, static_cast<std::int64_t>(stop.size()));
    answers_.resize(encoded_.size());
  }

  std::vector<Generated> run() {
    if (settings_.before_cache) cache_.rows = std::clamp<std::int64_t>(settings_.before_cache(cache_.rows, cache_.capacity), 1, cache_.rows);
    const auto rows = cache_.rows;
    std::deque<std::size_t> waiting;
    for (std::size_t i = 0; i < encoded_.size(); ++i) waiting.push_back(i);
    slot_request_.assign(static_cast<std::size_t>(rows), -1);
    checked_.assign(static_cast<std::size_t>(rows), 0);
    seen_.assign(static_cast<std::size_t>(rows), 0);
    const auto started = std::chrono::steady_clock::now();
    std::vector<std::int64_t> first;
    for (std::int64_t r = 0; r < rows; ++r) first.push_back(r);
    fill(first, waiting);
    // The prompt pass ends at the first look (its copy to the host waits for the device). The next
    // look's worth of steps is the warm-up (kernels' first runs, the graph's capture): timed apart,
    // so the per-step figure is the steady state.
    std::chrono::steady_clock::time_point prompt_done, warm_done;
    std::int64_t steps = 0, drawn = 0, warm_steps = -1, warm_drawn = 0;
    std::optional<DecodeGraph> graph;
    while (true) {
      std::vector<std::int64_t> ended;
      drawn += look(ended);
      if (steps == 0) prompt_done = warm_done = std::chrono::steady_clock::now();
      if (warm_steps < 0 && steps > 0) {
        warm_steps = steps;
        warm_drawn = drawn;
        warm_done = std::chrono::steady_clock::now();
      }
      for (const auto r : ended) finish(r);
      if (!waiting.empty()) fill(ended, waiting);
      if (std::all_of(slot_request_.begin(), slot_request_.end(), [](std::int64_t q) { return q < 0; })) break;
      // Until the next look: as many steps as the longest-running live row may still take.
      const std::int64_t every = settings_.check_every > 0 ? settings_.check_every : state_.last.is_cuda() ? 8 : 1;
      const std::int64_t ahead = std::min(every, settings_.max_new_tokens - min_live_count_);
      const at::Tensor holding = rows_to_step();
      for (std::int64_t i = 0; i < std::max<std::int64_t>(ahead, 1); ++i, ++steps) {
        if (holding.defined()) {
          step_rows(holding);
        } else if (settings_.cuda_graph && DecodeGraph::available() && state_.last.is_cuda()) {
          if (!graph) {
            graph.emplace();
            graph->capture([&] { step(); });  // runs one real step eagerly first, as warm-up
            continue;
          }
          graph->replay();
        } else {
          step();
        }
      }
    }
    const auto seconds = [](auto from, auto to) { return std::chrono::duration<double>(to - from).count(); };
    const auto end = std::chrono::steady_clock::now();
    const double prompt_s = seconds(started, prompt_done);
    if (warm_steps < 0 || warm_steps == steps) {  // too few steps to set any apart
      warm_steps = 0;
      warm_drawn = 0;
      warm_done = prompt_done;
    }
    const double steady_s = seconds(warm_done, end);
    const std::int64_t steady = steps - warm_steps;
    spdlog::info("generate: {} prompt(s) of up to {} tokens: prompt pass {:.3f} s, then {} step(s) at {:.2f} ms each ({:.1f} new tokens/s), "
                 "after {} warm-up step(s) in {:.3f} s{}",
                 encoded_.size(), cache_.capacity - settings_.max_new_tokens, prompt_s, steady,
                 steady > 0 ? 1e3 * steady_s / static_cast<double>(steady) : 0.0, steady_s > 0 ? static_cast<double>(drawn - warm_drawn) / steady_s : 0.0,
                 warm_steps, seconds(prompt_done, warm_done), graph ? " (decode step replayed as a CUDA graph)" : "");
    if (state_.last.is_cuda())
      if (const auto peak = kit::compat::cuda_peak_allocated(state_.last.device().index()))
        spdlog::info("generate: peak {:.2f} GiB allocated on {}", static_cast<double>(*peak) / (1ull << 30), state_.last.device().str());
    return answers_;
  }

 private:
  at::Tensor logits_of(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& mask, CachedPass& pass) {
    at::Tensor logits = next_logits_(ids, positions, mask, pass);
    if (choosable_ > 0 && logits.size(-1) > choosable_) logits = logits.narrow(-1, 0, choosable_);
    return logits;
  }

  // One decode step for every row, in place, with no look from the host (a graph replays it).
  void step() { advance(state_, cache_.rows, at::Tensor()); }

  // On the CPU, where a step costs what its rows cost, the rows holding a prompt when at most half
  // of them do (the last prompts of a batch, rows that ended with none left to take): their cache
  // rows, to step alone. Undefined: step every row. (A GPU's step is bound by its weights, not its
  // rows, and a graph replays one shape.)
  at::Tensor rows_to_step() const {
    if (!state_.last.defined() || state_.last.is_cuda()) return at::Tensor();
    std::vector<std::int64_t> holding;
    for (std::int64_t r = 0; r < cache_.rows; ++r)
      if (slot_request_[static_cast<std::size_t>(r)] >= 0) holding.push_back(r);
    if (2 * static_cast<std::int64_t>(holding.size()) > cache_.rows) return at::Tensor();
    return at::tensor(holding, at::kLong);
  }

  // A step of cache rows `only` alone: their state gathered, stepped, and put back (`bad` is
  // shared by every row).
  void step_rows(const at::Tensor& only) {
    static constexpr at::Tensor DecodeRows::*kPerRow[] = {&DecodeRows::last,   &DecodeRows::position, &DecodeRows::column, &DecodeRows::mask,
                                                          &DecodeRows::tokens, &DecodeRows::count,    &DecodeRows::done,   &DecodeRows::request};
    DecodeRows part;
    part.bad = state_.bad;
    for (const auto member : kPerRow) part.*member = (state_.*member).index_select(0, only);
    advance(part, only.size(0), only);
    for (const auto member : kPerRow) (state_.*member).index_copy_(0, only, part.*member);
  }

  // One decode step of `rows` rows of state `s`, in place: the cache's rows `cache_rows` (undefined:
  // all of them, in order).
  void advance(DecodeRows& s, std::int64_t rows, const at::Tensor& cache_rows) {
    const at::Tensor columns = s.column.view({rows, 1});
    s.mask.scatter_(1, columns, 1);
    CachedPass pass{&cache_, cache_rows, columns, false};
    const at::Tensor logits = logits_of(s.last.view({rows, 1}), s.position.view({rows, 1}), s.mask, pass);
    if (settings_.temperature <= 0) {
      // One kernel on a GPU for what follows (LibTorch's operations took about twenty launches).
      kit::GreedyStepRows greedy{s.last, s.position, s.column, s.tokens, s.count, s.done, s.bad};
      if (kit::greedy_decode_step(logits.reshape({rows, logits.size(-1)}), greedy, eos_, max_new(), cache_.capacity)) return;
    }
    const at::Tensor live = s.done.logical_not();
    record(logits, live);
    const at::Tensor token = choose_next(logits, settings_, s.request, s.count);
    s.tokens.scatter_(1, at::where(live, s.count, max_new()).view({rows, 1}), token.view({rows, 1}));
    const at::Tensor step = live.to(at::kLong);
    s.count.add_(step);
    s.done.logical_or_(live & (token.eq(eos_) | s.count.ge(settings_.max_new_tokens)));
    s.last.copy_(token);
    s.position.add_(step);
    s.column.add_(step).clamp_max_(cache_.capacity - 1);
  }

  void record(const at::Tensor& logits, const at::Tensor& live) {
    state_.bad.logical_or_((std::get<0>(logits.max(-1)).isfinite().logical_not() & live).any());
  }

  std::int64_t max_new() const { return settings_.max_new_tokens; }

  // Starts the waiting prompts in cache rows `rows` (ended ones or, at first, all): one fresh
  // pass over them, left-padded to the longest, and each one's first token drawn.
  void fill(const std::vector<std::int64_t>& rows, std::deque<std::size_t>& waiting) {
    std::vector<std::int64_t> taken, requests;
    for (const auto r : rows) {
      if (waiting.empty()) break;
      taken.push_back(r);
      requests.push_back(static_cast<std::int64_t>(waiting.front()));
      slot_request_[static_cast<std::size_t>(r)] = static_cast<std::int64_t>(waiting.front());
      checked_[static_cast<std::size_t>(r)] = 0;
      seen_[static_cast<std::size_t>(r)] = 1;
      waiting.pop_front();
    }
    if (taken.empty()) return;
    const auto k = static_cast<std::int64_t>(taken.size());
    std::int64_t width = 0;
    for (const auto q : requests) width = std::max(width, static_cast<std::int64_t>(encoded_[static_cast<std::size_t>(q)].size()));
    std::vector<std::int64_t> ids, mask, lengths;
    for (const auto q : requests) {  // left padding: every prompt ends at the last column
      const auto& e = encoded_[static_cast<std::size_t>(q)];
      ids.insert(ids.end(), static_cast<std::size_t>(width) - e.size(), pad_);
      mask.insert(mask.end(), static_cast<std::size_t>(width) - e.size(), 0);
      ids.insert(ids.end(), e.begin(), e.end());
      mask.insert(mask.end(), e.size(), 1);
      lengths.push_back(static_cast<std::int64_t>(e.size()));
    }
    const at::Tensor prompt_ids = at::tensor(ids, at::kLong).view({k, width});
    const at::Tensor prompt_mask = at::tensor(mask, at::kLong).view({k, width});
    const at::Tensor positions = (prompt_mask.cumsum(1) - 1).clamp_min(0);
    const at::Tensor slots = at::tensor(taken, at::kLong);
    // The first chunk is a fresh pass; each later one reads what the earlier ones wrote, its mask
    // over the whole cache row (the prompt's real columns so far).
    const std::int64_t chunk = settings_.prompt_chunk > 0 ? settings_.prompt_chunk : width;
    at::Tensor logits;
    for (std::int64_t from = 0; from < width; from += chunk) {
      const std::int64_t len = std::min(chunk, width - from);
      const at::Tensor columns = at::arange(from, from + len, at::kLong).view({1, len}).expand({k, len});
      CachedPass pass{&cache_, slots, columns, from == 0};
      const at::Tensor seen = from == 0 ? prompt_mask.narrow(1, 0, len)
                                        : at::constant_pad_nd(prompt_mask.narrow(1, 0, from + len), {0, cache_.capacity - from - len});
      logits = logits_of(prompt_ids.narrow(1, from, len), positions.narrow(1, from, len), seen, pass);
    }
    if (!state_.last.defined()) allocate(logits.device());
    DecodeRows& s = state_;
    const auto device = s.last.device();
    const at::Tensor at_rows = slots.to(device);
    const at::Tensor req = (at::tensor(requests, at::kLong) + settings_.first_stream).to(device);
    const at::Tensor token = choose_next(logits, settings_, req, at::zeros({k}, req.options()));
    s.mask.index_copy_(0, at_rows, at::constant_pad_nd(prompt_mask.to(device), {0, cache_.capacity - width}));
    s.tokens.index_copy_(0, at_rows, at::constant_pad_nd(token.view({k, 1}), {0, max_new()}, static_cast<double>(pad_)));
    s.count.index_fill_(0, at_rows, 1);
    s.done.index_copy_(0, at_rows, token.eq(eos_) | at::full({k}, max_new() <= 1, at::TensorOptions().dtype(at::kBool).device(device)));
    s.request.index_copy_(0, at_rows, req);
    s.last.index_copy_(0, at_rows, token);
    s.position.index_copy_(0, at_rows, at::tensor(lengths, at::kLong).to(device));
    s.column.index_fill_(0, at_rows, width);
    record(logits, at::ones({k}, at::TensorOptions().dtype(at::kBool).device(device)));
  }

  void allocate(const c10::Device& device) {
    const auto rows = cache_.rows;
    const auto on = at::TensorOptions().dtype(at::kLong).device(device);
    state_.last = at::full({rows}, pad_, on);
    state_.position = at::zeros({rows}, on);
    state_.column = at::zeros({rows}, on);
    state_.mask = at::zeros({rows, cache_.capacity}, on);
    state_.tokens = at::full({rows, max_new() + 1}, pad_, on);
    state_.count = at::zeros({rows}, on);
    state_.done = at::ones({rows}, on.dtype(at::kBool));  // a row with no prompt stays ended
    state_.request = at::zeros({rows}, on);
    state_.bad = at::zeros({}, on.dtype(at::kBool));
  }

  // What the host knows of the rows as of its last look.
  void sync_to_host() {
    tokens_ = state_.tokens.to(at::kCPU);
    counts_ = state_.count.to(at::kCPU);
    done_ = state_.done.to(at::kCPU);
    if (state_.bad.to(at::kCPU).item<bool>())
      throw UserError("generate: the model's logits are not finite (NaN or infinite); its weights or the adapter diverged or are damaged");
  }

  // Brings the rows to the host; `ended` gets the rows that have ended (at the end of sequence,
  // max_new_tokens, a stop text, or holding no prompt). Returns the tokens drawn since the last look.
  std::int64_t look(std::vector<std::int64_t>& ended) {
    sync_to_host();
    const auto* counts = counts_.data_ptr<std::int64_t>();
    const auto* done = done_.data_ptr<bool>();
    std::int64_t drawn = 0;
    min_live_count_ = max_new();
    std::vector<std::int64_t> stopped;
    for (std::int64_t r = 0; r < cache_.rows; ++r) {
      const auto i = static_cast<std::size_t>(r);
      if (slot_request_[i] < 0) {
        ended.push_back(r);
        continue;
      }
      drawn += counts[r] - seen_[i];
      seen_[i] = counts[r];
      bool over = done[r];
      if (!over && stopped_by_text(r)) {
        over = true;
        stopped.push_back(r);
      }
      if (over) ended.push_back(r);
      else min_live_count_ = std::min(min_live_count_, counts[r]);
    }
    if (!stopped.empty()) state_.done.index_fill_(0, at::tensor(stopped, at::kLong).to(state_.done.device()), true);
    return drawn;
  }

  // The row's tokens so far (up to its end of sequence).
  std::vector<std::int64_t> row_tokens(std::int64_t r) const {
    const auto n = counts_.data_ptr<std::int64_t>()[r];
    const auto* data = tokens_[r].data_ptr<std::int64_t>();
    std::vector<std::int64_t> out;
    for (std::int64_t i = 0; i < n && data[i] != eos_; ++i) out.push_back(data[i]);
    return out;
  }

  // Where `text` first holds a stop text (npos: nowhere).
  std::size_t stop_at(const std::string& text) const {
    std::size_t at = std::string::npos;
    for (const auto& stop : settings_.stop_texts)
      if (!stop.empty()) at = std::min(at, text.find(stop));
    return at;
  }

  // Whether the row's newest tokens spell a stop text: only its tail is decoded (each token is at
  // least a byte, so a stop text begun before the last look lies within that many tokens of it).
  bool stopped_by_text(std::int64_t r) {
    if (longest_stop_ == 0) return false;
    const auto all = row_tokens(r);
    auto& checked = checked_[static_cast<std::size_t>(r)];
    const auto from = std::max<std::int64_t>(0, checked - longest_stop_);
    checked = static_cast<std::int64_t>(all.size());
    const std::vector<std::int64_t> tail(all.begin() + from, all.end());
    return stop_at(tokenizer_.decode(tail, !settings_.templated)) != std::string::npos;
  }

  // The answer of the prompt in row `r`, which has ended; the row then holds none.
  void finish(std::int64_t r) {
    auto& q = slot_request_[static_cast<std::size_t>(r)];
    if (q < 0) return;
    Generated& out = answers_[static_cast<std::size_t>(q)];
    out.text = tokenizer_.decode(row_tokens(r), !settings_.templated);
    out.prompt_ids = encoded_[static_cast<std::size_t>(q)];
    // The ids through the end of sequence, where the row drew one.
    const auto n = counts_.data_ptr<std::int64_t>()[r];
    const auto* data = tokens_[r].data_ptr<std::int64_t>();
    for (std::int64_t i = 0; i < n; ++i) {
      out.ids.push_back(data[i]);
      if (data[i] == eos_) break;
    }
    if (const auto at = stop_at(out.text); at != std::string::npos) {
      out.text.erase(at);
      // The fewest ids that still spell the stop text (a GPU may have drawn a few past it).
      for (std::size_t keep = 1; keep <= out.ids.size(); ++keep)
        if (stop_at(tokenizer_.decode(std::vector<std::int64_t>(out.ids.begin(), out.ids.begin() + static_cast<std::ptrdiff_t>(keep)),
                                      !settings_.templated)) != std::string::npos) {
          out.ids.resize(keep);
          break;
        }
    }
    q = -1;
  }

  const NextLogits& next_logits_;
  const Tokenizer& tokenizer_;
  const GenerationSettings& settings_;
  std::int64_t pad_ = 0, eos_ = -1, choosable_ = 0, longest_stop_ = 0, min_live_count_ = 0;
  std::vector<std::vector<std::int64_t>> encoded_;
  StaticKVCache cache_;
  DecodeRows state_;
  at::Tensor tokens_, counts_, done_;         // the host's copies, as of its last look
  std::vector<std::int64_t> slot_request_;   // the prompt each row answers, -1 for none
  std::vector<std::int64_t> checked_;        // tokens of each row already searched for stop texts
  std::vector<std::int64_t> seen_;           // tokens of each row counted in the timing line
  std::vector<Generated> answers_;
};

}  // namespace

std::vector<Generated> generate_completions(const NextLogits& next_logits, const Tokenizer& tokenizer, std::vector<std::vector<std::int64_t>> prompt_ids,
                                            const GenerationSettings& settings) {
  if (prompt_ids.empty()) return {};
  torch::NoGradGuard no_grad;
  const std::size_t count = prompt_ids.size();
  Generation generation(next_logits, tokenizer, std::move(prompt_ids), settings);
  if (settings.max_new_tokens <= 0) return std::vector<Generated>(count);
  return generation.run();
}

std::vector<Generated> generate_completions(const NextLogits& next_logits, const Tokenizer& tokenizer, const std::vector<std::string>& prompts,
                                            const GenerationSettings& settings) {
  std::vector<std::vector<std::int64_t>> encoded;
  for (const auto& p : prompts) encoded.push_back(tokenizer.encode(p, settings.templated ? Specials::kNone : Specials::kPrompt).ids);
  return generate_completions(next_logits, tokenizer, std::move(encoded), settings);
}

std::vector<std::string> generate(const NextLogits& next_logits, const Tokenizer& tokenizer, const std::vector<std::string>& prompts,
                                  const GenerationSettings& settings) {
  std::vector<std::string> texts;
  for (auto& g : generate_completions(next_logits, tokenizer, prompts, settings)) texts.push_back(std::move(g.text));
  return texts;
}

}  // namespace loom::core
