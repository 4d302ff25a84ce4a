"""Extract llama.cpp's ``tests/test-chat.cpp`` PEG parse cases into JSON test data.

Run once by hand against a llama.cpp checkout (not by the test suite)::

    python tests/tools/extract_llama_cpp_chat_cases.py LLAMA_CPP_DIR > tests/data/llama_cpp_chat_cases.json

It reads the ``tst.test(input)...run()`` chains of ``test_template_output_peg_parsers`` and
``test_lfm2_parser``, evaluates the C++ string literals, the named tools and the named
expected messages, and records each case with its source line. Chains it cannot read are
recorded under ``unported`` with the reason, never dropped.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

TOKEN = re.compile(
    r'(?P<raw>R"(?P<delim>[^(\s]*)\((?P<rawbody>.*?)\)(?P=delim)")'
    r'|(?P<str>"(?:[^"\\]|\\.)*")'
    r"|(?P<chr>'(?:[^'\\]|\\.)*')"
    r"|(?P<comment>//[^\n]*|/\*.*?\*/)"
    r"|(?P<id>[A-Za-z_][A-Za-z_0-9:]*)"
    r"|(?P<num>\d+)"
    r"|(?P<ws>\s+)"
    r"|(?P<p>.)",
    re.S,
)

ESC = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "'": "'", "0": "\0"}


def unescape(body: str) -> str:
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        n = body[i + 1]
        if n == "x":
            m = re.match(r"[0-9a-fA-F]+", body[i + 2 :])
            assert m
            out.append(chr(int(m.group(0), 16)))
            i += 2 + len(m.group(0))
        elif n == "u":
            out.append(chr(int(body[i + 2 : i + 6], 16)))
            i += 6
        else:
            out.append(ESC[n])
            i += 2
    return out and "".join(out) or ""


def tokenize(src: str) -> list[tuple[str, Any, int]]:
    """(kind, value, line) tokens; adjacent string literals are joined like C++ does."""
    toks: list[tuple[str, Any, int]] = []
    line = 1
    for m in TOKEN.finditer(src):
        kind = m.lastgroup
        text = m.group(0)
        if kind == "delim" or kind == "rawbody":
            kind = "raw"
        if kind == "raw":
            val = m.group("rawbody")
            # utf-8 bytes in the file are already decoded; raw strings are verbatim
            kind = "str"
        elif kind == "str":
            val = unescape(text[1:-1])
            # C++ byte escapes (\xNN) build UTF-8 sequences: re-decode them
            try:
                val = (
                    val.encode("latin-1").decode("utf-8")
                    if any(0x80 <= ord(ch) < 0x100 for ch in val)
                    else val
                )
            except (UnicodeEncodeError, UnicodeDecodeError):
                pass
        elif kind in ("comment", "ws"):
            line += text.count("\n")
            continue
        else:
            val = text
        if kind == "str" and toks and toks[-1][0] == "str":
            toks[-1] = ("str", toks[-1][1] + val, toks[-1][2])
        else:
            toks.append((kind, val, line))
        line += text.count("\n")
    return toks


class Unsupported(Exception):
    pass


class Reader:
    def __init__(self, toks: list[tuple[str, Any, int]], env: dict[str, Any]) -> None:
        self.toks = toks
        self.env = env

    def expr(self, i: int) -> tuple[Any, int]:
        """Evaluate one expression starting at token i; return (value, next index).

        ``a + b`` of strings (C++ ``std::string`` concatenation) is joined.
        """
        value, i = self.primary(i)
        while isinstance(value, str) and self.toks[i][1] == "+":
            right, i = self.primary(i + 1)
            if not isinstance(right, str):
                raise Unsupported("+ of a non-string")
            value += right
        return value, i

    def primary(self, i: int) -> tuple[Any, int]:
        kind, val, _ = self.toks[i]
        if kind == "str":
            return val, i + 1
        if kind == "num":
            return int(val), i + 1
        if kind == "p" and val == "{":
            items = []
            i += 1
            while not (self.toks[i][0] == "p" and self.toks[i][1] == "}"):
                v, i = self.expr(i)
                items.append(v)
                if self.toks[i][1] == ",":
                    i += 1
            return items, i + 1
        if kind == "id":
            if val in ("true", "false"):
                return val == "true", i + 1
            if self.toks[i + 1][1] == "(" and val in FUNCS:
                args = []
                i += 2
                while self.toks[i][1] != ")":
                    v, i = self.expr(i)
                    args.append(v)
                    if self.toks[i][1] == ",":
                        i += 1
                return FUNCS[val](*args), i + 1
            if val in self.env:
                return self.env[val], i + 1
            if val.startswith("COMMON_"):
                return val, i + 1
            raise Unsupported(f"unknown name {val}")
        raise Unsupported(f"unexpected token {val!r}")


def msg(
    content: str = "", reasoning: str = "", name: str = "", args: str = "", cid: str = ""
) -> dict[str, Any]:
    calls = [{"name": name, "arguments": args, "id": cid}] if name or cid else []
    return {"content": content, "reasoning": reasoning, "tool_calls": calls}


def multi(reasoning: str, content: str, calls: list[list[str]]) -> dict[str, Any]:
    return {
        "content": content,
        "reasoning": reasoning,
        "tool_calls": [{"name": n, "arguments": a, "id": ""} for n, a in calls],
    }


FUNCS = {
    "simple_assist_msg": msg,
    "message_with_tool_calls": lambda n, a: msg("", "", n, a),
    "message_with_tool_calls_and_reasoning": lambda n, a, r: msg("", r, n, a),
    "message_with_reasoning_content_and_multiple_tool_calls": multi,
    "message_with_content_and_tool_call": lambda c, n, a: msg(c, "", n, a),
    "message_with_reasoning_and_tool_call": lambda r, n, a: msg("", r, n, a),
}


def load_env(toks: list[tuple[str, Any, int]]) -> dict[str, Any]:
    """Named tools (``static common_chat_tool x{name, description, params}``) and messages."""
    env: dict[str, Any] = {}
    r = Reader(toks, env)
    for i, (kind, val, _) in enumerate(toks):
        if (
            kind == "id"
            and val == "common_chat_tool"
            and toks[i + 1][0] == "id"
            and toks[i + 2][1] == "{"
        ):
            try:
                items, _ = r.expr(i + 2)
                env[toks[i + 1][1]] = {
                    "name": items[0],
                    "description": items[1],
                    "parameters": json.loads(items[2]) if items[2].strip("{} \n") else {},
                }
            except (Unsupported, IndexError, ValueError):
                pass
        if (
            kind == "id"
            and val == "common_chat_msg"
            and toks[i + 1][0] == "id"
            and toks[i + 2][1] == "="
        ):
            try:
                env[toks[i + 1][1]], _ = r.expr(i + 3)
            except Unsupported:
                pass
    return env


SKIP_NOT_PARSING = {"messages", "add_generation_prompt", "continue_final_message", "json_schema"}


def main(root: str) -> None:
    path = Path(root) / "tests" / "test-chat.cpp"
    src = path.read_text(encoding="utf-8")
    toks = tokenize(src)
    env = load_env(toks)
    # the kimi id tool call is built in a local block; add the one named message we need
    r = Reader(toks, env)
    cases: list[dict[str, Any]] = []
    unported: list[dict[str, Any]] = []
    testers: dict[str, list[str]] = {}
    start = next(i for i, t in enumerate(toks) if t[1] == "test_lfm2_parser")
    lfm2 = ["LFM2-8B-A1B.jinja", "LFM2.5-Instruct.jinja", "LFM2.5-8B-A1B.jinja"]
    loop_paths: list[str] = []
    i = start
    while i < len(toks):
        kind, val, line = toks[i]
        if kind == "id" and val == "for" and toks[i + 1][1] == "(":
            # for (const auto & path : { "a", "b" })
            j = i + 2
            depth = 1
            while depth and toks[j][1] != ":":
                depth += {"(": 1, ")": -1}.get(toks[j][1], 0)
                j += 1
            if depth and toks[j + 1][1] == "{":
                lst, _ = r.expr(j + 1)
                if all(isinstance(x, str) for x in lst):
                    loop_paths = [Path(x).name for x in lst]
        if (
            kind == "id"
            and val in ("std::string", "auto")
            and toks[i - 1][1] == "const"
            and toks[i + 1][0] == "id"
            and toks[i + 2][1] == "="
        ):
            # a local string (const std::string call = "..." + "...";) used by later cases
            try:
                value, _ = r.expr(i + 3)
                if isinstance(value, str):
                    env[toks[i + 1][1]] = value
            except (Unsupported, IndexError, KeyError):
                pass
        if kind == "id" and val == "peg_tester" and toks[i + 1][1] == "(":
            var = toks[i - 2][1]
            arg = toks[i + 2]
            if arg[0] == "str":
                testers[var] = [Path(arg[1]).name]
            elif arg[1] == "template_path":
                testers[var] = lfm2
            else:
                testers[var] = loop_paths
        if kind == "id" and val in testers and toks[i + 1][1] == "." and toks[i + 2][1] == "test":
            case_line = line
            j = i + 2
            chain: list[tuple[str, list[Any]]] = []
            err = None
            try:
                while True:
                    name = toks[j][1]
                    assert toks[j + 1][1] == "("
                    j += 2
                    args = []
                    if name in SKIP_NOT_PARSING:  # prompt-side: skip its arguments unread
                        depth = 1
                        while depth:
                            depth += {"(": 1, ")": -1}.get(toks[j][1], 0)
                            j += 1
                        j -= 1
                    while toks[j][1] != ")":
                        v, j = r.expr(j)
                        args.append(v)
                        if toks[j][1] == ",":
                            j += 1
                    j += 1
                    chain.append((name, args))
                    if name == "run":
                        break
                    if toks[j][1] != ".":
                        raise Unsupported("chain does not end with run()")
                    j += 1
            except (Unsupported, AssertionError, IndexError, KeyError) as exc:
                err = str(exc) or type(exc).__name__
            for tpl in testers[val]:
                entry: dict[str, Any] = {
                    "template": tpl,
                    "source": f"tests/test-chat.cpp:{case_line}",
                }
                if err:
                    entry["reason"] = f"cannot read the case: {err}"
                    unported.append(entry)
                    continue
                case = build(chain, entry)
                if "reason" in case:
                    unported.append(case)
                else:
                    cases.append(case)
            i = j
            continue
        i += 1
    doc = {
        "license": "Cases from llama.cpp tests/test-chat.cpp (llama-cpp-python 0.3.36 sdist, "
        "llama.cpp @0c1e57098); MIT, copyright the ggml authors: see llama_cpp_templates/LICENSE.",
        "cases": cases,
        "unported": unported,
        "xfail": {},
    }
    sys.stdout.write(json.dumps(doc, ensure_ascii=False, indent=1) + "\n")


def build(chain: list[tuple[str, list[Any]]], entry: dict[str, Any]) -> dict[str, Any]:
    case = dict(entry)
    case.update(
        input=chain[0][1][0],
        tools=[],
        reasoning_format="none",
        enable_thinking=True,
        parallel_tool_calls=False,
        tool_choice="auto",
        is_partial=False,
    )
    expect = {"content": "", "reasoning": "", "tool_calls": []}
    for name, args in chain[1:]:
        if name in SKIP_NOT_PARSING:
            case["reason"] = f"prompt-side feature ({name}): not a parse case"
            return case
        if name == "tools":
            case["tools"] = [
                t
                if isinstance(t, dict)
                else {"name": t[0], "description": t[1], "parameters": json.loads(t[2])}
                for t in args[0]
            ]
        elif name == "reasoning_format":
            case["reasoning_format"] = args[0].replace("COMMON_REASONING_FORMAT_", "").lower()
        elif name in ("enable_thinking", "parallel_tool_calls", "is_partial"):
            case[name] = args[0]
        elif name == "tool_choice":
            case["tool_choice"] = args[0].replace("COMMON_CHAT_TOOL_CHOICE_", "").lower()
        elif name == "expect":
            expect = dict(args[0])
        elif name == "expect_content":
            expect["content"] = args[0]
        elif name == "expect_reasoning":
            expect["reasoning"] = args[0]
        elif name == "expect_tool_calls":
            expect["tool_calls"] = [
                {
                    "name": c[0],
                    "arguments": c[1],
                    "id": c[2] if len(c) > 2 and isinstance(c[2], str) else "",
                }
                for c in args[0]
            ]
        elif name in ("expect_reconstruction", "run"):
            pass
        else:
            case["reason"] = f"unknown builder call {name}"
            return case
    case["expect"] = expect
    return case


if __name__ == "__main__":
    main(sys.argv[1])
