"""Record how llama.cpp pre-tokenizes a set of texts for every `tokenizer.ggml.pre` name, for the
pre-tokenizer test in src/tokenizer.rs.

Usage: python record-llama-cpp-pre-splits.py LLAMA_CPP_SOURCE OUT.json
(LLAMA_CPP_SOURCE: the llama.cpp tree .ci/llama-server unpacks, two folders above the binary it
prints; the committed file was made from llama.cpp 0c1e57098, the one llama-cpp-python 0.3.36
vendors. Needs a C++17 compiler.)

Nothing is re-typed: the script copies llama.cpp's own code. From src/llama-vocab.cpp it takes the
pre-tokenizer enum, the `switch` in `llm_tokenizer_bpe` that picks each type's regex list, and the
table in `llama_vocab::impl::load` from names to types and flags; it compiles that switch with
src/unicode.cpp and src/unicode-data.cpp into a small program that runs `unicode_regex_split`
(without the byte-level mapping) on each text for each type. The texts are every input of the vocab
tests in models/*.inp, hand-picked edge cases, and seeded random strings drawn from characters on
which the splitters are known to differ (case, marks, Han, digits of several scripts, Unicode
whitespace, ...).

Output: one JSON object. `names`: per pre name, its type and the flags that change ids
(`ignore_merges`, `add_bos`, and `raw_utf8` for the types llama.cpp merges without the byte-level
mapping). `texts`: the texts. `splits`: per type, one list per text of the pieces' lengths in
characters (empty pieces left out: they make no tokens), or the name of an earlier type that cuts
every text the same way.
"""
import json
import os
import random
import re
import subprocess
import sys
import tempfile


def block(src, start, open_ch="{", close_ch="}"):
    """The text from `start` to the bracket closing the first one opened at or after it."""
    i = src.index(open_ch, start)
    depth = 0
    while True:
        c = src[i]
        if c == '"':  # skip string literals (they hold braces)
            i += 1
            while src[i] != '"':
                i += 2 if src[i] == "\\" else 1
        elif c == open_ch:
            depth += 1
        elif c == close_ch:
            depth -= 1
            if depth == 0:
                return src[start : i + 1]
        i += 1


def names_table(vocab_cpp):
    """name -> (type, flags) from the `tokenizer_pre == "..."` chain of the BPE branch."""
    start = vocab_cpp.index("if (type == LLAMA_VOCAB_TYPE_BPE) {")
    body = block(vocab_cpp, start)
    table = {}
    # Each arm: a condition naming strings, then a body setting pre_type and flags.
    for arm in re.finditer(r"if \(((?:[^{}])*?)\)\s*\{([^{}]*)\}", body):
        cond, arm_body = arm.group(1), arm.group(2)
        names = re.findall(r'tokenizer_pre == "([^"]+)"', cond)
        ty = re.search(r"pre_type = LLAMA_VOCAB_PRE_TYPE_(\w+);", arm_body)
        if not ty:
            continue
        # (The first arm, a missing or empty name, reads as `default`.)
        flags = {
            "ignore_merges": "ignore_merges = true;" in arm_body,
            "add_bos": "add_bos = true;" in arm_body,
        }
        for name in names:
            table[name] = (ty.group(1), flags)
    return table


EDGE_CASES = [
    "",
    "Hello World",
    "HelloWorld HELLOworld helloWORLD",
    "I'm you're we've they'll she'd it's I'M YOU'RE WE'VE",
    "don't DON'T Don'T l'amour",
    "ab1234cd 1 12 123 1234 12345 123456 1234567",
    "x  12 y\t\t345\n\n6789",
    "1234567890123",
    "version 3.14159, 2,000,000 and 10.000",
    "١٢٣٤٥ ७८९ ²³ Ⅻ 〇",
    "你好世界 你好，世界。 日本語のテキスト カタカナ",
    "한국어 텍스트 ㄱㄴㄷ ㄅㄆㄇ",
    "𠀀𠀁 𪜀 豈 豈 丽",
    "naïve café résumé Ελληνικά Кириллица",
    "e\u0301 a\u0308b \u0301x \u093f\u0915",
    "ſ K İ µ ῼ ώ",
    "a\u00a0b\u3000c\u2003d\u1680e\u0085f",
    "  \u3000\u3000。、 ！？",
    "trailing spaces   ",
    "\r\n\r\n  \n \t\n",
    "tabs\tand\vvertical\ftabs",
    "emoji 🦀🚀👍🏽 ✅ and flags 🇫🇷",
    "<sentinel:12> IMGIMGABCZ IMGIMGAZ",
    "def f(x):\n    return x**2  # comment\n",
    "path/to/file.txt https://example.com/a?b=c&d=e#frag",
    "ÀÉÎÕÜ àéîõü ÀéÎõÜ",
    "\ue000\u0378\ufffd",
    "$100 +5 <tag> a^b `code` |pipe| ~tilde €5 ©2024",
    "หกดเ ภาษาไทย ພາສາລາວ ភាសាខ្មែរ မြန်မာ",
    "ｈｅｌｌｏ　ｗｏｒｌｄ ＡＢＣ",
    "word  word   word    word",
    "The quick brown fox jumps over the lazy dog.",
    "a1b22c333d4444e55555",
    "  1234  ",
    "abc\n1234\n",
    # The examples of the unit tests in src/tokenizer.rs.
    "ab1234cd",
    "123456",
    "12 3456789 x",
    "x  12",
    "no digits",
    "٣٤ and ७",
    "価格は1234円, x12",
    "HelloWorld 12345",
    "中文English混合 it's 12345",
    "e\u0301tÉ CamelCase",
    "by the way 1234567",
    "。\u3000",
    "中\u2003文",
    "HelloWorld",
    "helloWorld's",
    "HELLOWorld's",
]

