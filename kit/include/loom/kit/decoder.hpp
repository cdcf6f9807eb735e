#pragma once
// The generic decoder (embedding, decoder layers of RMSNorms, rotary GQA attention over every
// earlier position or a sliding window, a SwiGLU or GeGLU MLP or experts, final norm, head) that a
// model family describes instead of writing, or whose layer it writes as a block
// (loom/kit/decoder_block.hpp, kit 4): the config.json keys it adds, its tensor names, its norms'
// form and places, the weights it adds to each layer and what it does with them. Loading
// (streamed shard by shard), random init, the KV cache, stage ownership, the tied head, tensor
// parallelism (heads, MLP and vocabulary split; whole weights' gradients summed over the group),
// 4-bit bases from the adapter and saving come from here, so a family gets every placement and
// adapter without code of its own. docs/plugin-guide.md walks through a family.
#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include "loom/export.hpp"
#include "loom/kit/json.hpp"
#include "loom/model.hpp"
#include "loom/options.hpp"
#include "loom/plugin.hpp"
#include "loom/kit/version.hpp"  // recorded in the descriptor of a plugin that uses the kit

namespace loom::kit {

inline constexpr std::int64_t kMaxDimension = std::int64_t{1} << 24;  // far above any real model, far below overflow
// The deepest real models have 126 (Llama 3.1 405B) to 160 layers; each layer is a block to plan.
inline constexpr std::int64_t kMaxLayers = 1024;

// How a decoder layer attends: over every earlier position, or over a sliding window of the
// latest ones (transformers' layer_types: "full_attention", "sliding_attention").
enum class AttentionKind { kGlobal, kSliding };

// Rotary settings of one kind of layer: rope_theta and transformers' rope_scaling.
struct RopeSettings {
  double theta = 10000.0;
  // "default" (none), "linear" (positions / factor), "llama3" (frequency bands), "yarn" (NTK-by-parts
  // with a ramp between beta_fast and beta_slow) or "longrope" (Phi-3's per-frequency factors, the
  // long ones for a sequence past original_max_positions).
  std::string type = "default";
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  std::int64_t original_max_positions = 8192;
  double beta_fast = 32, beta_slow = 1;  // yarn
  bool truncate = true;                  // yarn: the ramp's ends rounded outward
  std::vector<double> short_factor, long_factor;  // longrope: one a frequency
  // cos and sin times this (yarn's and longrope's attention factor, from the file or derived as
  // transformers derives it); 1 for the other types.
  double attention_factor = 1.0;
  bool operator==(const RopeSettings& o) const {
    return theta == o.theta && type == o.type && factor == o.factor && low_freq_factor == o.low_freq_factor && high_freq_factor == o.high_freq_factor &&
           original_max_positions == o.original_max_positions && beta_fast == o.beta_fast && beta_slow == o.beta_slow && truncate == o.truncate &&
           short_factor == o.short_factor && long_factor == o.long_factor && attention_factor == o.attention_factor;
  }
};

// The MLP's gate activation (config.json's hidden_act): silu (SwiGLU), gelu with the tanh
// approximation (GeGLU: gelu_pytorch_tanh, gelu_new) or exact gelu.
enum class Activation { kSilu, kGeluTanh, kGelu };
// The activation a config.json value names (`absent` where it is missing or null); one error at
// the value naming the ones loom runs otherwise.
LOOM_API Activation read_activation(const json::Value& value, Activation absent);
LOOM_API std::string activation_name(Activation activation);

// How a norm applies its weight: w * normalize(x) rounded to x's dtype first (HF's Llama),
// (1 + w) * normalize(x) in fp32 then rounded (Gemma; its weights are offsets from 1, 0 at init),
// or w * normalize(x) in fp32 then rounded (OLMo 2): RMSNorms. kLayer: torch's LayerNorm with a
// weight and a bias in x's dtype (GPT-NeoX, StableLM, StarCoder 2); kLayerFloat: LayerNorm without
// a bias in fp32 (Cohere). Kit 4.0 added the LayerNorms.
enum class NormForm { kScale, kOffsetScale, kScaleInFloat, kLayer, kLayerFloat };
// Whether a norm of the form has a bias beside its weight.
inline bool norm_has_bias(NormForm form) { return form == NormForm::kLayer; }
// A norm weight that leaves its input as it is: 0 where the form adds 1, else 1 (its random init).
inline float norm_identity(NormForm form) { return form == NormForm::kOffsetScale ? 0.0f : 1.0f; }
// A family's norm of x's last dimension in its form (a LayerNorm's bias undefined: none).
LOOM_API at::Tensor rms_norm_as(NormForm form, const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& bias = at::Tensor());

// A mixture of experts in place of some layers' MLP (kit 3.4): each token's MLP output is the
// weighted sum of the top_k experts its router picks (loom/kit/moe.hpp), from config.json's keys.
struct MoeConfig {
  std::int64_t num_experts = 0;               // num_experts or num_local_experts; 0: every layer dense
  std::int64_t top_k = 0;                     // num_experts_per_tok
  std::int64_t expert_intermediate_size = 0;  // each expert's hidden units (the family's key)
  bool normalize = false;                     // the top-k weights rescaled to sum to 1 (norm_topk_prob)
  std::int64_t sparse_step = 1;               // decoder_sparse_step: layer i is sparse when (i + 1) % step == 0 ...
  std::vector<std::int64_t> dense_layers;     // ... and it is not in mlp_only_layers
  double aux_loss_coef = 0.001;               // router_aux_loss_coef
  bool aux_loss = false;                      // output_router_logits: the load-balancing loss joins the training loss
  // Kit 4.0: a shared expert every token takes beside its routed ones, a gated MLP of this many
  // units weighted by sigmoid(shared_expert_gate(x)) (Qwen2-MoE); 0: none.
  std::int64_t shared_expert_intermediate_size = 0;
};

// The hyper-parameters of one model, from config.json or the plugin's shape options.
struct DecoderConfig {
  std::string model_type;  // config.json's model_type, one the family reads (a wrapper's text model: the family's first)
  // The wrapper folder's model_type when this is the language model inside it (DecoderFamily::wrapper);
  // empty for a folder of the family's own.
  std::string wrapper_type;
  std::int64_t hidden_size = 0;
  std::int64_t intermediate_size = 0;
  std::int64_t num_hidden_layers = 0;
  std::int64_t num_attention_heads = 0;
  std::int64_t num_key_value_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t vocab_size = 0;
  std::int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // bias on q, k, v and o
  bool qkv_bias = false;        // bias on q, k, v only
  bool mlp_bias = false;
  RopeSettings rope;                        // every layer's rotary, or the global layers' where local_rope is set
  std::optional<RopeSettings> local_rope;   // the sliding layers' own (Gemma 3: theta 10k there, 1M on global layers)
  // Keys a sliding layer's query sees, itself included (transformers: a key at column k is seen
  // from column q when q - window < k <= q); 0 when no layer slides. From config.json's
  // sliding_window, kept only where a layer slides.
  std::int64_t sliding_window = 0;
  // One entry a layer (read from layer_types, or set by the family's configure from its own keys:
  // Mistral's sliding_window, Qwen2's use_sliding_window and max_window_layers); empty after
  // reading means every layer global.
  std::vector<AttentionKind> layer_attention;
  Activation activation = Activation::kSilu;  // from hidden_act
  double attention_scale = 0;       // scores times this; 0: 1 / sqrt(head_dim) (Gemma: query_pre_attn_scalar^-1/2)
  double final_logit_softcap = 0;   // logits become cap * tanh(logits / cap); 0: none (Gemma 2's final_logit_softcapping)
  // Kit 4.0: attention scores become cap * tanh(s / cap) before the mask; 0: none (Gemma 2's
  // attn_logit_softcapping). The embedding's rows times embedding_multiplier (Granite's), the
  // logits times logit_multiplier (Granite's 1 / logits_scaling, Cohere's logit_scale) before any cap.
  double attention_softcap = 0;
  double embedding_multiplier = 1.0;
  double logit_multiplier = 1.0;
  // The share of each head's dimensions rotary turns, its first ones (partial_rotary_factor: Phi-4-mini
  // 0.75); the rest pass through.
  double partial_rotary_factor = 1.0;
  MoeConfig moe;  // kit 3.4
  // The family's own settings (kit 4.0): its configure reads them from config.json's keys (or sets
  // them for a random model), its write_config writes them back, its block reads them
  // (GPT-NeoX's use_parallel_residual).
  nlohmann::json family = nlohmann::json::object();
};

// Whether layer `layer` runs experts (MoeConfig) in place of its MLP.
LOOM_API bool layer_is_sparse(const DecoderConfig& config, std::size_t layer);

// The dimensions of a head rotary turns: head_dim * partial_rotary_factor, rounded down (as transformers).
LOOM_API std::int64_t rotary_dim(const DecoderConfig& config);

// The window layer `layer` attends over: 0 for a global layer.
LOOM_API std::int64_t layer_window(const DecoderConfig& config, std::size_t layer);
// The rotary settings of layer `layer`.
LOOM_API const RopeSettings& layer_rope(const DecoderConfig& config, std::size_t layer);

// A weight of one dimension a family adds to every decoder layer (a per-head norm, say).
struct LayerWeight {
  std::string name;                // under the layer, as the checkpoint names it: "self_attn.q_norm.weight"
  // kQueryWidth and kKeyWidth span every head of q or k (OLMo 2's q/k norms): under tensor
  // parallelism each rank holds its heads' part, as of q_proj's and k_proj's outputs.
  enum class Size { kHidden, kHeadDim, kQueryWidth, kKeyWidth } size = Size::kHeadDim;
  float init = 1;                  // its value at random init: 1 for a norm's scale, 0 for a bias
  // Its whole length (every rank's parts together).
  std::int64_t length(const DecoderConfig& c) const {
    switch (size) {
      case Size::kHidden: return c.hidden_size;
      case Size::kHeadDim: return c.head_dim;
      case Size::kQueryWidth: return c.num_attention_heads * c.head_dim;
      case Size::kKeyWidth: return c.num_key_value_heads * c.head_dim;
    }
    return 0;
  }
};

// The weights of LayerWeight entries, in the family's order, as one layer's hooks see them. Under
// tensor parallelism each rank applies a whole one (kHidden, kHeadDim) to its own heads, so the kit
// hands it over inside a gradient region that sums its gradient over the group: every rank's copy
// learns alike. A split one (kQueryWidth, kKeyWidth) is this rank's heads' part, its own.
using LayerWeights = std::vector<at::Tensor>;

// Called with q and k [batch, positions, heads, head_dim] (this rank's heads) after their
// projections, before rotary; may replace them. `tensor_group`: the group the heads are split over
// (null: this rank holds them all), for work across all heads (rms_norm_over_heads).
using QueryKeyHook =
    std::function<void(at::Tensor& q, at::Tensor& k, const LayerWeights& weights, const DecoderConfig& config, Communicator* tensor_group)>;
// RMSNorm of x [..., heads, head_dim] over all its heads jointly (OLMo 2's q and k norms), in `form`,
// with `weight` this rank's heads' [heads * head_dim]; heads split over `group` have their squares
// summed over it (forward and backward), so each rank normalizes as one device would.
LOOM_API at::Tensor rms_norm_over_heads(NormForm form, const at::Tensor& x, const at::Tensor& weight, double eps, std::int64_t all_heads,
                                        Communicator* group);

// The checkpoint's names (HF's Llama names by default).
struct DecoderNames {
  std::string embed = "model.embed_tokens.weight";
  std::string layers = "model.layers.";  // + index + "." + a layer's own names
  std::string final_norm = "model.norm.weight";
  std::string head = "lm_head.weight";
  // A layer's norms, each "" where the family has none: before attention, before the MLP (Llama
  // calls it post_attention_layernorm), and on attention's and the MLP's outputs before their
  // residual sums (Gemma's sandwich, OLMo 2's post-norms).
  std::string input_norm = "input_layernorm.weight";
  std::string post_attention_norm = "post_attention_layernorm.weight";
  std::string attention_out_norm;
  std::string mlp_out_norm;
  // The four above, in that order.
  std::array<const std::string*, 4> layer_norms() const { return {&input_norm, &post_attention_norm, &attention_out_norm, &mlp_out_norm}; }
  std::string q = "self_attn.q_proj", k = "self_attn.k_proj", v = "self_attn.v_proj", o = "self_attn.o_proj";
  std::string gate = "mlp.gate_proj", up = "mlp.up_proj", down = "mlp.down_proj";
  // Fused projections, "" where the family keeps them apart: q, k and v as one linear's rows in that
  // order (Phi-3's "self_attn.qkv_proj"; q, k and v above then go unused), gate and up likewise
  // ("mlp.gate_up_proj"). One linear to LoRA as PEFT targets it; under tensor parallelism each rank
  // holds its heads' rows of q, of k and of v (its units of gate and of up), not a cut of the rows.
  std::string qkv;
  std::string gate_up;
  // A sparse layer's (kit 3.4), as transformers 5 holds it: the router's weight router + ".weight"
  // [E, H] and the experts stacked, experts + ".gate_up_proj" [E, 2I, H] (each expert's gate rows,
  // then its up rows) and experts + ".down_proj" [E, H, I]. Checkpoints on disk hold them as
  // DecoderFamily::MixtureOfExperts says.
  std::string router = "mlp.gate";
  std::string experts = "mlp.experts";
  // A sparse layer's shared expert (kit 4.0), "" where the family has none: its linears
  // shared_expert + "gate_proj", "up_proj", "down_proj" (Qwen2-MoE's "mlp.shared_expert."), and
  // its gate, a linear of one output whose sigmoid weighs it (Qwen2-MoE's "mlp.shared_expert_gate").
  std::string shared_expert;
  std::string shared_expert_gate;
  // The linears of a layer by their names, in order: q, k, v (or qkv), o, gate, up (or gate_up), down;
  // a sparse layer's attention linears, then its shared expert's gate, up and down and their gate.
  std::vector<std::string> layer_linears(bool sparse = false) const;
  // The pieces a fused linear's output is made of, as a column split treats them (fused_pieces in
  // tensor_parallel.hpp); empty for one that is not fused.
  std::vector<std::int64_t> output_pieces(const std::string& linear, const DecoderConfig& config) const;
};

class DecoderBlock;  // loom/kit/decoder_block.hpp
class BlockBuilder;

// A model family: what tells it apart from the generic decoder.
struct DecoderFamily {
  std::string plugin;                    // the plugin's name, for messages
  std::vector<std::string> model_types;  // config.json model_type values it reads; the first is the default shape
  // config.json's "architectures" entry for a config (transformers' class name).
  std::function<std::string(const DecoderConfig&)> hf_class;
  // The family's own settings after the common keys are read: from config.json (`file` set) or
  // from shape options (`file` null). May be unset.
  std::function<void(DecoderConfig& config, const json::Value* file)> configure;
  // The family's own keys written to config.json by save_pretrained. May be unset.
  std::function<void(const DecoderConfig& config, nlohmann::json& out)> write_config;
  NormForm norm_form = NormForm::kScale;  // every norm of the model's, its layer weights' hooks aside
  bool embedding_scaled = false;          // the embedding's rows times sqrt(hidden_size), rounded to the dtype (Gemma)
  std::vector<LayerWeight> layer_weights;
  QueryKeyHook on_query_key;  // unset: q and k go straight to rotary
  // Values the hooks keep for backward per token and layer, for the planner's memory model.
  std::function<std::uint64_t(const DecoderConfig&)> hook_saved_per_token;
  DecoderNames names;
  // The family's layer as code (kit 4.0, loom/kit/decoder_block.hpp), where a description would not
  // say it: made once a layer the rank holds, its weights registered through the builder. Unset:
  // the description's layer (the fields above). With a block the shell still takes from the
  // description the names of the embedding, the final norm and the head, norm_form for the final
  // norm, and embedding_scaled; the layer's own names, layer_weights and on_query_key go unused.
  std::function<std::shared_ptr<DecoderBlock>(BlockBuilder& builder)> block;
  // The values a layer's generation cache keeps a position on a rank of `tensor` ranks, where the
  // block caches something else than its K/V heads' keys and values (remember(): DeepSeek's latent
  // and rotary key); unset: those keys and values. For the plan's cache memory. Kit 4.1.
  std::function<std::uint64_t(const DecoderConfig& config, int tensor)> cache_values_per_position;
  // Tensors some writers save that the model does not read (a causal mask's buffer), by the ends of
  // their names ("attention.masked_bias"); rotary's inv_freq is always passed over. Kit 4.0.
  std::vector<std::string> ignored;
  // A mixture-of-experts family (kit 3.4): config.json's keys and the checkpoint's names of its
  // sparse layers; the kit routes, runs the experts, loads, saves and splits them.
  struct MixtureOfExperts {
    bool enabled = false;
    std::string expert_size_key = "moe_intermediate_size";  // config.json's key of an expert's hidden units
    std::string shared_size_key = "shared_expert_intermediate_size";  // the shared expert's (names.shared_expert set); kit 4.0
    std::optional<bool> normalize;      // fixed by the family (Mixtral: always); unset: norm_topk_prob, default false
    bool weights_in_hidden_dtype = false;  // the routing weights rounded to the hidden dtype (Qwen3-MoE); else fp32 (Mixtral)
    std::int64_t default_top_k = 2;     // num_experts_per_tok where config.json leaves it out
    // On disk, under a layer: the router's linear, and each expert's three as
    // disk_experts + N + "." + gate (up, down) + ".weight" (transformers 5 saves them so too).
    std::string disk_router = "mlp.gate";
    std::string disk_experts = "mlp.experts.";
    std::string gate = "gate_proj", up = "up_proj", down = "down_proj";
    // Kit 4.1: the experts saved stacked under their in-memory names (DecoderNames::experts +
    // ".gate_up_proj", ".down_proj") as [E, in, out] (x @ W[e]; gpt-oss), not one tensor an
    // expert's linear; such a stacked weight may also come as MXFP4 (name + "_blocks" and "_scales",
    // [E, out, in / 32, 16] and [E, out, in / 32]: gpt-oss's released checkpoints), dequantized on load.
    bool stacked_transposed = false;
  } moe;
  // A multimodal folder whose language model is this family's (Gemma 3's `gemma3`): its
  // model_types, read from their `text_config` with `text_defaults` under the keys it leaves out
  // (the wrapper's config class fills them); its tensors renamed by `renames` (a name's prefix
  // swapped: "language_model.model." to "model.") and those under `skipped` (the vision tower) not
  // loaded. The language model trains and saves as a folder of the family's own type. Kit 3.0.
  struct Wrapper {
    std::vector<std::string> model_types;
    nlohmann::json text_defaults = nlohmann::json::object();
    std::vector<std::pair<std::string, std::string>> renames;
    std::vector<std::string> skipped;
    std::string skipped_what;  // what the skipped tensors are, for the model's description ("the vision tower")
  } wrapper;
  // model_types, then wrapper.model_types: every config.json type the plugin reads.
  std::vector<std::string> all_model_types() const {
    std::vector<std::string> out = model_types;
    out.insert(out.end(), wrapper.model_types.begin(), wrapper.model_types.end());
    return out;
  }
};

// A family `plugin` reading config.json's `model_types` (the first its default shape), whose folders
// are transformers' `hf_class`: the description's start, its other fields as the kit's defaults.
// Kit 4.0.
LOOM_API DecoderFamily decoder_family(std::string plugin, std::vector<std::string> model_types, std::string hf_class);

// Qwen2's and Qwen3's local layers as their folders without layer_types say them: when
// use_sliding_window, layers from max_window_layers (default 28) on slide over sliding_window;
// and the same keys written back (beside layer_types) so transformers 4 reads them too.
LOOM_API void qwen_sliding_layers(DecoderConfig& config, const json::Value& file);
LOOM_API void write_qwen_sliding_layers(const DecoderConfig& config, nlohmann::json& out);
// Every other layer sliding over sliding_window, the first of them too, where no layer_types said
// otherwise (Gemma 2's and gpt-oss's folders without layer_types). Kit 4.1.
LOOM_API void alternate_sliding_layers(DecoderConfig& config);

// Gemma's keys (Gemma 2 and 3): hidden_activation (GeGLU where absent), query_pre_attn_scalar as
// attention_scale (a random model: head_dim), and from a file the soft-caps
// (final_logit_softcapping, attn_logit_softcapping; null: none); and the same written back. Kit 4.0.
LOOM_API void read_gemma_keys(DecoderConfig& config, const json::Value* file);
LOOM_API void write_gemma_keys(const DecoderConfig& config, nlohmann::json& out);

// Per-head RMSNorms of q and k before rotary, in the family's norm form (Qwen3, Gemma 3): the layer
// weights "self_attn.q_norm.weight" and "self_attn.k_norm.weight" of head_dim, their hook and what
// it keeps for backward.
LOOM_API void add_query_key_norms(DecoderFamily& family);

// The model plugin's option schema and factory for a family: `path` (an HF folder), `init`
// (pretrained or random) and the shape keys for a random model without a folder.
LOOM_API std::vector<OptionSpec> decoder_options(const DecoderFamily& family);
LOOM_API std::unique_ptr<Plugin> create_decoder(const DecoderFamily& family, const Options& options);

// A family's model plugin whole: FAMILY_FN returns its DecoderFamily (alive as long as the library).
#define LOOM_DECODER_FAMILY_PLUGIN(NAME, VERSION, SUMMARY, FAMILY_FN)                                                   \
  namespace loom_family_entry {                                                                                        \
  std::vector<::loom::OptionSpec> options() { return ::loom::kit::decoder_options(FAMILY_FN()); }                      \
  std::unique_ptr<::loom::Plugin> create(const ::loom::Options& o) { return ::loom::kit::create_decoder(FAMILY_FN(), o); } \
  std::vector<std::string> model_types() { return FAMILY_FN().all_model_types(); }                                     \
  }                                                                                                                    \
  LOOM_MODEL_PLUGIN(NAME, VERSION, SUMMARY, loom_family_entry::options, loom_family_entry::create, loom_family_entry::model_types)

// The pieces create_decoder() is made of, for families that need to reach past it.
LOOM_API DecoderConfig read_decoder_config(const DecoderFamily& family, const std::filesystem::path& path);
LOOM_API DecoderConfig decoder_config_from_options(const DecoderFamily& family, const Options& options);  // init = "random", no folder
LOOM_API void check_decoder_config(const DecoderConfig& config, const std::string& where);
LOOM_API std::string decoder_config_json(const DecoderFamily& family, const DecoderConfig& config);
// The inverse frequencies of a rotary over `dim` dimensions (rotary_dim); longrope takes its long
// factors when `long_context` (a sequence past original_max_positions).
LOOM_API std::vector<double> rope_inverse_frequencies(const RopeSettings& rope, std::int64_t dim, bool long_context = false);
LOOM_API ModelStructure describe_decoder(const DecoderFamily& family, const DecoderConfig& config);
// A dense decoder layer's values per token for a micro-batch of `tokens` tokens of `value_bytes`
// each (kit 4.2): describe_decoder's `block` values, unless the MLP runs in slices of rows
// (mlp_runs_in_chunks), when it keeps its input alone and works in one slice.
LOOM_API TokenCountedMemory::Values dense_layer_values(const DecoderConfig& config, const BlockInfo& block, std::uint64_t tokens,
                                                       std::int64_t value_bytes);
LOOM_API TensorParallelSupport decoder_tensor_parallel(const DecoderConfig& config, int tensor);
// Whether the decoder, training with a frozen head that no tensor group splits, takes the loss from
// the head's input (next_token_loss_sum_from_hidden): not in fp16 (whose gradient needs the loss
// scale before it is rounded), nor for a head as wide as its vocabulary (its input is told from
// logits by width). Scaled and soft-capped logits (Granite, Cohere, Gemma 2) are made so a slice at
// a time (kit 4.1). The loaded model and the plan's working set ask the same. Kit 1.1.
LOOM_API bool decoder_loss_from_head_input(const DecoderConfig& config, bool fp16);
// Builds the blocks on their devices and fills them from `folder` (empty: from the seed).
LOOM_API std::unique_ptr<LoadedModel> load_decoder(const DecoderFamily& family, const DecoderConfig& config,
                                                   const std::filesystem::path& folder, const LoadRequest& request);

// The K/V heads a tensor rank reads: its own shard when they split evenly, otherwise the whole
// projections replicated and the heads [first, first + count) its query heads use; nullopt when
// replicated K/V heads do not map onto the rank's query heads.
struct KvHeads {
  bool split = true;
  std::int64_t first = 0;
  std::int64_t count = 0;
};
LOOM_API std::optional<KvHeads> kv_heads_for(const DecoderConfig& config, int rank, int tensor);

}  // namespace loom::kit
