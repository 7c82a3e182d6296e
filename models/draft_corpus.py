"""Text for a draft model that is not distilled from its target: what this machine ships.

English prose and code that Debian's and Python's own packages install, so it is here
offline on every machine of this kind: the manual pages (``/usr/share/man/man1..8``, troff
reduced to text), the package documentation under ``/usr/share/doc`` (READMEs and other
plain text), and the CPython standard library's source with its docstrings. Chat-formatted
examples are made from them (a manual page's NAME line and a function's docstring answer a
question about it), so the draft learns the chat frame an instruction model answers in.
Never the target's outputs.

Every document is split into training and held-out parts by a hash of its path, the same
wherever it is computed.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import re
from collections.abc import Iterator
from pathlib import Path

from hetspec.models.corpus import stdlib_sources

MAN_ROOT = Path("/usr/share/man")
DOC_ROOT = Path("/usr/share/doc")
MAN_SECTIONS = ("man1", "man5", "man7", "man8")
DOC_NAMES = re.compile(r"(README|NEWS|FAQ|TODO|HOWTO|\.txt$|\.md$)", re.IGNORECASE)
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
MAX_DOCUMENT_CHARS = 40_000
PAGES_PER_FAMILY = 40

_ESCAPES = re.compile(r"\\f[BIRP1-4]|\\f\(..|\\f\[[^]]*\]|\\s[+-]?\d|\\[&|^%]|\\\*\(..|\\\*.")
_NAMED = {
    r"\-": "-",
    r"\(em": "--",
    r"\(en": "-",
    r"\(aq": "'",
    r"\(dq": '"',
    r"\e": "\\",
    r"\(bu": "*",
    r"\ ": " ",
    r"\(lq": '"',
    r"\(rq": '"',
    r"\(co": "(c)",
}


def troff_text(source: str) -> str:
    """A manual page's words: requests dropped (section headings kept as lines), font and
    size escapes removed, the common named characters spelled."""
    lines = []
    for raw in source.splitlines():
        if raw.startswith(('.\\"', "'\\\"", '.\\"')):
            continue
        if raw.startswith((".SH", ".SS")):
            heading = raw[3:].strip().strip('"')
            if heading:
                lines.append("\n" + heading)
            continue
        line = raw
        if raw.startswith((".B ", ".I ", ".BR ", ".IR ", ".RB ", ".BI ", ".IB ", ".RI ")):
            line = raw.split(" ", 1)[1].replace('"', "")
        elif raw.startswith((".", "'")):
            if raw.startswith((".PP", ".P", ".LP", ".TP", ".IP", ".sp", ".br")):
                lines.append("")
            continue
        for escape, text in _NAMED.items():
            line = line.replace(escape, text)
        lines.append(_ESCAPES.sub("", line))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def held_out(name: str) -> bool:
    """One document in 20, by a hash of its name."""
    return int(hashlib.sha1(name.encode()).hexdigest(), 16) % 20 == 0


def chat(question: str, answer: str) -> str:
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
        f"<|im_start|>assistant\n{answer}<|im_end|>\n"
    )


def manual_pages() -> Iterator[tuple[str, str]]:
    """(path, text) of each English manual page in the sections that describe commands,
    files and concepts, at most ``PAGES_PER_FAMILY`` of one family (gcloud ships thousands
    of near-identical pages)."""
    families: dict[str, int] = {}
    for section in MAN_SECTIONS:
        for path in sorted((MAN_ROOT / section).glob("*.gz")):
            family = re.split(r"[-_.]", path.name, maxsplit=1)[0]
            families[family] = families.get(family, 0) + 1
            if families[family] > PAGES_PER_FAMILY:
                continue
            try:
                with gzip.open(path, "rt", encoding="utf-8", errors="replace") as handle:
                    text = troff_text(handle.read(MAX_DOCUMENT_CHARS * 2))
            except (OSError, EOFError):
                continue
            if len(text) > 200 and not text.startswith(".so"):
                yield str(path), text[:MAX_DOCUMENT_CHARS]


def package_docs() -> Iterator[tuple[str, str]]:
    """(path, text) of plain-text package documentation."""
    for path in sorted(DOC_ROOT.rglob("*")):
        if not path.is_file() or not DOC_NAMES.search(path.name) or path.suffix == ".gz":
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) > 200:
            yield str(path), text[:MAX_DOCUMENT_CHARS]


def manual_questions(path: str, text: str) -> list[str]:
    """'What does the command X do?' answered with its NAME line and first paragraph."""
    match = re.search(r"NAME\n+(.+?)\n\n", text, re.DOTALL)
    if not match or " - " not in match[1]:
        return []
    name, _, summary = match[1].replace("\n", " ").partition(" - ")
    description = re.search(r"DESCRIPTION\n+(.+?)(\n\n|$)", text, re.DOTALL)
    answer = f"`{name.strip()}` is a command that {summary.strip().rstrip('.')}."
    if description:
        answer += "\n\n" + " ".join(description[1].split())
    return [chat(f"What does `{name.split(',')[0].strip()}` do?", answer)]


def docstring_questions(text: str) -> list[str]:
    """'What does the function f do?' answered with its docstring, 'Write f' with its code."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines()
    examples = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 40:
            continue
        examples.append(chat(f"What does the Python function `{node.name}` do?", doc))
        if node.end_lineno and node.end_lineno - node.lineno < 40:
            code = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            first = doc.split("\n\n")[0].replace("\n", " ")
            examples.append(chat(f"Write a Python function: {first}", f"```python\n{code}\n```"))
    return examples


def draft_corpus() -> tuple[list[str], list[str]]:
    """(training documents, held-out documents)."""
    train: list[str] = []
    held: list[str] = []
    for path, text in manual_pages():
        documents = [text, *manual_questions(path, text)]
        (held if held_out(path) else train).extend(documents)
    for path, text in package_docs():
        (held if held_out(path) else train).append(text)
    code_train, code_held = stdlib_sources()
    for documents, part in ((code_train, train), (code_held, held)):
        for _, text in documents:
            part.append(text)
            part.extend(docstring_questions(text))
    return train, held