# Characters the random strings are drawn from, in runs: each class is a way splitters differ.
POOL = {
    "lower": "abcdefghijklmnopqrstuvwxyz",
    "upper": "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "digit": "0123456789",
    "other_digit": "٣७²Ⅻ",
    "space": "     ",
    "ws": "\t\n\r\u000b\u000c\u00a0\u3000\u2003\u1680\u0085",
    "punct": "'!\"#$%&()*+,-./:;<=>?@[\\]^_`{|}~",
    "apos": "'sStTmMdDlLrReEvV",
    "mark": "\u0301\u0308\u093f\u0e34",
    "latin": "éÉßøØıİſµÿ",
    "greek_cyr": "αΩώῼбЖѣ",
    "han": "一龥你好世界丽",
    "han_ext": "𠀀𪜀豈豈",
    "kana": "あアヿ゠",
    "hangul": "가힣ㄱㄅ",
    "cjk_punct": "。、！？，：“”…—",
    "fullwidth": "！Ａｚ／～",
    "thai_etc": "กเ่ພក",
    "symbol": "€©™±→∀🦀👍",
    "odd": "\ue000\u0378\ufffd\u200b",
}


def random_texts(n, seed=20240611):
    rng = random.Random(seed)
    classes = list(POOL)
    texts = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 8)):
            chars = POOL[rng.choice(classes)]
            parts.append("".join(rng.choice(chars) for _ in range(rng.randint(1, 5))))
        texts.append("".join(parts))
    return texts


def vocab_test_inputs(models_dir):
    texts = []
    sep = "\n__ggml_vocab_test__\n"
    for name in sorted(os.listdir(models_dir)):
        if name.endswith(".inp"):
            with open(os.path.join(models_dir, name), encoding="utf-8") as f:
                raw = f.read()
            parts = raw.split(sep)
            if parts and parts[-1] == "":
                parts.pop()
            texts.extend(parts)
    return texts


HARNESS = r"""
#include "unicode.h"
#include <cstdio>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

%(enum)s

static std::vector<std::string> regexes_for(llama_vocab_pre_type pre_type) {
    std::vector<std::string> regex_exprs;
    bool byte_encode = true;
    %(switch)s
    (void) byte_encode;
    return regex_exprs;
}

int main(int argc, char ** argv) {
    // stdin: texts separated by NUL; argv: type numbers. stdout: per type and text, one line of
    // piece lengths in bytes.
    std::string all((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    std::vector<std::string> texts;
    size_t pos = 0;
    while (pos <= all.size()) {
        size_t next = all.find('\0', pos);
        if (next == std::string::npos) break;
        texts.push_back(all.substr(pos, next - pos));
        pos = next + 1;
    }
    for (int a = 1; a < argc; ++a) {
        auto regexes = regexes_for((llama_vocab_pre_type) std::stoi(argv[a]));
        for (const auto & text : texts) {
            // llama.cpp never splits an empty fragment (and its splitters fail on one).
            if (text.empty()) {
                printf("\n");
                continue;
            }
            try {
                auto words = unicode_regex_split(text, regexes, false);
                for (const auto & w : words) {
                    if (!w.empty()) printf("%%zu ", w.size());
                }
                printf("\n");
            } catch (const std::exception & e) {
                printf("error: %%s\n", e.what());
            }
        }
    }
    return 0;
}
"""


