"""Record llama.cpp's greedy continuations of a few prompts as JSON lines, for tests/e2e*.rs.

Usage: python record-llama-cpp-greedy.py MODEL.gguf OUT.jsonl [PROMPTS.jsonl]
(PROMPTS.jsonl: take the prompts of an earlier recording, in its order, instead of the list below)
(with llama-cpp-python installed; the committed assets were made with 0.3.36 = llama.cpp 0c1e57098).

Per prompt: the prompt's ids (BOS only if the model adds one; special tokens parsed), then 24
greedy tokens (top-k 1), or fewer if an end-of-generation token comes (it is kept). For each
generated token, `logit` is llama.cpp's logit of that token at that step, so a test can check
logits as well as choices.
"""
import json
import sys

import llama_cpp
import numpy as np

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
    # Over 512 tokens: Gemma 3's local layers see only the last 512 positions.
    "Here is a list of numbers: " + ", ".join(str(i) for i in range(1, 241)) + ". Now a story. Once upon a time",
]
N = 24

model, out = sys.argv[1], sys.argv[2]
if len(sys.argv) > 3:
    with open(sys.argv[3]) as f:
        PROMPTS = [json.loads(line)["prompt"] for line in f if line.strip()]
llm = llama_cpp.Llama(model_path=model, n_ctx=2048, n_batch=2048, n_threads=2, verbose=False)
with open(out, "w") as f:
    for prompt in PROMPTS:
        llm.reset()
        ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        llm.eval(ids)
        out_ids, logits = [], []
        for _ in range(N):
            last = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
            row = np.ctypeslib.as_array(last, shape=(llm.n_vocab(),)).copy()
            tok = int(np.argmax(row))
            out_ids.append(tok)
            logits.append(round(float(row[tok]), 4))
            if llama_cpp.llama_token_is_eog(llm._model.vocab, tok):
                break
            llm.eval([tok])
        text = llm.detokenize(out_ids).decode(errors="replace")
        f.write(json.dumps({"prompt": prompt, "prompt_ids": ids, "ids": out_ids, "logits": logits, "text": text}) + "\n")
        print(len(ids), repr(text), file=sys.stderr)
