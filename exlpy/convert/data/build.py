"""How the built-in calibration files were made (run once by a developer; not imported at run time).

    python exlpy/convert/data/build.py DJANGO_WHEEL

prose.txt / chat.jsonl (documentation part): the Python language reference shipped with CPython
(Lib/pydoc_data/topics.py) and IDLE's help (Lib/idlelib/help.html), PSF License.
code.txt: CPython standard library modules, PSF License.
multilingual.txt: the translated message strings (msgstr) of Django's locale files, BSD-3-Clause.
chat.jsonl (hand-written part): dialogues written for exlpy, MIT like the project.
"""

from __future__ import annotations

import html
import json
import os
import random
import re
import sys
import sysconfig
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
STDLIB = sysconfig.get_paths()["stdlib"]
CODE_FILES = ["argparse.py", "dataclasses.py", "textwrap.py", "heapq.py", "bisect.py", "functools.py",
              "statistics.py", "fractions.py", "csv.py", "difflib.py", "json/decoder.py", "json/encoder.py",
              "json/__init__.py", "shlex.py", "string.py", "graphlib.py", "calendar.py", "colorsys.py",
              "copy.py", "contextlib.py", "pprint.py", "queue.py", "sched.py", "tokenize.py", "fnmatch.py",
              "glob.py", "ipaddress.py", "operator.py", "reprlib.py", "selectors.py", "weakref.py"]


def topics() -> dict[str, str]:
    ns: dict[str, dict[str, str]] = {}
    with open(os.path.join(STDLIB, "pydoc_data", "topics.py"), encoding="utf-8") as f:
        exec(f.read(), ns)  # noqa: S102 - CPython's own data module, a dict literal
    return ns["topics"]


def idle_help() -> str:
    with open(os.path.join(STDLIB, "idlelib", "help.html"), encoding="utf-8") as f:
        raw = f.read()
    raw = re.sub(r"<(script|style)[^>]*>.*?</\1>", " ", raw, flags=re.S)
    text = html.unescape(re.sub(r"<[^>]+>", "", raw))
    return re.sub(r"\n\s*\n+", "\n\n", text).strip()


def po_strings(wheel: str) -> list[tuple[str, str]]:
    out = []
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(z.namelist()):
            if not name.endswith(".po") or "/locale/" not in name:
                continue
            lang = name.split("/locale/")[1].split("/")[0]
            if lang.startswith("en"):
                continue
            text = z.read(name).decode("utf-8", "replace")
            for m in re.finditer(r'^msgstr(?:\[\d\])? ((?:".*"\n?)+)', text, flags=re.M):
                s = "".join(re.findall(r'"(.*)"', m.group(1))).encode().decode("unicode_escape", "ignore")
                try:
                    s = s.encode("latin-1").decode("utf-8")
                except (UnicodeEncodeError, UnicodeDecodeError):
                    pass
                if len(s) > 20 and "%(" not in s and "Project-Id-Version" not in s:
                    out.append((lang, s))
    return out


def main() -> None:
    rng = random.Random(69420)
    t = topics()
    keys = sorted(t)
    rng.shuffle(keys)
    half = len(keys) * 7 // 10
    prose = [t[k].strip() for k in keys[:half]] + [idle_help()]
    with open(os.path.join(HERE, "prose.txt"), "w", encoding="utf-8") as f:
        f.write("\n\n\n".join(prose)[:520_000])
    with open(os.path.join(HERE, "chat_docs.jsonl"), "w", encoding="utf-8") as f:
        for k in keys[half:]:
            body = t[k].strip()
            title = body.splitlines()[0].strip()
            q = rng.choice(["Can you explain {}?", "How does {} work in Python?", "What should I know about {}?",
                            "Tell me about {} in the Python language reference."]).format(title.lower())
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": body[:6000]}]}) + "\n")
    code = []
    for rel in CODE_FILES:
        with open(os.path.join(STDLIB, rel), encoding="utf-8") as f:
            code.append(f"# file: {rel}\n" + f.read())
    with open(os.path.join(HERE, "code.txt"), "w", encoding="utf-8") as f:
        f.write("\n\n".join(code)[:480_000])
    by_lang: dict[str, list[str]] = {}
    for lang, s in po_strings(sys.argv[1]):
        by_lang.setdefault(lang, []).append(s)
    lines = []
    for lang in sorted(by_lang):
        seen = list(dict.fromkeys(by_lang[lang]))
        lines.append(" ".join(seen[:60]))
    rng.shuffle(lines)
    with open(os.path.join(HERE, "multilingual.txt"), "w", encoding="utf-8") as f:
        f.write("\n\n".join(lines)[:480_000])


if __name__ == "__main__":
    main()
