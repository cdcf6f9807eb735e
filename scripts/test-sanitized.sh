#!/usr/bin/env bash
# CI's second stage (.ci/run, after scripts/test.sh): builds loom again with clang under
# AddressSanitizer and UndefinedBehaviorSanitizer (scripts/build-sanitized.sh), runs the tests the
# sanitizers add something to, and gives every libFuzzer target a short run over its seed corpus.
# The tests: parsers and readers (pipelines, options, JSON and safetensors files, data, hostile
# input, plugin libraries, the command line, model configs), tokenizers, the CPU paths of the
# kernels and 4-bit quantization, the loss, the optimizers (8-bit codes) and schedules, the stage runner, chat templates, export (GGUF), and one end-to-end run
# per feature (resume after SIGKILL in one process, data and pipeline parallelism launched, tensor x
# pipeline launched and as threads, the output folder's ownership and lock, resume, validate). The
# mesh matrix, the tokenizer parity against the JS reference and the out-of-tree plugin run the
# same code as the first stage: docs/testing.md. Then the formats library built on its own
# (scripts/test-formats.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
scripts/setup-debian.sh --tests --sanitizers
scripts/build-sanitized.sh
suites='Pipeline|RunConfig|Options|OptionSpec|Diagnostics|DidYouMean|Safetensors|RemoveTree|HostileInput|Data|CompletionOnly|Registry|Cli|Models|Moe|MoeCheckpoint|Families/MoeFamily|Experts/ParityExperts'
suites+='|LlamaStructure|ParityShards|FoldedAdapters|Tokenizers/EveryFamily|HfJson|Bytes|Quantize|QLora|Loss|Layers|PipelineSchedules|ActivationCheckpointing'
suites+='|PipelineParallel|OutputFolder|Resume|Validate|ChatTemplates|RunPage|TensorBoard|MetricsSink|SlidingWindow|Gemma3|Olmo2|Phi3|Rope|Kernels|Devices'
suites+='|Export|Optimizers|LearningRate|Pieces|Families/Parity|Families/ParityGreedy|Families/FamilyBlocks|FamilyConfigs|LongRows|Families/LongRows'
tests='Training\.ResumeAfterSigkill|DataParallel\.ResumeAfterSigkill|MeshMatrix\.LauncherRunsWhatThreadsRun'
# LibTorch keeps process-lifetime allocations, so leak checking is off; every other finding fails.
status=0
ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 ctest --test-dir build-fuzz --output-on-failure -j 2 \
  -R "^(fetch_test_data$|($suites)(\.|$)|($tests))" || status=$?
scripts/slowest-tests.sh build-fuzz
[ "$status" -eq 0 ] || exit "$status"
scripts/fuzz.sh --runs 2000
# The formats library alone (no LibTorch, leak checking on): its tests and its fuzz target.
scripts/test-formats.sh --runs 2000
echo "test-sanitized.sh: $((SECONDS - started)) s"
