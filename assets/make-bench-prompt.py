"""Write bench-prompt-1000.txt, the long prompt of benches/speed.rs and the text benches/batch.rs cuts its
prompts from: the opening of the GNU General Public License version 3 (from its Preamble on), each
paragraph joined onto one line, paragraphs separated by a blank line, cut after 4,813 characters (no
final newline). That is 1,000 tokens for SmolLM2-135M's tokenizer.

Usage: python make-bench-prompt.py [GPL-3 TEXT] [OUT]
(defaults: /usr/share/common-licenses/GPL-3, as Debian and Ubuntu ship it, or any copy of
https://www.gnu.org/licenses/gpl-3.0.txt; and bench-prompt-1000.txt beside this script).
The license permits verbatim copies; this is an excerpt used as input text, not as a license.
"""
import os
import re
import sys

LENGTH = 4813

src = sys.argv[1] if len(sys.argv) > 1 else "/usr/share/common-licenses/GPL-3"
out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench-prompt-1000.txt")
text = open(src, encoding="utf-8").read()
start = text.index("Preamble")
paragraphs = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text[start:])]
prompt = "\n\n".join(p for p in paragraphs if p)[:LENGTH]
with open(out, "w", encoding="utf-8") as f:
    f.write(prompt)
print(f"{out}: {len(prompt)} characters", file=sys.stderr)
