// The ABI probe: every public header of the SDK and the kit in one translation unit, compiled with
// full debug information, every type it declares kept and described whole (GCC's
// -fno-eliminate-unused-debug-types -femit-class-debug-always; scripts/check-abi.sh builds it), so
// that abidw --load-all-types records the layout of every struct, class and enum plugins share
// with the host and the kit, whether or not a library function mentions it (scripts/check-abi.sh).
// A header added to sdk/include/loom or kit/include/loom/kit is added here (Registry.AbiProbeIncludesEveryPublicHeader).
#include "loom/adapter.hpp"
#include "loom/capability.hpp"
#include "loom/collator.hpp"
#include "loom/communicator.hpp"
#include "loom/devices.hpp"
#include "loom/error.hpp"
#include "loom/export.hpp"
#include "loom/layers.hpp"
#include "loom/mesh.hpp"
#include "loom/model.hpp"
#include "loom/objective.hpp"
#include "loom/options.hpp"
#include "loom/placement.hpp"
#include "loom/plugin.hpp"
#include "loom/reward.hpp"
#include "loom/schedule.hpp"
#include "loom/tokenizer.hpp"
#include "loom/version.hpp"
#include "loom/kit/atomic_file.hpp"
#include "loom/kit/blocks.hpp"
#include "loom/kit/collate.hpp"
#include "loom/kit/decoder.hpp"
#include "loom/kit/decoder_block.hpp"
#include "loom/kit/hub_cache.hpp"
#include "loom/kit/input_file.hpp"
#include "loom/kit/json.hpp"
#include "loom/kit/kernels.hpp"
#include "loom/kit/lora.hpp"
#include "loom/kit/loss.hpp"
#include "loom/kit/memory.hpp"
#include "loom/kit/moe.hpp"
#include "loom/kit/quantize.hpp"
#include "loom/kit/regex.hpp"
#include "loom/kit/safetensors.hpp"
#include "loom/kit/schedule.hpp"
#include "loom/kit/tensor_parallel.hpp"
#include "loom/kit/torch_compat.hpp"
#include "loom/kit/utf8.hpp"
#include "loom/kit/version.hpp"

// abidw reads a library only where it exports a symbol.
extern "C" __attribute__((visibility("default"))) int loom_abi_probe() { return 0; }

// abidiff compares a class's virtual functions only where an exported function reaches the class:
// one for each class with virtuals (scripts/check-abi.sh refuses a probe that leaves one out).
#define LOOM_ABI_REACH(name, type) \
  extern "C" __attribute__((visibility("default"))) void loom_abi_reach_##name(const type*) {}
LOOM_ABI_REACH(loom_Adapter, loom::Adapter)
LOOM_ABI_REACH(loom_AllToAll, loom::AllToAll)
LOOM_ABI_REACH(loom_AuxiliaryLoss, loom::AuxiliaryLoss)
LOOM_ABI_REACH(loom_BaseStoringAdapter, loom::BaseStoringAdapter)
LOOM_ABI_REACH(loom_Capability, loom::Capability)
LOOM_ABI_REACH(loom_ChatTemplateSource, loom::ChatTemplateSource)
LOOM_ABI_REACH(loom_Collator, loom::Collator)
LOOM_ABI_REACH(loom_Communicator, loom::Communicator)
LOOM_ABI_REACH(loom_DeltaAddedInPlace, loom::DeltaAddedInPlace)
LOOM_ABI_REACH(loom_DenseWeight, loom::DenseWeight)
LOOM_ABI_REACH(loom_ExpertAdapterSizing, loom::ExpertAdapterSizing)
LOOM_ABI_REACH(loom_ExpertParallel, loom::ExpertParallel)
LOOM_ABI_REACH(loom_ExpertShards, loom::ExpertShards)
LOOM_ABI_REACH(loom_ExpertStructure, loom::ExpertStructure)
LOOM_ABI_REACH(loom_ExpertWeights, loom::ExpertWeights)
LOOM_ABI_REACH(loom_FoldableDelta, loom::FoldableDelta)
LOOM_ABI_REACH(loom_FrozenHeadWorkingSet, loom::FrozenHeadWorkingSet)
LOOM_ABI_REACH(loom_TokenCountedMemory, loom::TokenCountedMemory)
LOOM_ABI_REACH(loom_HeadTokenLogps, loom::HeadTokenLogps)
LOOM_ABI_REACH(loom_LinearAdapter, loom::LinearAdapter)
LOOM_ABI_REACH(loom_LinearWeight, loom::LinearWeight)
LOOM_ABI_REACH(loom_LoadedModel, loom::LoadedModel)
LOOM_ABI_REACH(loom_Model, loom::Model)
LOOM_ABI_REACH(loom_Objective, loom::Objective)
LOOM_ABI_REACH(loom_PackedSequences, loom::PackedSequences)
LOOM_ABI_REACH(loom_Parallel, loom::Parallel)
LOOM_ABI_REACH(loom_Placement, loom::Placement)
LOOM_ABI_REACH(loom_Plugin, loom::Plugin)
LOOM_ABI_REACH(loom_Reward, loom::Reward)
LOOM_ABI_REACH(loom_StaticCacheDecoding, loom::StaticCacheDecoding)
LOOM_ABI_REACH(loom_StaticCacheSizing, loom::StaticCacheSizing)
LOOM_ABI_REACH(loom_StaticCacheWindow, loom::StaticCacheWindow)
LOOM_ABI_REACH(loom_TensorParallelModel, loom::TensorParallelModel)
LOOM_ABI_REACH(loom_Tokenizer, loom::Tokenizer)
LOOM_ABI_REACH(loom_WholeProduct, loom::WholeProduct)
LOOM_ABI_REACH(loom_Work, loom::Work)
LOOM_ABI_REACH(loom_kit_DecoderBlock, loom::kit::DecoderBlock)
LOOM_ABI_REACH(loom_kit_LoraAdapter, loom::kit::LoraAdapter)
LOOM_ABI_REACH(loom_kit_QuantizedWeight, loom::kit::QuantizedWeight)
LOOM_ABI_REACH(loom_kit_ShardedWeight, loom::kit::ShardedWeight)
LOOM_ABI_REACH(loom_kit_SplitWeight, loom::kit::SplitWeight)
