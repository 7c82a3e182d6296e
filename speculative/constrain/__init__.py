"""Structured output: a grammar that every emitted token must keep valid.

``grammars`` turns what a request asks for (a JSON schema, any JSON object, a regular
expression, a Lark or GBNF grammar) into one compiled grammar, refusing what cannot compile;
``token_table`` makes the grammar library's view of the target's vocabulary; ``constraint``
holds one request's grammar state: the target's rows masked to what the grammar allows
after each drafted node's prefix, the tokens the grammar forces, and the state advanced by
what is emitted. Importable without torch or llama.cpp.
"""
