# Sourced by the GPU scripts: the tokenizer families carried to the GPU machine. The ones the C++
# tests read (llama3, qwen3, llama2, gemma, gpt2, gemma3) and, with them, files that use every
# component the 26 families use (Digits, byte-level emoji entries, templates, Metaspace-free
# SentencePiece files with "▁" joins, ignore_merges, add_bos_token without a template).
GPU_TOKENIZER_FAMILIES="llama3 qwen3 llama2 gemma gpt2 gemma3 aya_expanse command_r_plus deepseek_v3 gptoss gpt4o llama3_1 internlm2 mistral_nemo baichuan2 yi chatglm3"
