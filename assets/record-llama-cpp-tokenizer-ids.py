"""Record llama.cpp's token ids for a set of texts as JSON lines, for tests/tokenizer_reference.rs.

Usage: python record-llama-cpp-tokenizer-ids.py OUT.jsonl MODEL.gguf [MODEL.gguf ...]
(with llama-cpp-python installed; the committed llama-cpp-tokenizer-ids.jsonl was made with 0.3.36 =
llama.cpp 0c1e57098 from SmolLM2-135M-Instruct.Q4_1.gguf and gemma-3-270m-q4_k_m.gguf, in that order,
the files `gen --model smollm2-135m` and `--model gemma3-270m` fetch into gen's cache).

Per model and text, one line: the model's file name, the text, and llama.cpp's ids for it with special
tokens parsed (`<|im_start|>` is one token) and no BOS, which is what gen's `encode(text, false)` must give.
Only the vocabulary is loaded (vocab_only), so no weights are read and nothing is computed.
"""
import json
import os
import sys

import llama_cpp

TEXTS = [
    "The capital of France is",
    "Hello, world! 123456789 3.14159",
    "naïve café résumé — “quotes” and ‘single’",
    "你好，世界。日本語のテキスト。한국어",
    "emoji: 🦀🚀👍🏽 and flags 🇫🇷",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n-1) + fibonacci(n-2)\n",
    "  leading spaces\tand\ttabs\n\n\nnewlines   trailing  ",
    # Chat markup: special tokens for SmolLM2, plain text for Gemma 3 (it has other markers).
    "<|im_start|>user\nHi 123<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, there was a little girl named Lily.",
    "URLs like https://example.com/a?b=c&d=e#frag and emails a.b@c.org",
]

if len(sys.argv) < 3:
    sys.exit("usage: record-llama-cpp-tokenizer-ids.py OUT.jsonl MODEL.gguf [MODEL.gguf ...]")
out, models = sys.argv[1], sys.argv[2:]
with open(out, "w", encoding="utf-8") as f:
    for model in models:
        llm = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
        for text in TEXTS:
            ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
            line = {"model": os.path.basename(model), "text": text, "ids": ids, "add_special_tokens": False}
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
        print(os.path.basename(model), len(TEXTS), "texts", file=sys.stderr)
