# Sourced by the GPU scripts: the tokenizer families carried to the GPU machine. The ones the C++
# tests read (llama3, qwen3, llama2, gemma, gpt2, gemma3) and, with them, files that use every
# component the 26 families use (Digits, byte-level emoji entries, templates, Metaspace-free
# SentencePiece files with "▁" joins, ignore_merges, add_bos_token without a template).
GPU_TOKENIZER_FAMILIES="llama3 qwen3 llama2 gemma gpt2 gemma3 aya_expanse command_r_plus deepseek_v3 gptoss gpt4o llama3_1 internlm2 mistral_nemo baichuan2 yi chatglm3"
# The families the C++ suite reads (hf("...") and model_dir("...") in tests/, and HfJson's lists:
# gemma, gpt2): carried with every GPU call in .debs/test-data.tar.xz (about 12 MB), so HfJson
# runs there. The rest of the list above
# travels only for bench/run_tokenizer.sh (.bench-data/tokenizer-families.tar.xz): the tree,
# the packages and every family together pass the 64 MiB a call carries.
GPU_TEST_FAMILIES="llama3 qwen3 llama2 gemma gpt2 gemma3"
