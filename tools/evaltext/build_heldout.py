"""Rebuild the public-domain part of the built-in evaluation text (``general-en-heldout``).

The built-in held-out set is the project's original hand-transcribed prose (the first part of
``quantjob/fewerbits_quantjob/data/general-en-heldout.txt``, kept unchanged so earlier figures
stay comparable) followed by the output of this script: about 180 KB of public-domain English
from four kinds of writing, interleaved in blocks of about 4 KB so that any prefix of the file,
and so any number of evaluation windows, mixes them:

- US presidential State of the Union addresses (1957 Eisenhower, 1962 Kennedy, 1986 Reagan,
  2002 G. W. Bush): works of the US federal government, public domain under 17 U.S.C. 105. Text
  as compiled by Kathleen Ahrens from C-SPAN transcripts, read from NLTK's `state_union`
  corpus data (nltk_data, packages/corpora/state_union.zip).
- Shakespeare, As You Like It (1623), acts I and II: public domain. Text of the Canterbury
  Corpus file `asyoulik.txt`, as shipped in the Brotli source distribution on PyPI
  (brotli 1.2.1, tests/testdata/).
- Milton, Paradise Lost (1667), book I: public domain. Canterbury Corpus `plrabn12.txt` (the
  1992 Project Gutenberg release), Brotli 1.2.1 sdist; the Project Gutenberg introduction and
  notices are left out.

    python tools/evaltext/build_heldout.py STATE_UNION_DIR CANTERBURY_DIR > appended.txt

No text from the calibration set (``general-en``) is used: Carroll's Alice, which the
Canterbury Corpus also has, is part of the calibration text and so is left out here.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

BLOCK_CHARS = 4000
SPEECHES = ("1957-Eisenhower.txt", "1962-Kennedy.txt", "1986-Reagan.txt", "2002-GWBush.txt")
SPEECH_CHARS = 24000


def speech(path: Path) -> list[str]:
    lines = [" ".join(line.split()) for line in path.read_text(encoding="latin-1").splitlines()]
    paras = [p for p in lines[1:] if p]  # line 1 is the title
    out, size = [], 0
    for p in paras:
        if size >= SPEECH_CHARS:
            break
        out.append(p)
        size += len(p)
    return out


def blank_separated(text: str) -> list[str]:
    return [p.strip("\n") for p in re.split(r"\n[ \t]*\n", text) if p.strip()]


def as_you_like_it(path: Path) -> list[str]:
    text = path.read_text(encoding="latin-1").replace("\r\n", "\n")
    start = text.index("\nACT I\n")
    end = text.index("\nACT III\n")
    return [" ".join(p.split()) for p in blank_separated(text[start:end])]


def paradise_lost(path: Path) -> list[str]:
    text = path.read_text(encoding="latin-1").replace("\r\n", "\n")
    start = text.index("Of Man's first disobedience")
    end = text.index("Book II ")
    body = "\n".join(line.rstrip() for line in text[start:end].splitlines())
    # Verse paragraphs start with an indented line; keep the line breaks as spaces.
    paras = re.split(r"\n(?=  \S)", body)
    return [" ".join(p.split()) for p in paras if p.strip()]


MIN_PARAGRAPH = 200


def merged(paras: list[str]) -> list[str]:
    """Short paragraphs (a stage direction, a one-line speech) joined to the next: every sample
    is at least MIN_PARAGRAPH characters, as the built-in sets promise."""
    out: list[str] = []
    cur = ""
    for p in paras:
        cur = f"{cur} {p}" if cur else p
        if len(cur) >= MIN_PARAGRAPH:
            out.append(cur)
            cur = ""
    if cur and out:
        out[-1] = f"{out[-1]} {cur}"
    elif cur:
        out.append(cur)
    return out


def blocks(paras: list[str]) -> list[list[str]]:
    paras = merged(paras)
    out, cur, size = [], [], 0
    for p in paras:
        cur.append(p)
        size += len(p)
        if size >= BLOCK_CHARS:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def main(state_union: str, canterbury: str) -> str:
    sources = [blocks(speech(Path(state_union) / name)) for name in SPEECHES]
    sources.append(blocks(as_you_like_it(Path(canterbury) / "asyoulik.txt")))
    sources.append(blocks(paradise_lost(Path(canterbury) / "plrabn12.txt")))
    merged: list[str] = []
    for i in range(max(len(s) for s in sources)):
        for s in sources:
            if i < len(s):
                merged.extend(s[i])
    return "\n\n".join(merged) + "\n"


if __name__ == "__main__":
    sys.stdout.write(main(sys.argv[1], sys.argv[2]))