def main():
    root, out = sys.argv[1], sys.argv[2]
    with open(os.path.join(root, "src", "llama-vocab.cpp"), encoding="utf-8") as f:
        vocab_cpp = f.read()
    with open(os.path.join(root, "src", "llama-vocab.h"), encoding="utf-8") as f:
        vocab_h = f.read()

    enum_start = vocab_h.index("enum llama_vocab_pre_type {")
    enum = block(vocab_h, enum_start) + ";"
    types = dict(
        (name, int(num))
        for name, num in re.findall(r"LLAMA_VOCAB_PRE_TYPE_(\w+)\s*=\s*(\d+)", enum)
    )
    ctor = vocab_cpp.index("llm_tokenizer_bpe(const llama_vocab & vocab) {")
    switch_start = vocab_cpp.index("switch (vocab.get_pre_type())", ctor)
    switch = block(vocab_cpp, switch_start).replace("vocab.get_pre_type()", "pre_type", 1)

    table = names_table(vocab_cpp)
    used_types = sorted(set(t for t, _ in table.values()) | {"DEFAULT"})

    texts = []
    seen = set()
    for t in (
        vocab_test_inputs(os.path.join(root, "models")) + EDGE_CASES + random_texts(120)
    ):
        if t not in seen and "\0" not in t:
            seen.add(t)
            texts.append(t)

    with tempfile.TemporaryDirectory() as tmp:
        cpp = os.path.join(tmp, "pre_splits.cpp")
        exe = os.path.join(tmp, "pre_splits")
        with open(cpp, "w", encoding="utf-8") as f:
            f.write(HARNESS % {"enum": enum, "switch": switch})
        src = os.path.join(root, "src")
        subprocess.run(
            ["c++", "-std=c++17", "-O1", "-I", src, cpp,
             os.path.join(src, "unicode.cpp"), os.path.join(src, "unicode-data.cpp"), "-o", exe],
            check=True,
        )
        stdin = b"".join(t.encode("utf-8") + b"\0" for t in texts)
        result = subprocess.run(
            [exe] + [str(types[t]) for t in used_types], input=stdin, capture_output=True
        )
        if result.returncode != 0:
            sys.exit(f"{exe} failed: {result.stderr.decode()[-2000:]}")
    lines = result.stdout.decode().split("\n")
    splits = {}
    for k, ty in enumerate(used_types):
        per_text = []
        for i, text in enumerate(texts):
            line = lines[k * len(texts) + i]
            if line.startswith("error: "):
                sys.exit(f"llama.cpp fails on {text!r} for {ty}: {line}\n"
                         + result.stderr.decode()[-2000:])
            byte_lens = [int(x) for x in line.split()]
            data = text.encode("utf-8")
            assert sum(byte_lens) == len(data), (ty, text, byte_lens)
            lens, at = [], 0
            for n in byte_lens:
                lens.append(len(data[at : at + n].decode("utf-8")))
                at += n
            per_text.append(lens)
        splits[ty] = per_text

    raw_utf8 = set()
    for ty in used_types:
        case = re.search(r"case LLAMA_VOCAB_PRE_TYPE_%s:.*?break;" % ty, switch, re.S)
        if case and "byte_encode = false" in case.group(0):
            raw_utf8.add(ty)
    names = {}
    for name, (ty, flags) in sorted(table.items()):
        names[name] = dict(type=ty, raw_utf8=ty in raw_utf8, **flags)

    with open(out, "w", encoding="utf-8") as f:
        f.write("{\n")
        f.write('"names": {\n')
        f.write(",\n".join(
            "  %s: %s" % (json.dumps(n), json.dumps(v)) for n, v in names.items()))
        f.write("\n},\n")
        f.write('"texts": [\n')
        f.write(",\n".join("  " + json.dumps(t, ensure_ascii=False) for t in texts))
        f.write("\n],\n")
        f.write('"splits": {\n')
        entries, first_with = [], {}
        for ty, per_text in splits.items():
            key = json.dumps(per_text)
            if key in first_with:
                # The same pieces as an earlier type: name it instead.
                entries.append("  %s: %s" % (json.dumps(ty), json.dumps(first_with[key])))
                continue
            first_with[key] = ty
            entries.append("  %s: [\n%s\n  ]" % (json.dumps(ty), ",\n".join(
                "    " + json.dumps(s, separators=(",", ":")) for s in per_text)))
        f.write(",\n".join(entries))
        f.write("\n}\n}\n")
    print(f"{len(names)} names, {len(used_types)} types, {len(texts)} texts -> {out}")


if __name__ == "__main__":
    main()
