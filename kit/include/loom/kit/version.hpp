#pragma once
// The kit's version, apart from the SDK's: the kit is a library plugins may link (the generic
// decoder and its building blocks), not the contract the host checks. A minor adds; a major may
// change what a family description holds. find_package(Loom) sets Loom_KIT_VERSION to it (the
// package's own version is the SDK's); a plugin links the kit it was built with.
//   1.1: next_token_loss_sum_from_hidden (loss.hpp); generation's blocks: few_row_products and its
//        kin, decode_step_attention (blocks.hpp).
//   1.2: attention_segments, segment_attention_serves, segment_attention, swiglu (blocks.hpp).
//   1.3: GreedyStepRows, greedy_decode_step (blocks.hpp).
//   2.0: sliding windows and per-layer attention kinds: DecoderConfig's rotary settings move into
//        RopeSettings (rope, local_rope) and it gains layer_attention; layer_window, layer_rope;
//        rope_inverse_frequencies takes one RopeSettings; attention_allowed and segment_attention
//        take a window (blocks.hpp); a sliding layer's cache holds its window. Norms: NormForm,
//        DecoderNames' attention_out_norm and mlp_out_norm, rms_norm_offset; Activation (hidden_act),
//        geglu; attention_scale, final_logit_softcap, embedding_scaled; add_query_key_norms,
//        LOOM_DECODER_FAMILY_PLUGIN.
//   3.0: fused projections: DecoderNames' qkv and gate_up (layer_linears, output_pieces), a column
//        split by pieces (part_of_pieces, gather_pieces, column_pieces; ShardedWeight and
//        make_linear take pieces); DecoderConfig's partial_rotary_factor (rotary_dim), apply_rotary
//        over a head's first dimensions; RopeSettings' yarn and longrope (rope_inverse_frequencies
//        takes the rotary's dimensions and the long context) and attention_factor.
//   3.1: the device's kernel choice (loom/kit/kernels.hpp: compute capabilities and
//        LOOM_DEVICE_CAPABILITY, the few-row product table, pin_product_kernel, cuda_architectures);
//        compat's cuda_device_capability and limit_cuda_memory; models by hub id from the local
//        Hugging Face cache (loom/kit/hub_cache.hpp), the decoder families' `revision` option.
//   3.2: the run's optimizer in the memory model (OptimizerMemory, count_optimizer_as,
//        counted_optimizer in loom/kit/memory.hpp); dynamic_map_8bit_unsigned, AdamW8bitStep and
//        adamw_8bit_step (quantize.hpp).
//   3.3: mixtures of experts' shared pieces (loom/kit/moe.hpp): RouterSettings, Routing, route,
//        grouped_experts, load_balancing_loss.
//   3.4: mixture-of-experts families: MoeConfig (DecoderConfig::moe), layer_is_sparse,
//        DecoderFamily::MixtureOfExperts, DecoderNames' router and experts (layer_linears takes
//        whether the layer is sparse); RouterSums, router_sums (moe.hpp).
//   3.5: grouped_experts over an expert group, ExpertsMatrix (stored experts), experts_run_on_device
//        (moe.hpp): experts shared out by expert parallelism, 4-bit experts; swiglu_halves (blocks.hpp).
//   3.6: replace_invalid_utf8 (utf8.hpp).
//   3.7: kit_version and the layout minor (this header), recorded in a plugin's descriptor (SDK
//        3.13) and checked when it loads; utf8_bom_size, without_bom (utf8.hpp); json::read_file
//        skips a byte-order mark.
//   3.8: pieces for blocks written as code (blocks.hpp): layer_norm, layer_norm_float,
//        apply_rotary_interleaved, soft_cap, clamped_swiglu, AttentionExtras and attention_exact
//        (scores soft-capped, attention sinks); routers (moe.hpp): GroupedSigmoidRouting and
//        route_sigmoid_grouped (DeepSeek-V3), route_top_k_softmax (gpt-oss); dequantize_mxfp4
//        (quantize.hpp: gpt-oss's released experts).
//   4.0: blocks written as code (loom/kit/decoder_block.hpp): DecoderFamily::block, BlockBuilder,
//        DecoderBlock, LayerPass, attend(), Norm, grouped_query_attention, gated_mlp, plain_mlp,
//        activate, block_shape, BlockWeight (rows_apart); LayerNorms in
//        NormForm (kLayer, kLayerFloat), norm_has_bias, rms_norm_as takes a bias;
//        DecoderConfig's family (a family's own settings), attention_softcap,
//        embedding_multiplier and logit_multiplier; DecoderFamily::ignored; shared experts
//        (DecoderNames' shared_expert and shared_expert_gate, MoeConfig's width,
//        MixtureOfExperts::shared_size_key); decoder_family(), read_gemma_keys, write_gemma_keys;
//        Experts (BlockBuilder::experts, a
//        family's router through route_with), shared_by_heads and LayerPass::tensor_group;
//        n_routed_experts read as the expert count.
//   4.1: experts in gpt-oss's form (moe.hpp): ExpertActivation (gate and up interleaved, a clamped
//        SwiGLU) and each expert's biases, taken by grouped_experts, Experts and
//        BlockBuilder::experts (Experts::bias, activation); MixtureOfExperts::stacked_transposed
//        (experts saved stacked [E, in, out], or as MXFP4 blocks and scales); remember() (a block's
//        own generation cache: DeepSeek's latent) and DecoderFamily::cache_values_per_position;
//        SplitTensor and VocabularySplit (tensor_parallel.hpp: the shell's split tensors and
//        vocabulary without collectives of its own), shared_by_heads over a group; HeadLogits and
//        next_token_loss_sum_from_hidden of scaled, soft-capped logits, head_logits (loss.hpp);
//        alternate_sliding_layers (decoder.hpp).
//        The layout changed:
//        Experts and DecoderFamily grew, grouped_experts' parameters.
//   4.2: count_checkpoints_offloaded, counted_checkpoints_offloaded (memory.hpp): recomputed
//        layers' inputs counted in host memory; a long row's MLP in slices of rows:
//        set_mlp_slice_bytes, mlp_slice_bytes, mlp_chunk_rows, mlp_runs_in_chunks,
//        mlp_over_row_chunks, random_state, set_random_state (blocks.hpp), any_trains
//        (decoder_block.hpp), dense_layer_values (decoder.hpp); next_token_logps_from_hidden
//        (loss.hpp).
// A minor may only add: functions, types, members at the end of nothing. A minor whose change a
// plugin built against an older one cannot run with (a struct that grew, a class given a base, a
// function's parameters changed) raises LOOM_KIT_LAYOUT_MINOR to itself, and the host refuses
// plugins built against older minors, naming both versions. scripts/check-abi.sh holds the kit to
// this against every recorded minor's ABI (abi/). The layouts changed in 3.4 (DecoderConfig::moe)
// and 3.5 (LoraAdapter gained ExpertAdapterSizing as a base; grouped_experts' parameters), 4.1.
#define LOOM_KIT_VERSION_MAJOR 4
#define LOOM_KIT_VERSION_MINOR 2
#define LOOM_KIT_LAYOUT_MINOR 1

#ifdef __cplusplus
#include <cstdint>

#include "loom/export.hpp"
#include "loom/version.hpp"

namespace loom {

// The kit version the code that includes this header builds against, for its plugin descriptor
// (LOOM_PLUGIN, loom/plugin.hpp, which declares the fallback of a plugin without the kit: 0).
constexpr std::uint32_t built_kit_version(int) { return (std::uint32_t{LOOM_KIT_VERSION_MAJOR} << 16) | LOOM_KIT_VERSION_MINOR; }

namespace kit {

// The kit library loaded in this process (not the headers a plugin was built with), and the
// oldest minor of its major whose plugins it runs (LOOM_KIT_LAYOUT_MINOR). Kit 3.7.
LOOM_API Version kit_version();
LOOM_API std::uint16_t kit_layout_minor();

}  // namespace kit
}  // namespace loom
#endif
