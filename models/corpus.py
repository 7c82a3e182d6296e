"""The demo models' text: the CPython standard library's source, split into training and
held-out files by a hash of each path (so the split is the same wherever it is computed).

Plain standard library, so the benchmark can pick held-out prompts without torch. The
benchmarks' prompt set lives here too, so that offline measurements (models/) and the
daemon's benchmarks (client/) read the same prompts.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from pathlib import Path

SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "_bundled"}


def stdlib_sources() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(relative path, text) of the stdlib's modules, split ~95/5 by a hash of the path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held_out = [], []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if set(relative.parts[:-1]) & SKIPPED_DIRS:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        bucket = int(hashlib.sha1(str(relative).encode()).hexdigest(), 16) % 20
        (held_out if bucket == 0 else train).append((str(relative), text))
    return train, held_out


CHAT_PROMPTS = [
    "Write a function that returns the n-th Fibonacci number.",
    "Write a function that reads a file and returns its lines without trailing whitespace.",
    "Write a function that merges two sorted lists.",
    "Write a function that checks whether a string is a palindrome.",
]
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
FORGET_PROMPT = "# -*- coding: utf-8 -*-\n"  # shares no prefix with the prompts that matter


def code_prompts(count: int, context_lines: int = 30) -> list[str]:
    """The first substantial function of each held-out file, cut after its signature (and its
    docstring, which says what to write), with up to ``context_lines`` lines before it."""
    prompts = []
    for path, text in stdlib_sources()[1]:
        if path.startswith(("encodings/", "idlelib/")):  # codec tables, GUI glue: untypical
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and len(node.body) >= 3:
                first = node.body[0]
                has_docstring = isinstance(first, ast.Expr) and isinstance(
                    getattr(first, "value", None), ast.Constant
                )
                end = first.end_lineno if has_docstring else first.lineno - 1
                start = max(0, node.lineno - 1 - context_lines)
                prompts.append("\n".join(lines[start:end]) + "\n")
                break
        if len(prompts) == count:
            break
    return prompts


def prompt_set(code: int) -> list[str]:
    """``code`` code prompts, then the chat prompts."""
    return code_prompts(code) + [CHAT.format(prompt) for prompt in CHAT_PROMPTS]
