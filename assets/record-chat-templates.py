"""Record how Hugging Face transformers renders the real chat templates in chat-templates/, as JSON
lines for tests/chat_templates.rs, which checks that gen's `ChatTemplate` renders the same bytes.

Usage: python3 record-chat-templates.py [OUT.jsonl]   (default: chat-template-renders.jsonl here)
Needs jinja2 >= 3.1.6 (pip install jinja2); transformers itself is not needed.

The Jinja environment is set up the way transformers' `apply_chat_template` sets it up (see
transformers/utils/chat_template_utils.py): a sandbox that forbids mutating lists and dicts,
trim_blocks and lstrip_blocks, the loop-controls extension, a `{% generation %}` tag that renders
its body, `raise_exception`, `strftime_now`, and a `tojson` filter that is json.dumps (non-ASCII
kept, with its indent / separators / sort_keys arguments). The template sees `messages`,
`add_generation_prompt`, `bos_token` and `eos_token` (the only special tokens these templates
read), and `tools` and `documents` set to None, as there. Left out: transformers' guards on
`dict` and `namespace`, which only refuse names starting with an underscore.

`strftime_now` reads a fixed clock (NOW below), which the Rust test gives gen's renderer, so the
expected texts do not change with the day they were recorded.

One line per (template, conversation, add_generation_prompt):
  {"template", "conversation", "add_generation_prompt", "bos_token", "eos_token", "now",
   "messages", and either "text" (the render) or "error" (what jinja2 raised):
   {"type": exception class, "message": text, "raised": true when the template called
   raise_exception}}.
Templates that mention tools also get lines with "tools" (OpenAI's tools array, passed as `tools`) for a user
question and for a conversation with an assistant tool call (arguments as an object, as transformers documents
them) and the tool's result.
Templates with a thinking switch (their source reads `enable_thinking`) also get lines with
"enable_thinking": true and false (what `--reasoning on|off` passes), for every conversation and
for one whose earlier assistant turn holds its thinking (which most templates drop from history).
"""
import datetime
import json
import os
import sys

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATES = os.path.join(HERE, "chat-templates")
NOW = datetime.datetime(2026, 3, 14, 9, 26, 53)

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Réponds en français si on te le demande."}
USER_1 = {"role": "user", "content": "Hello! Who are you?"}
ASSISTANT_1 = {"role": "assistant", "content": "I am an assistant.  How can I help you today?"}
USER_2 = {"role": "user", "content": "What is 2 + 2?\nAnswer in one line — no more. 日本語でも OK.\n"}

CONVERSATIONS = {
    "user": [USER_1],
    "system+user": [SYSTEM, USER_1],
    "user+assistant+user": [USER_1, ASSISTANT_1, USER_2],
    "system+user+assistant+user": [SYSTEM, USER_1, ASSISTANT_1, USER_2],
}

# An earlier reply that kept its thinking, as a client that stores whole replies sends it back.
ASSISTANT_THOUGHT = {"role": "assistant", "content": "<think>\nThe user greets me.\n</think>\n\nI am an assistant."}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city's name."}},
                   "required": ["city"]}}}]
USER_W = {"role": "user", "content": "What is the weather in Paris?"}
ASSISTANT_CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": "{\"temperature\": 18}"}
TOOL_CONVERSATIONS = {"tools:user": [USER_W], "tools:call+result": [USER_W, ASSISTANT_CALL, TOOL_RESULT]}
THINKING_CONVERSATIONS = dict(CONVERSATIONS, **{"user+thought+user": [USER_1, ASSISTANT_THOUGHT, USER_2]})

# Special tokens of the model a template comes from, by the start of its file name; the rest get
# generic ones. Only bos_token and eos_token are read by these templates.
TOKENS = [
    ("meta-llama-", "<|begin_of_text|>", "<|eot_id|>"),
    ("deepseek-ai-DeepSeek-R1-Distill-", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    ("deepseek-ai-", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    ("google-gemma-", "<bos>", "<eos>"),
    ("microsoft-Phi-3.5", "<s>", "<|endoftext|>"),
    ("Qwen", "", "<|im_end|>"),
]
GENERIC = ("<s>", "</s>")


def special_tokens(name):
    for prefix, bos, eos in TOKENS:
        if name.startswith(prefix):
            return bos, eos
    return GENERIC


class TemplateRaised(jinja2.TemplateError):
    """What `raise_exception(message)` raises, told apart from jinja2's own errors."""


def raise_exception(message):
    raise TemplateRaised(message)


def strftime_now(fmt):
    return NOW.strftime(fmt)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's text for transformers'
    token masks; rendering outputs the body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def environment():
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def error(e):
    return {"type": type(e).__name__, "message": str(e), "raised": isinstance(e, TemplateRaised)}


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "chat-template-renders.jsonl")
    env = environment()
    rendered = raised = 0
    with open(out_path, "w", encoding="utf-8") as out:
        for name in sorted(os.listdir(TEMPLATES)):
            if not name.endswith(".jinja"):
                continue
            with open(os.path.join(TEMPLATES, name), encoding="utf-8") as f:
                source = f.read()
            bos, eos = special_tokens(name)
            try:
                template, compile_error = env.from_string(source), None
            except jinja2.TemplateError as e:
                template, compile_error = None, error(e)
            cases = [(c, m, g, None) for c, m in CONVERSATIONS.items() for g in (True, False)]
            if "tool" in source:
                cases += [(c, m, True, "tools") for c, m in TOOL_CONVERSATIONS.items()]
            if "enable_thinking" in source:
                cases += [(c, m, True, t) for c, m in THINKING_CONVERSATIONS.items() for t in (True, False)]
            for conversation, messages, add_generation_prompt, thinking in cases:
                record = {
                    "template": name,
                    "conversation": conversation,
                    "add_generation_prompt": add_generation_prompt,
                    "bos_token": bos,
                    "eos_token": eos,
                    "now": NOW.isoformat(),
                    "messages": messages,
                }
                switch = {}
                tools = None
                if thinking == "tools":
                    record["tools"] = tools = TOOLS
                elif thinking is not None:
                    record["enable_thinking"] = switch["enable_thinking"] = thinking
                try:
                    if compile_error:
                        record["error"] = compile_error
                    else:
                        record["text"] = template.render(
                            messages=[dict(m) for m in messages],
                            add_generation_prompt=add_generation_prompt,
                            bos_token=bos,
                            eos_token=eos,
                            tools=tools,
                            documents=None,
                            **switch,
                        )
                except Exception as e:  # noqa: BLE001 - any failure is the expected outcome
                    record["error"] = error(e)
                if "text" in record:
                    rendered += 1
                else:
                    raised += 1
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"{out_path}: {rendered} renders, {raised} errors", file=sys.stderr)


if __name__ == "__main__":
    main()
